"""The decode step of decoders with past, timed round-robin (what passes that choose a kernel by speed measure)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

from graphopt.generate.cache import new_cache
from graphopt.generate.loop import Decoder


def step_seconds(decoders: Sequence[Decoder], *, prompt: int = 16, steps: int = 16, rounds: int = 3) -> list[float]:
    """Median seconds of one decode step (batch 1, after a ``prompt``-token prefill) of each decoder, measured
    round-robin (``rounds`` times ``steps`` steps each, interleaved so that a slow phase of the machine hits
    every candidate alike)."""
    times: list[list[float]] = [[] for _ in decoders]
    ids = (np.arange(prompt, dtype=np.int64) % 97 + 3)[None, :]
    for _ in range(rounds):
        for j, dec in enumerate(decoders):
            cache = new_cache(dec.sig, 1, prompt + steps)
            mask = np.ones((1, prompt), np.int64)
            pos = np.arange(prompt, dtype=np.int64)[None, :]
            logits = dec.step(cache, ids, mask, pos)
            for s in range(steps):
                tok = np.argmax(logits, axis=-1)[:, None].astype(np.int64)
                mask = np.ones((1, prompt + s + 1), np.int64)
                t0 = time.perf_counter()
                logits = dec.step(cache, tok, mask, np.array([[prompt + s]], np.int64))
                times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]

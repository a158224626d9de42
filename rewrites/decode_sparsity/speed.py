"""Decode-step timing of ``decode-sparsity`` candidates: batch 1, 1 thread, round-robin medians.

The candidates and the input model are timed in turns (``rounds`` x ``steps`` decode steps each after a
short prefill), so a slow phase of a shared machine hits every one alike; what is compared is the median
step of each, as a ratio to the input's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

from graphopt.generate.cache import KVCache
from graphopt.generate.loop import Decoder


def decode_step_seconds(decoders: Sequence[Decoder], *, prompt: int = 16, steps: int = 16,
                        rounds: int = 3) -> list[float]:
    """Median seconds of one decode step of each decoder (greedy, after a ``prompt``-token prefill)."""
    times: list[list[float]] = [[] for _ in decoders]
    start = (np.arange(prompt, dtype=np.int64) * 7 % 89 + 5)[None, :]
    for _ in range(rounds):
        for j, dec in enumerate(decoders):
            cache = KVCache(dec.sig, 1, prompt + steps)
            logits = dec.step(cache, start, np.ones((1, prompt), np.int64), np.arange(prompt, dtype=np.int64)[None])
            for s in range(steps):
                tok = np.argmax(logits, axis=-1)[:, None].astype(np.int64)
                t0 = time.perf_counter()
                logits = dec.step(cache, tok, np.ones((1, prompt + s + 1), np.int64),
                                  np.array([[prompt + s]], np.int64))
                times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]

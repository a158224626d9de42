"""Perplexity over non-overlapping windows of a token sequence, and the held-out text the decoder benchmark uses.

::

    tokens  t0 t1 ... t511 | t512 ... t1023 | ...        windows of ``window`` tokens, the last one may be shorter
    scored     t1 ... t511 |      t513 ... t1023 | ...   every token but each window's first, from the logits
                                                          of the position before it (nothing crosses a window)

``perplexity = exp(sum of negative log-likelihoods / scored tokens)``; a window of one token scores nothing
and is left out. ``logits_fn(window_ids) -> [len(window), vocab]`` is any runtime's logits for a whole window
fed from an empty cache, so every runtime is scored on exactly the same windows.

The default text (``data/heldout.txt``) is the "Execution model" chapter of the Python 3.11 language reference
as CPython ships it in its standard library (``pydoc_data/topics.py``, ``topics['execmodel']``), copied
unchanged: English prose that no graphopt recipe or budget was ever tuned on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from graphopt.generate import quality

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "heldout.txt"
DEFAULT_WINDOW = 512

LogitsFn = Callable[[Sequence[int]], np.ndarray]


def windows(ids: Sequence[int], window: int = DEFAULT_WINDOW) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens (the last may be shorter; windows of one token dropped)."""
    if window < 2:
        raise ValueError(f"a perplexity window needs at least 2 tokens (got {window})")
    out = [list(ids[i:i + window]) for i in range(0, len(ids), window)]
    return [w for w in out if len(w) > 1]


def window_nll(logits: np.ndarray, window: Sequence[int]) -> float:
    """Sum of the negative log-likelihoods of ``window[1:]`` given ``logits`` [len(window), vocab]."""
    logits = np.asarray(logits)
    if logits.ndim == 3:
        logits = logits[0]
    if logits.shape[0] != len(window):
        raise ValueError(f"logits cover {logits.shape[0]} positions, the window has {len(window)} tokens")
    return quality.nll(logits[:-1], window[1:])


@dataclasses.dataclass(frozen=True)
class Perplexity:
    ppl: float
    tokens: int  # scored tokens
    windows: int

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "ppl_tokens": self.tokens, "ppl_windows": self.windows}


def perplexity(logits_fn: LogitsFn, ids: Sequence[int], window: int = DEFAULT_WINDOW) -> Perplexity:
    """Perplexity of ``ids`` under ``logits_fn`` over non-overlapping windows (module docstring)."""
    ws = windows(ids, window)
    if not ws:
        raise ValueError("the perplexity text has fewer than 2 tokens")
    nll = sum(window_nll(logits_fn(w), w) for w in ws)
    n = sum(len(w) - 1 for w in ws)
    return Perplexity(float(np.exp(nll / n)), n, len(ws))


def read_text(path: str | Path | None = None) -> str:
    """The text of ``path``, or the bundled held-out text."""
    return Path(path or DEFAULT_TEXT).read_text(encoding="utf-8")

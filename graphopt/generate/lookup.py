"""Draft tokens for speculative decoding: the ``Draft`` interface and prompt lookup (no model, no training).

A draft proposes up to ``k`` tokens that may follow the context (prompt and the tokens chosen so far); the
speculative loop (``speculative.py``) checks them all in one forward of the model and keeps the longest prefix
the model agrees with, so a draft only changes the speed, never the tokens (greedy) or their distribution
(sampling). A draft is deterministic given the context: the loop treats its proposal as a point mass.

Prompt lookup (as transformers' ``prompt_lookup_num_tokens``): the last ``n`` tokens of the context
(``n = max_ngram`` down to ``min_ngram``) are searched for earlier in the context; the tokens that followed
the latest earlier occurrence are the draft::

    context  ... a b c d e ... x y a b c   <- suffix "a b c" seen before, followed by "d e ..."
    draft    d e ...

Text that repeats (code, lists, quoted input, a summary of the prompt) is drafted many tokens at a time; free
text gets no match (the loop then runs a plain one-token step at plain cost) or a short wrong one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from graphopt.errors import UsageError


class Draft:
    """What the speculative loop asks for draft tokens. ``name`` names the source in reports."""

    name = "draft"
    #: prior per-token acceptance per key of ``propose_keyed`` (``draft_policy.DraftPolicy``)
    priors: dict = {}

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``context`` (fewer, or none, when the draft has no guess)."""
        raise NotImplementedError

    def propose_keyed(self, context: Sequence[int], k: int) -> tuple[object, list[int]]:
        """(key, tokens): ``propose`` and what kind of guess it is (drafts of one key share an acceptance rate)."""
        return self.name, self.propose(context, k)

    def reset(self) -> None:
        """Forget any state of a previous generation."""


class PromptLookup(Draft):
    """Draft by copying what followed the latest earlier occurrence of the context's last n-gram."""

    name = "lookup"
    priors = {1: 0.3, 2: 0.5, 3: 0.6}  # by the length of the matched n-gram

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise UsageError(f"prompt lookup needs 1 <= min_ngram <= max_ngram (got {min_ngram}, {max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return self.propose_keyed(context, k)[1]

    def propose_keyed(self, context: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, tokens): the matched n-gram's length (0: no match) and what followed it."""
        if k < 1 or len(context) < self.min_ngram + 1:
            return 0, []
        ctx = np.asarray(context, np.int64)
        size = len(ctx)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            suffix = ctx[size - n:]
            # starts i < size - n of earlier occurrences, each followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:size - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return n, ctx[start:start + k].tolist()
        return 0, []

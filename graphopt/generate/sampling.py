"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded; masked tokens.

``Sampling`` is the settings (data); ``Sampler`` applies them with its own ``numpy.random.Generator`` so a seed
reproduces a run. Order, as transformers' logits processors: mask, temperature, top-k, top-p, then draw.
Greedy (temperature 0) is the argmax after masking; top-k = 1 keeps only the argmax, so it equals greedy
whatever the temperature. Ties go to the lowest token id in both (a stable sort).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from graphopt.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """``temperature`` 0: greedy. ``top_k`` 0: off. ``top_p`` 1: off. ``masked``: token ids never chosen."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    masked: frozenset[int] = frozenset()

    def __post_init__(self):
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1] (got {self.top_p})")
        object.__setattr__(self, "masked", frozenset(int(t) for t in self.masked))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def masking(self, tokens) -> Sampling:
        """These settings with ``tokens`` masked too."""
        return dataclasses.replace(self, masked=self.masked | frozenset(int(t) for t in tokens))


GREEDY = Sampling()


class Sampler:
    """Draws tokens by ``sampling``; one generator for the whole run (rows draw in order)."""

    def __init__(self, sampling: Sampling = GREEDY):
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)
        self._mask_ids: np.ndarray | None = None

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float64).copy()
        if self.sampling.masked:
            if self._mask_ids is None:
                self._mask_ids = np.array(sorted(t for t in self.sampling.masked if 0 <= t < x.shape[-1]), np.int64)
            x[..., self._mask_ids] = -np.inf
        return x

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """Token ids [batch] from logits [batch, vocab]."""
        x = self._masked(logits)
        if np.isneginf(x).all(axis=-1).any():
            raise UsageError("every token is masked: nothing left to sample")
        s = self.sampling
        if s.greedy or s.top_k == 1:
            return np.argmax(x, axis=-1).astype(np.int64)
        return np.array([self._draw(row) for row in x], np.int64)

    def _draw(self, x: np.ndarray) -> int:
        ids, p = self.distribution(x)
        return int(ids[self.rng.choice(len(p), p=p)])

    def distribution(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The token ids that can be drawn from one row of masked logits, best first, and their probabilities
        (temperature, top-k, top-p applied): what ``_draw`` draws from (speculative decoding's rejection
        sampling reads it too)."""
        s = self.sampling
        order = np.argsort(-x, kind="stable")  # best first; ties: the lower id first
        z = x[order] / s.temperature
        keep = int(np.isfinite(z).sum())
        if s.top_k:
            keep = min(keep, s.top_k)
        z = z[:keep]
        p = np.exp(z - z[0])
        p /= p.sum()
        if s.top_p < 1:
            # the smallest prefix whose probability reaches top_p (at least one token)
            keep = int(np.searchsorted(np.cumsum(p), s.top_p, side="left")) + 1
            p = p[:keep] / p[:keep].sum()
        return order[:len(p)], p

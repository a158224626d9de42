"""How many drafted tokens to check in a step: the count that maximises expected new tokens per second.

A verifying forward of ``k`` drafted tokens (width ``k + 1``) makes ``1 + a`` tokens, ``a`` the drafts kept. With
a per-token acceptance rate ``alpha``, expected tokens are ``E(k) = 1 + alpha + ... + alpha^k`` and the
forward costs ``r(k + 1)`` times a plain one-token step; the policy picks the ``k`` (0: a plain step) that
maximises ``E(k) / (r(k + 1) + k c)``, ``c`` the cost of drafting one token over a plain step (0 for prompt
lookup; a draft model's forward, ``draft_model.py``). All are learnt while generating:

- ``alpha`` per draft key (prompt lookup: the length of the matched n-gram; longer matches are surer), a decayed
  count of drafted tokens kept over those checked. The proposal is scored against the tokens the model made
  even when it was not fed (a plain step), so a key that stopped drafting keeps being judged at no cost.
- ``r(w)``: a decayed mean of the forward's seconds per width over the one-token step's. A width not timed yet
  is priced from the nearest narrower one timed plus ``slope`` per token (``jump + slope * (w - 1)`` above one
  while only one-token steps were timed): ONNX Runtime's 4-bit MatMulNBits runs a cheap one-row kernel for a
  single token, so a second token costs far more on a 4-bit graph than on fp32.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

#: priors: acceptance of a draft key never seen; price of width w > 1 before any was timed
PRIOR_ALPHA, PRIOR_JUMP, PRIOR_SLOPE = 0.5, 0.3, 0.1


class DraftPolicy:
    """Chooses the number of drafted tokens per step from the acceptance and the cost measured so far."""

    def __init__(self, limit: int = 16, decay: float = 0.9, prior: dict[Hashable, float] | None = None):
        self.limit, self.decay = limit, decay
        self.prior = dict(prior or {})
        self._kept: dict[Hashable, float] = {}
        self._checked: dict[Hashable, float] = {}
        self._seconds: dict[int, float] = {}

    def alpha(self, key: Hashable) -> float:
        checked = self._checked.get(key, 0.0)
        prior = self.prior.get(key, PRIOR_ALPHA)
        # the prior counts as two checked tokens, so a few observations outweigh it
        return (self._kept.get(key, 0.0) + 2 * prior) / (checked + 2)

    def checked(self, key: Hashable) -> float:
        """The (decayed) number of ``key``'s drafted tokens checked so far."""
        return self._checked.get(key, 0.0)

    def ratio(self, width: int) -> float:
        """Seconds of a forward of ``width`` tokens over a one-token forward's (measured, else priced)."""
        if width <= 1:
            return 1.0
        one = self._seconds.get(1)
        if one and width in self._seconds:
            return self._seconds[width] / one
        timed = [w for w in self._seconds if 1 < w < width]
        if one and timed:
            w = max(timed)
            return self._seconds[w] / one + PRIOR_SLOPE * (width - w)
        return 1.0 + PRIOR_JUMP + PRIOR_SLOPE * (width - 1)

    def length(self, key: Hashable, available: int, draft_seconds: float | None = None) -> int:
        """How many of ``available`` drafted tokens to check now (``draft_seconds``: what drafting one token
        costs, a draft model's forward; charged against a one-token step once one was timed)."""
        return self.best(key, available, draft_seconds)[0]

    def best(self, key: Hashable, available: int, draft_seconds: float | None = None) -> tuple[int, float]:
        """(count, expected new tokens per one-token step's time) of the best count, as ``length``; (0, 1.0):
        a plain step. Two sources of drafts compare by the rate."""
        a = self.alpha(key)
        one = self._seconds.get(1)
        cost = draft_seconds / one if draft_seconds and one else 0.0
        best, best_rate, expected, term = 0, 1.0, 1.0, 1.0
        for k in range(1, min(available, self.limit) + 1):
            term *= a
            expected += term
            rate = expected / (self.ratio(k + 1) + k * cost)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate

    def observe(self, key: Hashable, proposal: Sequence[int], made: Sequence[int], width: int, seconds: float) -> None:
        """After a step: the model made ``made`` where the draft proposed ``proposal`` (fed or not), in a
        forward of ``width`` tokens that took ``seconds``."""
        d = self.decay
        prev = self._seconds.get(width)
        self._seconds[width] = seconds if prev is None else d * prev + (1 - d) * seconds
        self.judge(key, proposal, made)

    def judge(self, key: Hashable, proposal: Sequence[int], made: Sequence[int]) -> None:
        """Score a proposal against the tokens the model made (fed or not): its key's acceptance."""
        d = self.decay
        n = min(len(proposal), len(made))
        if n == 0:
            return
        m = 0
        while m < n and proposal[m] == made[m]:
            m += 1
        checked = m + 1 if m < n else m
        self._kept[key] = d * self._kept.get(key, 0.0) + m
        self._checked[key] = d * self._checked.get(key, 0.0) + checked

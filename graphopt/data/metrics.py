"""Mask-aware comparison of model outputs, and accuracy budgets.

Samples are the vectors along an output's last axis (one token's hidden state, one row of logits);
a rank-0/1 output is a single sample. When the feed has an attention mask ``[batch, seq]`` and an
output starts with ``[batch, seq, ...]``, samples at padded positions are left out; an output packed
to ``[real_tokens, ...]`` (row-major over batch and position) is compared with the reference's real
tokens.

Metrics (worst over outputs when a model has several):
``max_abs``, ``max_rel`` (``|a-b| / |b|`` over the elements with ``|b|`` at least ``rel_floor``:
:data:`REL_FLOOR` of the largest ``|b|`` of the output in a feed, so that the rounding of near-zero
elements does not read as a large relative error), ``cosine`` (mean over samples),
``cosine_min``, ``top1`` (argmax agreement along the last axis), ``mismatch`` (fraction of elements
outside ``atol + rtol*|ref|``).

Decoder metrics (:data:`DECODER_METRICS`; measured on text by ``graphopt.generate.quality``, carried in
``Comparison.decoder``): ``ppl_ratio`` (perplexity of the candidate over the reference's, teacher-forced
on held-back windows of text) and ``greedy_match`` (the mean over held-back prompts of the common prefix
of the candidate's and the reference's greedy tokens, as a fraction of the tokens generated).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Mapping, Sequence

import numpy as np

from graphopt.errors import UsageError

MASK_NAMES = ("attention_mask", "input_mask", "mask")
#: ``max_rel`` only counts elements whose ``|reference|`` is at least this fraction of the output's
#: largest ``|reference|`` in the same feed (the floor used is ``OutputDiff.rel_floor``)
REL_FLOOR = 0.01

#: metric -> True when larger is better
METRICS: dict[str, bool] = {
    "max_abs": False,
    "max_rel": False,
    "cosine": True,
    "cosine_min": True,
    "top1": True,
    "mismatch": False,
}
#: decoder metric -> True when larger is better (measured on text, not on feeds)
DECODER_METRICS: dict[str, bool] = {
    "ppl_ratio": False,
    "greedy_match": True,
}
#: every metric a budget may name
BUDGET_METRICS: dict[str, bool] = {**METRICS, **DECODER_METRICS}


@dataclasses.dataclass
class OutputDiff:
    """Comparison numbers for one output tensor (over every feed)."""

    name: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    #: ``max_rel`` is over elements with ``|reference| >= rel_floor`` (the largest floor over feeds)
    rel_floor: float = 0.0
    cosine: float = 1.0
    cosine_min: float = 1.0
    top1: float = 1.0
    mismatch: float = 0.0
    exact_dtype: bool = False  # int/bool output: compared for equality
    samples: int = 0
    shape_mismatch: str | None = None
    #: elements that are NaN or infinite where the reference is finite: a failure whatever the tolerance
    new_nonfinite: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Comparison:
    """Per-output diffs plus the worst value of each metric."""

    outputs: dict[str, OutputDiff]
    #: decoder metrics measured on text (``ppl_ratio``, ``greedy_match``, and the two perplexities ``ppl``,
    #: ``ppl_reference``); empty when none was measured
    decoder: dict[str, float] = dataclasses.field(default_factory=dict)

    def worst(self, metric: str) -> float:
        if metric in DECODER_METRICS:  # not measured: NaN, which meets no budget term
            return float(self.decoder.get(metric, math.nan))
        if not self.outputs:
            return 1.0 if METRICS[metric] else 0.0
        values = [getattr(d, metric) for d in self.outputs.values()]
        if any(d.shape_mismatch for d in self.outputs.values()):
            return -math.inf if METRICS[metric] else math.inf
        return min(values) if METRICS[metric] else max(values)

    def summary(self) -> dict[str, float]:
        return {**{m: self.worst(m) for m in METRICS}, **self.decoder}

    def within(self, atol: float, rtol: float) -> bool:
        """True when every element is within ``atol + rtol*|ref|`` (and int outputs are equal)."""
        return all(d.shape_mismatch is None and d.mismatch == 0.0 and not d.new_nonfinite
                   for d in self.outputs.values())

    def nonfinite(self) -> list[str]:
        """The outputs that turned finite reference values into NaN or Inf, with how many elements."""
        return [f"output {d.name!r}: {d.new_nonfinite} NaN/Inf where the reference is finite"
                for d in self.outputs.values() if d.new_nonfinite]

    def worst_output(self, metric: str = "max_abs") -> OutputDiff | None:
        if not self.outputs:
            return None
        key = (lambda d: getattr(d, metric)) if not METRICS[metric] else (lambda d: -getattr(d, metric))
        return max(self.outputs.values(), key=key)

    def as_dict(self) -> dict:
        return {"summary": self.summary(), "outputs": {k: v.as_dict() for k, v in self.outputs.items()}}


def find_mask(feed: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The ``[batch, seq]`` attention mask of a feed, or None."""
    for name in MASK_NAMES:
        m = feed.get(name)
        if m is not None and m.ndim == 2:
            return m
    return None


def _samples(arr: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """2-D view [n_samples, last_dim], real positions only."""
    a = np.asarray(arr)
    if a.ndim == 0:
        return a.reshape(1, 1)
    if a.ndim == 1:
        return a.reshape(1, -1)
    if mask is not None and a.ndim >= 3 and a.shape[:2] == mask.shape:
        a = a[mask.astype(bool)]
    return a.reshape(-1, a.shape[-1])


def _is_packed(got: np.ndarray, ref: np.ndarray, mask: np.ndarray | None) -> bool:
    return (
        mask is not None
        and ref.ndim == got.ndim + 1
        and ref.shape[:2] == mask.shape
        and got.shape[0] == int(np.count_nonzero(mask))
        and got.shape[1:] == ref.shape[2:]
    )


class _Accumulator:
    def __init__(self, name: str, atol: float, rtol: float, scale_atol: bool = False):
        self.d = OutputDiff(name)
        self.atol, self.rtol, self.scale_atol = atol, rtol, scale_atol
        self.cos_sum = 0.0
        self.top1_hits = 0
        self.elements = 0
        self.mismatched = 0

    def add(self, got: np.ndarray, ref: np.ndarray, mask: np.ndarray | None) -> None:
        d = self.d
        got, ref = np.asarray(got), np.asarray(ref)
        if got.shape != ref.shape and _is_packed(got, ref, mask):
            # packed output [tokens, ...] against padded [batch, seq, ...]: real tokens, row-major
            ref, mask = ref[mask.astype(bool)], None
        if got.shape != ref.shape:
            d.shape_mismatch = f"{list(got.shape)} vs reference {list(ref.shape)}"
            return
        if ref.dtype.kind in "biuUSO" or got.dtype.kind in "biuUSO":
            d.exact_dtype = True
            g, r = _samples(got, mask), _samples(ref, mask)
            bad = int(np.count_nonzero(g != r))
            self.mismatched += bad
            self.elements += g.size
            if bad:
                d.max_abs = max(d.max_abs, float(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64))))
                                if g.dtype.kind in "biu" else 1.0)
            d.samples += g.shape[0]
            self.top1_hits += int(np.sum(np.all(g == r, axis=-1)))
            self.cos_sum += float(np.sum(np.all(g == r, axis=-1)))
            if bad:
                d.cosine_min = min(d.cosine_min, 0.0)
            return
        g = _samples(got, mask).astype(np.float64)
        r = _samples(ref, mask).astype(np.float64)
        if g.size == 0:
            return
        nan_mismatch = np.isnan(g) != np.isnan(r)
        d.new_nonfinite += int(np.count_nonzero(~np.isfinite(g) & np.isfinite(r)))
        g_ = np.where(np.isnan(g) & np.isnan(r), 0.0, g)
        r_ = np.where(np.isnan(g) & np.isnan(r), 0.0, r)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(g_ - r_)
            diff = np.where(np.isposinf(g_) & np.isposinf(r_) | np.isneginf(g_) & np.isneginf(r_), 0.0, diff)
        diff = np.where(nan_mismatch, np.inf, diff)
        d.max_abs = max(d.max_abs, float(np.max(diff)))
        d.max_rel = max(d.max_rel, self._max_rel(diff, np.abs(r_), nan_mismatch))
        atol = self.atol
        if self.scale_atol:  # atol relative to the output's largest finite magnitude in this feed (at least 1)
            finite = np.abs(r_[np.isfinite(r_)])
            atol *= max(1.0, float(finite.max()) if finite.size else 1.0)
        self.mismatched += int(np.count_nonzero(~(diff <= atol + self.rtol * np.abs(r_))))
        self.elements += diff.size
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            num = np.sum(g_ * r_, axis=-1)
            den = np.linalg.norm(g_, axis=-1) * np.linalg.norm(r_, axis=-1)
            cos = np.where(den > 0, num / np.where(den > 0, den, 1.0),
                           np.where(np.all(diff <= self.atol, axis=-1), 1.0, 0.0))
        cos = np.nan_to_num(cos, nan=0.0)
        self.cos_sum += float(np.sum(cos))
        d.cosine_min = min(d.cosine_min, float(np.min(cos)))
        d.samples += g.shape[0]
        if g.shape[-1] > 1:
            self.top1_hits += int(np.sum(np.argmax(g_, axis=-1) == np.argmax(r_, axis=-1)))
        else:
            self.top1_hits += g.shape[0]

    def _max_rel(self, diff: np.ndarray, mag: np.ndarray, nan_mismatch: np.ndarray) -> float:
        """Largest ``diff / |ref|`` over elements with ``|ref|`` at least REL_FLOOR of this feed's largest."""
        if np.any(nan_mismatch):
            return math.inf
        finite = mag[np.isfinite(mag)]
        floor = REL_FLOOR * float(finite.max()) if finite.size else 0.0
        self.d.rel_floor = max(self.d.rel_floor, floor)
        keep = np.isfinite(mag) & (mag >= floor) & (mag > 0)
        return float(np.max(diff[keep] / mag[keep])) if np.any(keep) else 0.0

    def result(self) -> OutputDiff:
        d = self.d
        if d.samples:
            d.cosine = self.cos_sum / d.samples
            d.top1 = self.top1_hits / d.samples
        if self.elements:
            d.mismatch = self.mismatched / self.elements
        return d


class Comparer:
    """Streaming form of :func:`compare`: add one feed's outputs at a time, keep only running sums.

    ``add(got, ref, feed)`` takes the outputs of one feed (``feed`` supplies the attention mask);
    ``result()`` gives the same :class:`Comparison` as ``compare`` over all the feeds added, so a
    caller never needs more than one feed's tensors in memory. With ``scale_atol`` an element's
    tolerance is ``atol * max(1, largest |ref| of the output in the feed) + rtol*|ref|`` (edge feeds
    of huge magnitude, where rounding scales with the values and cancellation leaves small elements).
    """

    def __init__(self, outputs: Sequence[str] | None = None, *, atol: float = 1e-4, rtol: float = 1e-4,
                 scale_atol: bool = False):
        self.atol, self.rtol, self.scale_atol = atol, rtol, scale_atol
        self._names = list(outputs) if outputs is not None else None
        self._accs: dict[str, _Accumulator] = {}
        if self._names is not None:
            self._accs = {n: _Accumulator(n, atol, rtol, scale_atol) for n in self._names}

    def add(self, got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
            feed: Mapping[str, np.ndarray] | None = None, *, names: Sequence[str] | None = None) -> None:
        """Fold one feed's outputs ``got`` (compared) and ``ref`` (reference) into the statistics.

        ``names``: only these outputs (a part of one feed's outputs; the other parts come in other
        calls), else every output.
        """
        if self._names is None:  # the first reference names the outputs, as in compare()
            self._names = list(ref.keys())
            self._accs = {n: _Accumulator(n, self.atol, self.rtol, self.scale_atol) for n in self._names}
        mask = find_mask(feed) if feed is not None else None
        for n in self._names if names is None else names:
            if n not in got:
                self._accs[n].d.shape_mismatch = "output missing"
                continue
            self._accs[n].add(got[n], ref[n], mask)

    def result(self) -> Comparison:
        """The comparison over every feed added so far."""
        return Comparison({n: a.result() for n, a in self._accs.items()})


def compare(
    got: Sequence[Mapping[str, np.ndarray]],
    ref: Sequence[Mapping[str, np.ndarray]],
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    outputs: Sequence[str] | None = None,
) -> Comparison:
    """Compare per-feed output dicts ``got`` against ``ref``, mask-aware.

    ``feeds[i]`` supplies the attention mask for ``got[i]``/``ref[i]``. Only outputs present in
    ``ref`` are compared (restricted to ``outputs`` when given); one missing from ``got`` is a
    shape mismatch. ``got``/``ref`` may be any sequences (e.g. ``graphopt.data.outputs.OutputStore``);
    they are read one feed at a time.
    """
    if len(got) != len(ref):
        raise ValueError(f"{len(got)} result sets against {len(ref)} references")
    comparer = Comparer(outputs if outputs is not None else None if len(ref) else [], atol=atol, rtol=rtol)
    for i, (g, r) in enumerate(zip(got, ref)):
        comparer.add(g, r, feeds[i] if feeds is not None else None)
    return comparer.result()


# ---------------------------------------------------------------- budgets

#: the budget most lossy passes declare as their ``default_budget`` (and ``search`` searches under)
DEFAULT_BUDGET = "cosine>=0.99,cosine_min>=0.97"

_BUDGET_RE = re.compile(r"^\s*([a-z_0-9]+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+|inf)\s*$")
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclasses.dataclass(frozen=True)
class BudgetTerm:
    """One condition such as ``cosine>=0.99``."""

    metric: str
    op: str
    value: float

    @property
    def decoder(self) -> bool:
        """A decoder metric (measured on text by ``graphopt.generate.quality``)."""
        return self.metric in DECODER_METRICS

    def holds(self, comparison: Comparison) -> bool:
        return _OPS[self.op](comparison.worst(self.metric), self.value)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


@dataclasses.dataclass(frozen=True)
class Budget:
    """All terms must hold."""

    terms: tuple[BudgetTerm, ...] = ()

    def failures(self, comparison: Comparison) -> list[str]:
        out = comparison.nonfinite()  # whatever the terms say
        for t in self.terms:
            if t.decoder and t.metric not in comparison.decoder:
                out.append(f"{t} not measured (a decoder metric: it needs a decoder with past and text)")
            elif not t.holds(comparison):
                out.append(f"{t} not met: {t.metric}={comparison.worst(t.metric):.6g}")
        return out

    @property
    def decoder(self) -> bool:
        """Any term is a decoder metric (``ppl_ratio``, ``greedy_match``)."""
        return any(t.decoder for t in self.terms)

    def without_decoder(self) -> Budget:
        """The terms measured on feeds only."""
        return Budget(tuple(t for t in self.terms if not t.decoder))

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __str__(self) -> str:
        return ", ".join(str(t) for t in self.terms)


def parse_budget(specs: str | Sequence[str] | None) -> Budget:
    """Parse ``'cosine>=0.99'`` terms (a list, or one string with commas)."""
    if not specs:
        return Budget()
    if isinstance(specs, str):
        specs = [specs]
    terms = []
    for spec in specs:
        for part in str(spec).split(","):
            if not part.strip():
                continue
            m = _BUDGET_RE.match(part)
            if not m:
                raise UsageError(
                    f"malformed budget {part.strip()!r}",
                    hint="write METRIC>=VALUE, e.g. 'cosine>=0.99' or 'ppl_ratio<=1.05'; metrics: "
                    + ", ".join(BUDGET_METRICS),
                )
            metric, op, value = m.group(1), m.group(2), float(m.group(3))
            if metric not in BUDGET_METRICS:
                raise UsageError(
                    f"unknown budget metric {metric!r} in {part.strip()!r}",
                    hint="metrics: " + ", ".join(BUDGET_METRICS),
                )
            if metric == "ppl_ratio" and (op in (">=", ">") or value < 1.0):
                raise UsageError(f"budget {part.strip()!r}: ppl_ratio is the candidate's perplexity over the "
                                 "reference's; bound it from above by a value >= 1",
                                 hint="e.g. 'ppl_ratio<=1.05'")
            if metric == "greedy_match" and (op in ("<=", "<") or not 0.0 <= value <= 1.0):
                raise UsageError(f"budget {part.strip()!r}: greedy_match is a fraction; bound it from below "
                                 "by a value in [0, 1]", hint="e.g. 'greedy_match>=0.9'")
            terms.append(BudgetTerm(metric, op, value))
    return Budget(tuple(terms))

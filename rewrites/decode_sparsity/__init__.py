"""``decode-sparsity``: decode-time contextual sparsity of gated (SwiGLU) FFNs, router-picked neuron groups (lossy).

Per gated FFN (``rewrites.common.gated_ffn``: float MatMuls, MatMulNBits or the exact 4-bit affine-block
form) the neurons are clustered into ``groups`` groups of equal size by how they co-activate on calibration
text, and a linear router predicts each group's contribution norm (``groups.py``). The block becomes
(``build.py``)::

    x ─router─TopK(k)─▶ groups on ──▶ Sum_g If(on[g]) then down_g(silu(gate_g(x)) · up_g(x)) else 0

so a decode step at batch 1 runs ``k`` of ``G`` groups; any run of more than one token (prefill, batch > 1)
runs every group (exact). Group weights are constant initializers inside their branch, so ONNX Runtime's
prepacked kernels run them (a MatMulNBits fed gathered weights at run time measured 10-20x slower than the
constant one: gathering rows at run time does not pay on CPU).

Budget (``--budget``; default ``ppl_ratio<=1.03``): decoder metrics, as ``quantize-int4``: perplexity of
the held-back text windows with every position computed as a decode step would (the simulation form of
``build.py``: one forward per window, each token masked to its own router's groups) over the input's, and
greedy agreement of the real graph on held-back prompts. ``keep`` (0: searched): the fraction of groups
a token runs. Searched: a ladder per layer from every layer at the fewest groups to dense (the layer with
the largest local error relaxed first), the cheapest rung meeting the budget on the calibration windows and
then on the held-back ones.

Speed first: the decode step of each uniform keep level is timed round-robin against the input (batch 1,
1 thread); levels slower than ``min_speedup`` x are not searched, and the chosen rung is timed again.
Declines (model unchanged, the measured table in the notes): no level pays, no rung meets the budget, or the
chosen rung measures below ``min_speedup``.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from graphopt.data.metrics import Comparison
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate import quality
from graphopt.generate.loop import open_decoder
from graphopt.rewrites.common import activations, lossy
from graphopt.rewrites.common import gated_ffn as gffn
from graphopt.rewrites.common.decode_timing import step_seconds
from graphopt.rewrites.decode_sparsity import build
from graphopt.rewrites.decode_sparsity import groups as grouping
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)


class DecodeSparsityPass(GraphoptPass):
    """Decode-time contextual sparsity of gated FFNs: a router picks the neuron groups each token runs."""

    name = "decode-sparsity"
    exact = False
    in_default_recipe = False
    default_budget = "ppl_ratio<=1.03"

    def __init__(self, *, groups: int = 8, keep: float = 0.0, min_speedup: float = 1.1, steps: int = 16,
                 seed: int = 0):
        super().__init__()
        if groups < 2:
            raise UsageError(f"decode-sparsity.groups must be >= 2, got {groups}")
        if not 0.0 <= keep < 1.0:
            raise UsageError(f"decode-sparsity.keep must be in [0, 1) (0: chosen by the budget), got {keep}")
        if min_speedup < 0:
            raise UsageError(f"decode-sparsity.min_speedup must be >= 0 (0: applied even where it does not pay), got {min_speedup}")
        self.groups, self.keep, self.min_speedup = int(groups), float(keep), float(min_speedup)
        self.steps, self.seed = int(steps), int(seed)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return _Run(self, model, ctx).go()


def _session(model: ir.Model):
    return runtime.make_session(model, threads=1, spinning=False)


def _window_feed(model: ir.Model, window) -> dict[str, np.ndarray]:
    n = len(window)
    feed = {"input_ids": np.asarray(window, np.int64)[None], "attention_mask": np.ones((1, n), np.int64)}
    for v in model.graph.inputs:
        if v.name == "position_ids":
            feed[v.name] = np.arange(n, dtype=np.int64)[None]
        elif v.name.startswith("past_key_values."):
            feed[v.name] = np.zeros([1] + [d if isinstance(d, int) else 0 for d in v.shape][1:], np.float32)
    return feed


def calibrate(model: ir.Model, windows, n_groups: int, *, seed: int = 0) -> list[grouping.Calibrated | None]:
    """Groups and router of every gated FFN of ``model`` (None: its neurons do not split into ``n_groups``
    groups of whole units) from its inputs on the token ``windows`` (each run from an empty past)."""
    ffns = gffn.find(model)
    fit = {id(f) for f in ffns if f.width % f.down.unit == 0 and (f.width // f.down.unit) % n_groups == 0}
    feeds = [_window_feed(model, w) for w in windows]
    tokens = sum(len(w) for w in windows)
    stats = activations.collect(model, feeds, [f.x.name for f in ffns if id(f) in fit], sample_rows=tokens,
                                seed=seed)
    return [grouping.calibrate(f, stats[f.x.name].rows, n_groups, seed=seed)
            if id(f) in fit and stats.get(f.x.name) is not None else None for f in ffns]


def sparse_model(model: ir.Model, cal: list[grouping.Calibrated | None], keeps: list[int], *,
                 simulate: bool = False, grouped_dense: bool = False, oracle: bool = False) -> ir.Model:
    """A clone of ``model`` with gated FFN ``i`` keeping ``keeps[i]`` of its groups per token (all: left
    dense, unless ``grouped_dense``: then grouped with every group on, to measure the grouping itself)."""
    cand = model.clone()
    for f, k, c in zip(gffn.find(cand), keeps, cal):
        if c is not None and (k < len(c.groups) or grouped_dense):
            build.rewrite(cand, f, c.groups, c.router, k, simulate=simulate, oracle=oracle)
    return cand


@dataclasses.dataclass
class _Run:
    """One call of the pass (nothing of it is kept on the pass)."""

    opts: DecodeSparsityPass
    model: ir.Model
    ctx: PassContext
    table: list[str] = dataclasses.field(default_factory=list)

    def candidate(self, keeps: list[int], simulate: bool = False) -> ir.Model:
        return sparse_model(self.model, self.cal, keeps, simulate=simulate)

    def measure(self, keeps: list[int], held_always: bool = False) -> lossy.Measured:
        sim = open_decoder(_session(self.candidate(keeps, simulate=True)), threads=1)
        real = open_decoder(_session(self.candidate(keeps)), threads=1)
        chk = self.check

        def score(part: str) -> Comparison:
            ppl = quality.perplexity(sim, chk.rows.windows[part])
            # one prompt at a time: a batch of prompts decodes more than one token per step (dense)
            got = [quality.greedy(real, [p], chk.rows.new_tokens)[0] for p in chk.rows.prompts[part]]
            d = {"ppl_ratio": ppl / chk.ref_ppl[part], "ppl": ppl, "ppl_reference": chk.ref_ppl[part],
                 "greedy_match": quality.common_prefix_fraction(got, chk.ref_greedy[part], chk.rows.new_tokens)}
            return Comparison({}, decoder=d)

        return self.s.evaluate(score, held_always)

    def text(self, keeps: list[int]) -> str:
        g = self.opts.groups
        ks = [k for k, c in zip(keeps, self.cal) if c is not None]
        mean = float(np.mean(ks)) / g if ks else 1.0
        return f"{sum(k < g for k in ks)} FFNs sparse, mean keep {mean:.0%} ({min(ks)}-{max(ks)} of {g} groups)"

    def row(self, keeps: list[int], m: lossy.Measured) -> None:
        def one(c: Comparison | None) -> str:
            if c is None:
                return "—"
            return f"ppl_ratio {c.decoder['ppl_ratio']:.4f} greedy {c.decoder['greedy_match']:.3f}"

        self.table.append(f"{self.text(keeps)} | calib {one(m.calib)} | held {one(m.held)} | {self.s.verdict(m)}")

    def speeds(self, keep_sets: list[list[int]]) -> list[float]:
        """Speed-up of each keep set's decode step over the input's (round-robin)."""
        decs = [open_decoder(_session(self.model), threads=1)] + [
            open_decoder(_session(self.candidate(k)), threads=1) for k in keep_sets]
        secs = step_seconds(decs, steps=self.opts.steps)
        self.base_ms = 1e3 * secs[0]
        return [secs[0] / t for t in secs[1:]]

    # ------------------------------------------------------------ the pass

    def go(self) -> PassResult:
        o, ctx, model = self.opts, self.ctx, self.model
        self.s = s = lossy.BudgetSearch.of(o, ctx, default_note=True)
        other = [str(t) for t in s.budget.terms if not t.decoder]
        if other or not s.budget:
            raise UsageError(f"decode-sparsity measures decoder metrics only; budget {s.budget} has "
                             f"{', '.join(other) or 'none'}", hint="e.g. --budget 'ppl_ratio<=1.03'")
        ffns = gffn.find(model)
        if not ffns:
            s.note(gffn.NO_GATED_FFN_NOTE)
            return s.result(model, False)
        self.check = check = ctx.decoder
        if check is None:
            check = self.check = quality.decoder_check(_session(model))
            s.note("measured against the model as given (a direct call)")
        s.note(check.rows.describe())
        g = o.groups
        self.cal = calibrate(model, check.rows.windows[quality.CALIB], g, seed=o.seed)
        n = sum(c is not None for c in self.cal)
        if not n:
            s.note(f"not applied: no gated FFN's neurons split into {g} groups of whole units")
            return s.result(model, False)
        tokens = sum(len(w) for w in check.rows.windows[quality.CALIB])
        s.note(f"{n} of {len(ffns)} gated FFNs in {g} groups of {ffns[0].width // g} neurons, router from "
               f"{tokens} calibration tokens")
        levels = list(range(1, g + 1))
        rec = [c.local(max(1, g // 2)) for c in self.cal if c is not None]
        s.note(f"at {max(1, g // 2)} of {g} groups: router recall vs the oracle top groups {np.mean([r[1] for r in rec]):.3f}, "
               f"local FFN error {np.mean([r[0] for r in rec]):.3f} (mean over FFNs, calibration tokens)")

        if o.keep:
            k = max(1, round(o.keep * g))
            keeps = [k] * len(ffns)
            m = self.measure(keeps, held_always=True) if s.given else lossy.Measured(None)
            (up,) = self.speeds([keeps])
            s.note(f"keep {k} of {g} groups: decode step {self.base_ms:.2f} ms as given, {up:.2f}x")
            if s.given:
                self.row(keeps, m)
                self._table()
                if not s.meets(m.held):
                    s.note(f"budget {s.budget} not met: model unchanged")
                    return s.result(model, False, met=False, held=m.held)
            self._apply(keeps)
            return s.result(model, True, met=True if s.given else None, held=m.held,
                            rule_counts={"decode-sparsity": n})

        uniform = [[k] * len(ffns) for k in levels[:-1]]
        ups = self.speeds(uniform)
        s.note("decode step, batch 1, 1 thread (median, round-robin): as given "
               f"{self.base_ms:.2f} ms; " + ", ".join(f"{k} of {g} groups {u:.2f}x" for k, u in zip(levels, ups)))
        paying = [k for k, u in zip(levels, ups) if u >= o.min_speedup]
        if not paying:
            s.note(f"declined: no keep level decodes >= {o.min_speedup:g}x faster than the input here; model unchanged")
            return s.result(model, False, met=False)
        top = max(paying)
        errs = {i: c for i, c in enumerate(self.cal) if c is not None}
        rungs = [r for r in lossy.ladder(len(ffns), levels, lambda i, k: errs[i].local(k)[0] if i in errs else 0.0)
                 if np.mean([k for k, c in zip(r, self.cal) if c is not None]) <= top]
        j, seen = s.first_confirmed(len(rungs), lambda j: self.measure(rungs[j]),
                                    lambda j, m: self.row(rungs[j], m))
        if j is None:
            self._table()
            s.note(f"declined: no rung with a mean keep <= {top} of {g} groups meets the budget {s.budget}; "
                   "model unchanged")
            return s.result(model, False, met=False)
        keeps, held = rungs[j], seen[j].held
        (up,) = self.speeds([keeps])
        self._table()
        s.note(f"chosen {self.text(keeps)}: decode step {up:.2f}x the input's ({self.base_ms:.2f} ms as given); "
               f"held-back ppl_ratio {held.decoder['ppl_ratio']:.4f}, greedy_match {held.decoder['greedy_match']:.3f}")
        if up < o.min_speedup:
            s.note(f"declined: the chosen rung decodes {up:.2f}x (< min_speedup {o.min_speedup:g}); model unchanged")
            return s.result(model, False, met=False, held=held)
        self._apply(keeps)
        return s.result(model, True, met=True, held=held,
                        rule_counts={"decode-sparsity": sum(k < g for k in keeps)})

    def _apply(self, keeps: list[int]) -> None:
        for f, k, cal in zip(gffn.find(self.model), keeps, self.cal):
            if cal is not None and k < self.opts.groups:
                build.rewrite(self.model, f, cal.groups, cal.router, k)

    def _table(self) -> None:
        if self.table:
            self.s.note("measured (rung | calib | held | verdict):\n  " + "\n  ".join(self.table))


register(DecodeSparsityPass)

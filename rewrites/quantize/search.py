"""The budget search of ``quantize``: a ladder of candidates (the most sensitive layers kept float, or in
int4 mode moved to int8 first), binary-searched on the calibration rows and confirmed on the held-back
rows through ``common.lossy``; the layer sensitivity ranking (``model``: one session per layer, or
``local``: each layer's own error on sampled calibration rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np
import onnx_ir as ir

from graphopt import memory
from graphopt.data.metrics import Comparer, Comparison
from graphopt.engine.verify import run_session
from graphopt.rewrites.common import activations as calib_mod
from graphopt.rewrites.common import lossy
from graphopt.rewrites.quantize import numeric
from graphopt.rewrites.quantize import smooth as smooth_mod
from graphopt.rewrites.quantize.int4 import dequant_int4, rtn_int4
from graphopt.rewrites.quantize.targets import QConfig, Target
from graphopt.runtime import session as runtime
from graphopt.runtime import standins


@dataclasses.dataclass
class Outcome:
    """One quantized candidate: its plan, the layers kept float (int4: moved to int8), what it measured."""

    mode: str
    plan: dict[str, QConfig]
    factors: dict[str, np.ndarray]
    floats: list[str]
    int8: list[str] = dataclasses.field(default_factory=list)  # int4 mode: layers moved to int8
    calib: Comparison | None = None
    held: Comparison | None = None
    ok: bool = False
    float_macs: float = 0.0


@dataclasses.dataclass
class Search:
    """One call of the pass: what the budget search works on (the rows, budget and notes: ``s``).

    Made fresh by every ``QuantizePass.call``; nothing of it is kept on the pass.
    """

    s: lossy.BudgetSearch
    #: ``build(model, plan, factors)``: the pass's rewrite of a copy of the model
    build: Callable[..., tuple[ir.Model, dict[str, int]]]
    model: ir.Model
    targets: list[Target]
    mixed: bool = True
    sensitivity_feeds: int = 2
    stats: dict[str, calib_mod.Stats] = dataclasses.field(default_factory=dict)
    ranking_by: str = "model"  # "model" | "local": the sensitivity option with "auto" resolved
    #: int4 mode: the config of a layer moved to int8 (its weight storage chosen for this CPU)
    int8: QConfig = dataclasses.field(default_factory=lambda: QConfig("dynamic"))

    def __post_init__(self) -> None:
        self.macs = {t.key: t.macs_per_row for t in self.targets}
        self.total_macs = float(sum(self.macs.values())) or 1.0

    def note(self, msg: str) -> None:
        self.s.note(msg)

    def score(self, o: Outcome, part: str) -> Comparison:
        """Quality of the candidate ``o`` on the calibration or held-back rows."""
        s = self.s
        return self.evaluate(o.plan, o.factors, s.feeds(part), s.ref_calib if part == lossy.CALIB else s.ref_held)

    def evaluate(self, plan: Mapping[str, QConfig], factors: Mapping[str, np.ndarray], feeds, ref) -> Comparison:
        """Quality of ``plan`` applied to a copy of the model, on ``feeds`` against ``ref``."""
        cand, _ = self.build(self.model.clone(), plan, factors)
        sess = runtime.make_session(standins.cpu_runnable(cand)[0], threads=1)
        del cand
        memory.trim()  # the session holds the weights it needs; the candidate's arrays go
        comparer = Comparer()
        run_session(sess, feeds, comparer=comparer, reference=ref, keep=False)
        del sess
        memory.trim()
        return comparer.result()

    def search(self, mode: str, plan: dict[str, QConfig], factors: dict[str, np.ndarray],
               ranking: list[str] | None) -> tuple[Outcome, list[str] | None]:
        """The quantized model of ``mode`` with the fewest float layers that meets the budget."""
        keys = [t.key for t in self.targets if t.key in plan]
        macs, total = self.macs, self.total_macs
        s = self.s

        # the ladder of candidates, least to most float, walked by binary search (monotone assumption):
        # step i keeps the i most sensitive layers float; in int4 mode the first n steps instead move
        # them to int8 (dynamic) and only then do they go float (with everything else int8): the model
        # stays small. "All float" is not a quantized model.
        int4 = mode.startswith("int4")

        def outcome(i: int) -> Outcome:
            n = len(order)
            if int4 and i <= n:
                floats, int8 = [], order[:i]
            elif int4:
                floats, int8 = order[:i - n], order[i - n:]
            else:
                floats, int8 = order[:i], []
            p = {k: v for k, v in plan.items() if k not in floats}
            p.update({k: dataclasses.replace(self.int8) for k in int8 if k in p})
            return Outcome(mode, p, factors, floats, int8=int8,
                           float_macs=(total - sum(macs[k] for k in p)) / total)

        order: list[str] = []
        o = outcome(0)
        m = s.evaluate(lambda part: self.score(o, part))
        o.calib, o.held = m.calib, m.held
        if s.meets(o.held):
            o.ok = True
            return o, ranking
        if not self.mixed or len(keys) < 2:
            if o.held is None:
                o.held = self.score(o, lossy.HELD)
            return o, ranking
        if ranking is None:
            ranking = self.sensitivity(keys, plan, factors)
            self.note("sensitivity (most sensitive first): " + ", ".join(ranking[:6])
                       + (" ..." if len(ranking) > 6 else ""))
        order = [k for k in ranking if k in plan]
        last = 2 * len(order) - 1 if int4 else len(order) - 1
        tried: dict[int, Outcome] = {}

        def on_calib(i: int) -> bool:
            c = tried[i] = outcome(i)
            c.calib = self.score(c, lossy.CALIB)
            return not s.fails(c.calib)

        best_i = lossy.bisect(1, last, on_calib)
        if best_i is None:
            o.held = self.score(o, lossy.HELD)
            return o, ranking
        # confirm on held-back feeds; move one more layer up the ladder while it fails there
        i, best = best_i, tried[best_i]
        while True:
            best.held = self.score(best, lossy.HELD)
            if s.meets(best.held) or i >= last:
                best.ok = s.meets(best.held)
                if best.ok and int4 and i > len(order):
                    best = self.int4_back(best, order, i - len(order), plan, factors, mode)
                return best, ranking
            i += 1
            prev_calib = best.calib
            best = outcome(i)
            best.calib = prev_calib
            self.note(f"{mode}: budget held on calibration but not on held-back feeds; "
                       f"{len(best.floats)} layers float, {len(best.int8)} int8")

    def int4_back(self, best: Outcome, order: list[str], j: int, plan: dict[str, QConfig],
                  factors: dict[str, np.ndarray], mode: str) -> Outcome:
        """int4 with ``j`` layers float and the rest int8 meets the budget: give the least sensitive of
        those int8 layers back to int4 (binary search on how many stay int8, confirmed on held-back feeds)."""
        s, macs, total = self.s, self.macs, self.total_macs
        rest = order[j:]

        def cand(k: int) -> Outcome:
            floats, int8 = order[:j], rest[:k]
            p = {key: v for key, v in plan.items() if key not in floats}
            p.update({key: dataclasses.replace(self.int8) for key in int8})
            return Outcome(mode, p, factors, floats, int8=int8,
                           float_macs=(total - sum(macs[key] for key in p)) / total)

        tried: dict[int, Outcome] = {}

        def on_calib(k: int) -> bool:
            c = tried[k] = cand(k)
            c.calib = self.score(c, lossy.CALIB)
            return not s.fails(c.calib)

        k = lossy.bisect(0, len(rest) - 1, on_calib)
        if k is None:
            return best
        found = tried[k]
        found.held = self.score(found, lossy.HELD)
        if s.fails(found.held):
            return best
        found.ok = True
        self.note(f"{mode}: {len(rest) - len(found.int8)} of the int8 layers back to int4")
        return found

    def sensitivity(self, keys: list[str], plan: dict[str, QConfig], factors: dict[str, np.ndarray]) -> list[str]:
        """Layer keys, most sensitive first."""
        if self.ranking_by == "local":
            ranking = self.local_sensitivity(keys, plan)
            if ranking is not None:
                return ranking
        n = self.sensitivity_feeds if self.sensitivity_feeds > 0 else len(self.s.calib)
        feeds, ref = self.s.calib[:n], self.s.ref_calib[:n]
        err = {}
        for k in keys:
            c = self.evaluate({k: plan[k]}, factors, feeds, ref)
            err[k] = (1.0 - c.worst("cosine")) + 0.25 * (1.0 - c.worst("cosine_min"))
        return sorted(keys, key=lambda k: -err[k])

    def local_sensitivity(self, keys: list[str], plan: dict[str, QConfig]) -> list[str] | None:
        """Rank layers by their own relative output error on the sampled calibration rows (no sessions).

        Each layer's error: the layer quantized as planned (its smoothing included) on its float inputs,
        ``|x W - q(x) q(W)|^2 / |x W|^2`` (int4: ``|x W - x q4(W)|^2 / |x W|^2``, weight-only); an
        embedding table's, ``|T - q(T)|^2 / |T|^2``. None when a layer has no sampled rows (then the
        ``model`` ranking runs).
        """
        stats = self.stats
        targets = {t.key: t for t in self.targets}
        err = {}
        for k in keys:
            t, cfg = targets.get(k), plan[k]
            if t is not None and cfg.mode == "gather":
                w = t.weight_array
                q, scale = numeric.quantize_weight(w, axis=1)
                err[k] = float(np.sum((q * scale - w) ** 2) / max(float(np.sum(w * w)), 1e-12))
                continue
            st = stats.get(t.act.name) if t is not None and t.act is not None else None
            if st is None or st.rows is None or cfg.mode not in ("dynamic", "static", "int4"):
                return None
            if cfg.mode == "int4":

                w = t.weight_array
                q, scales = cfg.int4_q if cfg.int4_q is not None else rtn_int4(w, cfg.block_size)
                ref = st.rows @ w
                got = st.rows @ dequant_int4(q, scales, cfg.block_size, w.shape[0])
                err[k] = float(np.sum((got - ref) ** 2) / max(float(np.sum(ref * ref)), 1e-12))
                continue
            s = cfg.smooth
            act = cfg.act_range if cfg.mode == "static" else None
            err[k] = smooth_mod.local_error(st.rows, t.weight_array, s, act, cfg.act_type)
        return sorted(keys, key=lambda k: -err[k])

"""``contextual-sparsity``: Deja Vu FFN sparsity — a low-rank predictor picks each batch's neurons (lossy).

Per FFN block (see ``_ffn``) a rank-``rank`` predictor ``P = U V`` is fitted on calibration activations
(the best rank-r ``M`` for ``‖X M − X W1‖``: Cholesky of ``XᵀX``, truncated SVD), and the block becomes::

    X ─MatMul(U)─MatMul(V)─Add(b1)─▶ scores ─TopK(k)─▶ idx [.., k] ─Reshape(-1)─ScatterElements(zeros[F], 1)─▶
        union mask ─NonZero─Reshape─▶ rows (the union over every token of the batch)
    X ─MatMul(Transpose(Gather(W1ᵀ, rows)))─▶ (Add | BiasGelu | FastGelu with Gather(b1, rows)) ─▶
        MatMul(Gather(W2, rows)) ─▶ …

W1 is stored transposed so both gathers take whole rows (axis 0). A batch computes the union of its tokens'
selections: on a padded batch of many tokens that union is close to all neurons, so the savings are for
small batches (one token: decode, streaming); the notes give the measured union size.

``k`` (``keep=``, a fraction of the FFN width; 0: chosen per layer by the budget like ``sparsify``: a ladder
from every layer at the smallest keep to dense, the worst local error relaxed first, binary-searched on the
calibration feeds and confirmed on the held-back feeds). The notes report each layer's predictor recall
against the oracle top-k (the k largest |GELU| activations of each token) and the predictor's own cost.

The held-back ``cosine`` that must meet the budget is a one-sided lower confidence bound (``confidence=``,
default 0.95; 0: the plain mean) of the mean token cosine, sentences as the units (as in ``sparsify``).

Declines (unchanged, ``budget_met=False``, the measured table in the notes): no keep fraction meets the budget,
or the one that does keeps more than ``max_union`` (default 90%) of the FFN rows on the held-back batches
(the union is then nearly dense: the predictor and gathers cost more than they save; on MiniLM with padded
batches of 16-32 sentences the union of 25% per token is 97%). An explicit ``keep=`` is applied as asked.
Not applied: no FFN block.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from graphopt.data.metrics import DEFAULT_BUDGET, Comparison
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.opsets import node_domain
from graphopt.rewrites.common import ffn as _ffn
from graphopt.rewrites.common import lossy
from graphopt.rewrites.common.names import unique_name
from graphopt.runtime import session as runtime
from graphopt.runtime import standins

logger = logging.getLogger(__name__)

#: keep fractions the budget search walks, smallest first
LEVELS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


def fit_predictor(w1: np.ndarray, g: np.ndarray, rank: int, damp: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """``U[H, r]``, ``V[r, F]`` minimising ``‖X U V − X W1‖`` for ``G = XᵀX``."""
    gd = g.astype(np.float64).copy()
    gd[np.diag_indices_from(gd)] += damp * float(np.diag(g).mean()) + 1e-12
    lo = np.linalg.cholesky(gd)  # G = L Lᵀ, ‖X M‖ = ‖Lᵀ M‖
    u, s, vt = np.linalg.svd(lo.T @ w1.astype(np.float64), full_matrices=False)
    r = min(rank, s.size)
    big_u = np.linalg.solve(lo.T, u[:, :r] * s[:r])
    return big_u.astype(np.float32), vt[:r].astype(np.float32)


def topk_rows(s: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of each row."""
    return np.argpartition(-s, k - 1, axis=1)[:, :k]


def recall(pred: np.ndarray, oracle: np.ndarray, width: int) -> float:
    """Mean fraction of each row's oracle indices that ``pred`` also picked."""
    hit = np.zeros((pred.shape[0], width), bool)
    np.put_along_axis(hit, pred, True, axis=1)
    return float(np.take_along_axis(hit, oracle, axis=1).mean())


class ContextualSparsityPass(GraphoptPass):
    """Deja Vu contextual FFN sparsity: a low-rank predictor picks the neurons each batch computes."""

    name = "contextual-sparsity"
    exact = False
    default_budget = DEFAULT_BUDGET

    def __init__(self, *, rank: int = 64, keep: float = 0.0, damp: float = 0.01, max_union: float = 0.9,
                 confidence: float = 0.95):
        super().__init__()
        if rank < 1:
            raise UsageError(f"contextual-sparsity.rank must be >= 1, got {rank}")
        if not 0.0 <= keep < 1.0:
            raise UsageError(f"contextual-sparsity.keep must be in [0, 1) (0: chosen by the budget), got {keep}")
        if damp <= 0:
            raise UsageError(f"contextual-sparsity.damp must be > 0, got {damp}")
        if not 0.0 < max_union <= 1.0:
            raise UsageError(f"contextual-sparsity.max_union must be in (0, 1], got {max_union}")
        if not 0.0 <= confidence < 1.0:
            raise UsageError(f"contextual-sparsity.confidence must be in [0, 1), got {confidence}")
        self.rank, self.keep, self.damp, self.max_union = int(rank), float(keep), float(damp), float(max_union)
        self.confidence = float(confidence)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return _Run(self, model, ctx).go()


@dataclasses.dataclass
class _Run:
    """One call of the pass (nothing of it is kept on the pass)."""

    opts: ContextualSparsityPass
    model: ir.Model
    ctx: PassContext
    table: list[str] = dataclasses.field(default_factory=list)
    cache: dict = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------ per layer, in numpy

    def local(self, i: int, keep: float) -> tuple[float, float]:
        """(relative FFN output error with per-token predicted top-k, recall vs the oracle top-k) of layer ``i``."""
        if (i, keep) in self.cache:
            return self.cache[(i, keep)]
        f = self.ffns[i]
        x = self.stats[f.x.name].rows.astype(np.float64)
        w1, w2 = f.w1.astype(np.float64), f.w2.astype(np.float64)
        b1 = 0.0 if f.b1 is None else f.b1.astype(np.float64)
        a = _ffn.gelu(x @ w1 + b1)
        u, v = self.pred[i]
        k = max(1, round(f.width * keep))
        pick = topk_rows(x @ u @ v + b1, k)
        mask = np.zeros_like(a, dtype=bool)
        np.put_along_axis(mask, pick, True, axis=1)
        ref = a @ w2
        err = float(np.linalg.norm((a * mask) @ w2 - ref) / max(np.linalg.norm(ref), 1e-12))
        out = (err, recall(pick, topk_rows(np.abs(a), k), f.width))
        self.cache[(i, keep)] = out
        return out

    # ------------------------------------------------------------ building

    def build(self, model: ir.Model, keeps: Sequence[float]) -> list[str]:
        """Rewrite the FFNs of ``model`` (a clone of the input) with the given keep fractions (1.0: dense)."""
        ffns = _ffn.find(model)
        graph = model.graph
        rows_out = []
        for i, keep in enumerate(keeps):
            if keep >= 1.0:
                continue
            f = ffns[i]
            u, v = self.pred[i]
            k = max(1, round(f.width * keep))
            base = f.key

            def const(arr: np.ndarray, suffix: str, base=base) -> ir.Value:
                name = unique_name(graph, f"{base}_{suffix}")
                val = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(arr), name=name),
                               shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)))
                graph.register_initializer(val)
                return val

            t = ir.tape.Tape()
            x = f.x
            s = t.op("MatMul", [t.op("MatMul", [x, const(u, "pred_u")]), const(v, "pred_v")])
            if f.b1 is not None:
                s = t.op("Add", [s, f.bias])
            _, idx = t.op_multi_out("TopK", [s, const(np.array([k], np.int64), "k")], num_outputs=2,
                                    attributes={"axis": -1})
            flat = t.op("Reshape", [idx, const(np.array([-1], np.int64), "flat")])
            ones = t.op("Expand", [const(np.ones(1, np.float32), "one"), t.op("Shape", [flat])])
            union = t.op("ScatterElements", [const(np.zeros(f.width, np.float32), "zeros"), flat, ones])
            rows = t.op("Reshape", [t.op("NonZero", [union]), const(np.array([-1], np.int64), "flat2")])
            rows.name = unique_name(graph, f"{base}_rows")
            rows_out.append(rows.name)
            w1t = t.op("Gather", [const(np.ascontiguousarray(f.w1.T), "w1t"), rows], attributes={"axis": 0})
            h = t.op("MatMul", [x, t.op("Transpose", [w1t], attributes={"perm": [1, 0]})])
            b_sel = None if f.b1 is None else t.op("Gather", [f.bias, rows], attributes={"axis": 0})
            if f.add1 is not None:
                h = t.op("Add", [h, b_sel])
            if len(f.act_nodes) == 1:
                act_inputs = [h] + ([b_sel] if f.add1 is None and b_sel is not None else [])
                act = ir.Node(node_domain(f.act), f.act.op_type, act_inputs,
                              attributes=[ir.Attr(a_.name, a_.type, a_.value) for a_ in f.act.attributes.values()])
                new_act, old_act, a_out = [act], [f.act], act.outputs[0]
            else:  # GELU written out (Erf form): its elementwise nodes stay, reading the reduced h
                z = (f.add1 or f.mm1).outputs[0]
                for node in f.act_nodes:
                    for j, v_in in enumerate(node.inputs):
                        if v_in is z:
                            node.replace_input_with(j, h)
                    node.outputs[0].shape = None
                new_act, old_act, a_out = [], [], f.act.outputs[0]
            t2 = ir.tape.Tape()
            w2 = t2.op("Gather", [const(f.w2, "w2"), rows], attributes={"axis": 0})
            y = t2.op("MatMul", [a_out, w2])
            y.shape, y.type = f.mm2.outputs[0].shape, f.mm2.outputs[0].type
            for node in (*t.nodes, *new_act):
                graph.insert_before(f.mm1, node)
            for node in t2.nodes:
                graph.insert_before(f.mm2, node)
            old = f.mm2.outputs[0]
            old.replace_all_uses_with(y)
            name = old.name
            for node in (f.mm2, *old_act, *([f.add1] if f.add1 else []), f.mm1):
                graph.remove(node, safe=True)
            y.name = name
            for n in list(graph.initializers):
                if not list(graph.initializers[n].uses()) and not graph.initializers[n].is_graph_output():
                    graph.initializers.pop(n)
        return rows_out

    def evaluate(self, keeps: Sequence[float], held_always: bool = False) -> lossy.Measured:
        """Calib and held comparisons (held: None when calib fails) and, as ``extra``, the mean union fraction
        of the FFN rows on held feeds (nan when not run)."""
        cand = self.model.clone()
        rows = self.build(cand, keeps)
        by_name = {o.name: o for n in cand.graph for o in n.outputs}
        for r in rows:
            cand.graph.outputs.append(by_name[r])
        sess = runtime.make_session(standins.cpu_runnable(cand)[0], threads=1)
        s = self.s
        width = [f.width for f, k in zip(self.ffns, keeps) if k < 1.0]
        union = [float("nan")]

        def score(part: str) -> Comparison:
            got = runtime.run(sess, s.feeds(part))
            if part == lossy.HELD:
                frac = [g[r].size / w for g in got for r, w in zip(rows, width)]
                union[0] = float(np.mean(frac)) if frac else 1.0
            return s.compare(part, got)

        m = s.evaluate(score, held_always)
        m.extra = union[0]
        return m

    def cos(self, c: Comparison) -> str:
        return self.s.cosine_text(c)

    def row(self, keeps, cal: Comparison, held: Comparison | None, union: float, verdict: str) -> None:
        def m(c: Comparison | None) -> str:
            return "—" if c is None else f"{self.cos(c)}/{c.worst('cosine_min'):.4f}"

        ks = " ".join("dense" if k >= 1 else f"{k:.0%}" for k in keeps)
        un = "—" if np.isnan(union) else f"{union:.0%}"
        self.table.append(f"{ks:40s} | calib cos/min {m(cal)} | held {m(held)} | union kept {un} | {verdict}")

    # ------------------------------------------------------------ the pass

    def go(self) -> PassResult:
        o, ctx, model = self.opts, self.ctx, self.model
        self.ffns = _ffn.find(model)
        self.s = s = lossy.BudgetSearch.of(o, ctx, confidence=o.confidence)
        if not self.ffns:
            s.note(_ffn.NO_FFN_NOTE)
            return s.result(model, False)
        s.rows(model, ctx)
        self.stats = _ffn.collect(model, self.ffns, s.calib)
        if any(self.stats.get(f.x.name) is None or self.stats[f.x.name].xtx is None for f in self.ffns):
            s.note("not applied: no calibration activations for the FFN inputs")
            return s.result(model, False)
        self.pred = [fit_predictor(f.w1, self.stats[f.x.name].xtx, o.rank, o.damp) for f in self.ffns]
        ref_sess = runtime.make_session(standins.cpu_runnable(model)[0], threads=1)
        s.reference(lambda feeds: runtime.run(ref_sess, feeds))
        cost = np.mean([(f.hidden + f.width) * min(o.rank, f.hidden) / (2.0 * f.hidden * f.width) for f in self.ffns])
        s.note(f"{len(self.ffns)} FFN blocks; predictor rank {o.rank}: {cost:.1%} of a dense FFN's multiply-adds "
               f"per token; {len(s.calib)} calibration / {len(s.held)} held-back feeds")

        if o.keep:
            keeps = [o.keep] * len(self.ffns)
            m = self.evaluate(keeps, held_always=True)
            fails = s.fails(m.held) if s.given else []
            self.row(keeps, m.calib, m.held, m.extra, "breaks the budget" if fails else "as asked")
            self._report(keeps)
            if fails:
                s.note(f"budget {s.budget} not met ({'; '.join(fails)}): model unchanged")
                return s.result(model, False, met=False, held=m.held)
            self.build(model, keeps)
            return s.result(model, True, met=True if s.given else None, held=m.held,
                            rule_counts={"ffn": len(self.ffns)})

        s.note_default()
        rungs = lossy.ladder(len(self.ffns), [*LEVELS, 1.0], lambda i, k: self.local(i, k)[0])[:-1]
        j, seen = s.first_confirmed(len(rungs), lambda j: self.evaluate(rungs[j]),
                                    lambda j, m: self.row(rungs[j], m.calib, m.held, m.extra, s.verdict(m)))
        if j is None:
            self._report(None)
            s.note(f"declined: no keep fraction meets the budget {s.budget} on held-back feeds; model unchanged")
            return s.result(model, False, met=False)
        keeps = rungs[j]
        self._report(keeps)
        held, union = seen[j].held, seen[j].extra
        if union > o.max_union:
            s.note(f"declined: the budget holds at keep {' '.join(f'{k:.0%}' for k in keeps)}, but on the held-back "
                   f"batches the union of their tokens' selections keeps {union:.0%} of the FFN rows "
                   f"(> max_union {o.max_union:.0%}): no saving at these batch sizes; model unchanged")
            return s.result(model, False, met=False, held=held)
        self.build(model, keeps)
        s.note(f"chose keep {' '.join('dense' if k >= 1 else f'{k:.0%}' for k in keeps)}; held-back cosine "
               f"{self.cos(held)}, cosine_min {held.worst('cosine_min'):.4f}; union of the batch's "
               f"selections kept {union:.0%} of the FFN rows")
        return s.result(model, True, met=True, held=held, rule_counts={"ffn": sum(k < 1 for k in keeps)})

    def _report(self, keeps: Sequence[float] | None) -> None:
        levels = keeps or [LEVELS[len(LEVELS) // 2]] * len(self.ffns)
        rec = [f"{f.key}: k={k:.0%} recall {self.local(i, k)[1]:.3f}" for i, (f, k) in
               enumerate(zip(self.ffns, levels)) if k < 1.0]
        if rec:
            self.s.note("predictor recall vs oracle top-k (calibration tokens): " + "; ".join(rec))
        if self.table:
            self.s.note("measured (keep per layer | calib | held | union kept | verdict):\n  " + "\n  ".join(self.table))


register(ContextualSparsityPass)

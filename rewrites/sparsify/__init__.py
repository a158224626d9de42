"""``sparsify``: prune FFN weights (lossy; under a budget).

For every FFN block (see ``_ffn``: MatMul → (Add) → Gelu/BiasGelu/FastGelu → MatMul, padded or packed
tokens) it drops weights in one of four patterns (``pattern=``):

- ``neurons``: whole FFN neurons (columns of W1, entries of b1, rows of W2): two plain, smaller MatMuls;
- ``blocks``: balanced ``block_size`` x ``block_cols`` blocks (rows of K x columns of N; ``block_cols``
  defaults to ``block_size``) of W1 and W2, every output block column keeping the same number of input
  blocks: ``ai.graphopt::BlockSparseMatMul`` (Gather of kept blocks + batched MatMul; wider blocks run
  faster at small batches, coarser on quality: 32x128 is ~2x dense at 75% on MiniLM's shapes where 32x32
  is 1.5-1.8x, tools/bench_sparse_gemm.py);
- ``2:4``: two of every four weights along K: ``ai.graphopt::NMSparseMatMul`` (compact storage, computed
  dense: ORT has no kernel that skips the zeros);
- ``unstructured``: the lowest-scoring weights of each output column set to zero (a dense MatMul: smaller
  only once compressed, never faster here);
- ``auto`` (default): the faster forms (``neurons``, ``blocks``); the one that meets the budget with the
  fewest FFN multiply-adds wins.

Scores (``scores=``): ``wanda`` (|W| · ‖x‖ of the input feature over calibration tokens; for neurons
‖a_j‖ · ‖W2[j]‖) or ``magnitude`` (|W|; for neurons ‖W1[:, j]‖ · ‖W2[j]‖). ``compensate=true`` re-fits the
kept weights on calibration activations: an exact least-squares solve where all columns of a group share
their kept rows (neurons: W2 on the kept neurons; blocks: one solve per output block column); where every
column has its own mask (2:4, unstructured) one solve per column while a column keeps at most
``EXACT_MAX_ROWS`` (512) rows, else the SparseGPT sequential update (OBS with the mask fixed, lazy batches:
cheaper, but on a correlated toy it removed 7% of the error where exact solves removed 36%).

Budget: ``ctx.budget`` (default ``metrics.DEFAULT_BUDGET``), searched and confirmed by ``common.lossy``. Per-layer sparsity: every layer starts
at the pattern's sparsest level; the layer with the largest local error (relative error of its FFN output on
calibration tokens) is stepped down one level at a time, making a ladder from sparsest to dense; a binary
search (quality assumed monotone along the ladder) finds the sparsest rung that meets the budget on the
calibration feeds and then on the held-back feeds (``ctx.feeds``). Both measurements of every rung tried
go to the notes. The held-back ``cosine`` that must meet the budget is a one-sided lower confidence bound
(``confidence=``, default 0.95; 0: the plain mean) of the mean token cosine, sentences (batch rows) as the
units (``common.bounds.cosine_lower_bound``): a plan that just scrapes past the budget on a few held-back batches
missed it on unseen sentences (0.9903 held back, 0.9899 unseen, docs/benchmarks.md). With an explicit
``sparsity=``
every FFN gets that sparsity and the cost is reported (with a budget that it breaks, the model is kept).

``budget_share=S`` spends only ``S`` of the budget's slack (as in ``prune-heads``), leaving the rest to a
later lossy pass (the ``sparse-int8`` recipe: sparsify on half, then quantize).

Declines (model unchanged, ``budget_met=False``, the measured table in the notes): nothing faster than dense
meets the budget. Not applied: no FFN block with constant weights, or shapes the block size does not divide.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from graphopt.data.metrics import DEFAULT_BUDGET, Comparison
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.rewrites.common import ffn as _ffn
from graphopt.rewrites.common import lossy
from graphopt.rewrites.common.names import unique_name
from graphopt.rewrites.sparsify.weights import (
    EXACT_MAX_ROWS,
    block_mask,
    column_mask,
    lstsq_columns,
    lstsq_groups,
    nm_mask,
    sparsegpt,
)
from graphopt.runtime import custom_ops, standins
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)

PATTERNS = ("auto", "neurons", "blocks", "2:4", "unstructured")
#: the sparsity levels the budget search walks, sparsest first (blocks below 75% are no faster than dense:
#: tools/bench_sparse_gemm.py)
LEVELS = {"neurons": (0.75, 0.5, 0.375, 0.25, 0.125), "blocks": (0.9, 0.75), "2:4": (0.5,),
          "unstructured": (0.9, 0.75, 0.5)}
#: forms that run faster than a dense MatMul on CPU (tools/bench_sparse_gemm.py)
FASTER = ("neurons", "blocks")


@dataclasses.dataclass
class _Layer:
    """One FFN pruned at one level: the new weights (and the op inputs for the custom forms)."""

    w1: np.ndarray
    w2: np.ndarray
    b1: np.ndarray | None
    keep1: np.ndarray | None = None  # block / n:m / element masks
    keep2: np.ndarray | None = None
    local_error: float = 0.0


class SparsifyPass(GraphoptPass):
    """Prune FFN weights (whole neurons, balanced blocks, 2:4 or unstructured) under an accuracy budget."""

    name = "sparsify"
    exact = False
    default_budget = DEFAULT_BUDGET
    emits = (f"{custom_ops.DOMAIN}::BlockSparseMatMul", f"{custom_ops.DOMAIN}::NMSparseMatMul")

    def __init__(self, *, pattern: str = "auto", sparsity: float = 0.0, scores: str = "wanda",
                 compensate: bool = True, block_size: int = 32, block_cols: int = 0, damp: float = 0.01,
                 confidence: float = 0.95, budget_share: float = 1.0):
        super().__init__()
        if pattern not in PATTERNS:
            raise UsageError(f"sparsify.pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
        if scores not in ("wanda", "magnitude"):
            raise UsageError(f"sparsify.scores must be wanda or magnitude, got {scores!r}")
        if not 0.0 <= sparsity < 1.0:
            raise UsageError(f"sparsify.sparsity must be in [0, 1) (0: chosen by the budget), got {sparsity}")
        if sparsity and pattern == "auto":
            raise UsageError("sparsify.sparsity needs a pattern (neurons, blocks, 2:4 or unstructured)")
        if pattern == "2:4" and sparsity not in (0.0, 0.5):
            raise UsageError(f"sparsify.sparsity must be 0.5 for pattern 2:4, got {sparsity}")
        if block_size < 4 or block_size & (block_size - 1):
            raise UsageError(f"sparsify.block_size must be a power of two >= 4, got {block_size}")
        if block_cols and (block_cols < 4 or block_cols % 4):
            raise UsageError(f"sparsify.block_cols must be a multiple of 4 (0: block_size), got {block_cols}")
        if damp <= 0:
            raise UsageError(f"sparsify.damp must be > 0, got {damp}")
        if not 0.0 <= confidence < 1.0:
            raise UsageError(f"sparsify.confidence must be in [0, 1), got {confidence}")
        if not 0.0 < budget_share <= 1.0:
            raise UsageError(f"sparsify.budget_share must be in (0, 1], got {budget_share}")
        self.confidence, self.budget_share = float(confidence), float(budget_share)
        self.pattern, self.sparsity, self.scores = pattern, float(sparsity), scores
        self.compensate, self.block_size, self.damp = bool(compensate), int(block_size), float(damp)
        self.block_cols = int(block_cols) or self.block_size

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        run = _Run(self, model, ctx)
        return run.go()


@dataclasses.dataclass
class _Run:
    """One call of the pass (made by ``SparsifyPass.call``; nothing of it is kept on the pass)."""

    opts: SparsifyPass
    model: ir.Model
    ctx: PassContext
    cache: dict = dataclasses.field(default_factory=dict)
    table: list[str] = dataclasses.field(default_factory=list)

    # ------------------------------------------------------------ pruning one layer

    def layer(self, i: int, pattern: str, level: float) -> _Layer:
        """FFN ``i`` pruned to ``pattern`` at ``level`` (cached for the call)."""
        key = (i, pattern, level)
        if key in self.cache:
            return self.cache[key]
        f = self.ffns[i]
        o = self.opts
        w1, w2, b1 = f.w1.astype(np.float32), f.w2.astype(np.float32), f.b1
        gx, ga = self.stats[f.x.name].xtx, self.stats[f.a.name].xtx
        k1 = k2 = None
        if pattern == "neurons":
            if o.scores == "wanda":
                s = np.sqrt(np.maximum(np.diag(ga), 0)) * np.linalg.norm(w2, axis=1)
            else:
                s = np.linalg.norm(w1, axis=0) * np.linalg.norm(w2, axis=1)
            kept = np.sort(np.argsort(-s, kind="stable")[:max(1, round(f.width * (1 - level)))])
            nw2 = (lstsq_groups(w2, ga, [(kept, np.arange(w2.shape[1]))], o.damp)[kept] if o.compensate
                   else w2[kept])
            lay = _Layer(np.ascontiguousarray(w1[:, kept]), np.ascontiguousarray(nw2),
                         None if b1 is None else b1[kept], keep1=kept)
        else:
            ws = []
            for w, g in ((w1, gx), (w2, ga)):
                if pattern == "blocks":
                    b, bn = o.block_size, o.block_cols
                    keep = block_mask(w, g, level, b, o.scores, bn)
                    dense = np.kron(keep, np.ones((b, bn), bool))
                    if o.compensate:
                        groups = [(np.flatnonzero(dense[:, j * bn]), np.arange(j * bn, (j + 1) * bn))
                                  for j in range(keep.shape[1])]
                        nw = lstsq_groups(w, g, groups, o.damp) * dense
                    else:
                        nw = w * dense
                else:
                    keep = nm_mask(w, g, o.scores) if pattern == "2:4" else column_mask(w, g, level, o.scores)
                    if not o.compensate:
                        nw = w * keep
                    elif keep.sum(axis=0).max() <= EXACT_MAX_ROWS:
                        nw = lstsq_columns(w, keep, g, o.damp)
                    else:
                        nw = sparsegpt(w, keep, g, o.damp)
                ws.append((nw.astype(np.float32), keep))
            (nw1, k1), (nw2, k2) = ws
            lay = _Layer(nw1, nw2, b1, keep1=k1, keep2=k2)
        rows = self.stats[f.x.name].rows
        if rows is not None and len(rows):
            def ffn(a_w1, a_b1, a_w2):
                z = rows @ a_w1 + (0 if a_b1 is None else a_b1)
                return _ffn.gelu(z) @ a_w2

            ref = ffn(w1, b1, w2)
            got = ffn(lay.w1, lay.b1, lay.w2)
            lay.local_error = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12))
        self.cache[key] = lay
        return lay

    # ------------------------------------------------------------ building a model

    def build(self, model: ir.Model, plan: Mapping[int, tuple[str, float]]) -> dict[str, int]:
        """Apply ``plan`` (FFN index -> (pattern, level)) to ``model`` (a clone of the input) in place."""
        ffns = _ffn.find(model)
        counts: dict[str, int] = {}
        for i, (pattern, level) in plan.items():
            if level <= 0:
                continue
            f, lay = ffns[i], self.layer(i, pattern, level)
            counts[pattern] = counts.get(pattern, 0) + 1
            graph = model.graph
            if pattern in ("neurons", "unstructured"):
                _ffn.replace_const(f.mm1, 1, lay.w1, unique_name(graph, f"{f.key}_w1_sparse"))
                _ffn.replace_const(f.mm2, 1, lay.w2, unique_name(graph, f"{f.key}_w2_sparse"))
                if pattern == "neurons":
                    if f.bias is not None:
                        node = f.add1 if f.add1 is not None else f.act
                        idx = list(node.inputs).index(f.bias)
                        _ffn.replace_const(node, idx, lay.b1, unique_name(graph, f"{f.key}_b1_sparse"))
                    width = lay.w1.shape[1]
                    for v in (f.mm1.outputs[0], *(f.add1.outputs if f.add1 else ()),
                              *(n.outputs[0] for n in f.act_nodes)):
                        _ffn.set_width(v, width)
                continue
            for mm, w, keep, tag in ((f.mm1, lay.w1, lay.keep1, "w1"), (f.mm2, lay.w2, lay.keep2, "w2")):
                if pattern == "blocks":
                    a, b = custom_ops.pack_blocks(w, keep, self.opts.block_size, self.opts.block_cols)
                    op, attrs = "BlockSparseMatMul", {"block_size": self.opts.block_size}
                else:
                    a, b = custom_ops.pack_nm(w, keep)
                    op, attrs = "NMSparseMatMul", {"n": 2, "m": 4}
                self._replace_matmul(graph, mm, op, attrs, a, b, f"{f.key}_{tag}")
        custom_ops.attach(model)
        return counts

    @staticmethod
    def _replace_matmul(graph: ir.Graph, mm: ir.Node, op: str, attrs: dict[str, int], a: np.ndarray,
                        b: np.ndarray, base: str) -> None:
        consts = []
        for arr, suffix in ((a, "values"), (b, "index")):
            name = unique_name(graph, f"{base}_{suffix}")
            v = ir.Value(name=name, const_value=ir.tensor(arr, name=name), shape=ir.Shape(arr.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)))
            graph.register_initializer(v)
            consts.append(v)
        old_w = mm.inputs[1]
        out = mm.outputs[0]
        node = ir.Node(custom_ops.DOMAIN, op, [mm.inputs[0], *consts],
                       attributes=[ir.AttrInt64(k, v) for k, v in attrs.items()],
                       name=unique_name(graph, f"{mm.name or base}_{op}"))
        node.outputs[0].shape, node.outputs[0].type = out.shape, out.type
        graph.insert_before(mm, node)
        out.replace_all_uses_with(node.outputs[0])
        name = out.name
        graph.remove(mm, safe=True)
        node.outputs[0].name = name
        if old_w is not None and not list(old_w.uses()) and old_w.name in graph.initializers:
            graph.initializers.pop(old_w.name)

    # ------------------------------------------------------------ measuring

    def evaluate(self, plan: Mapping[int, tuple[str, float]], held_always: bool = False) -> lossy.Measured:
        """Quality of ``plan`` on the calibration feeds and (when those meet the budget) the held-back ones."""
        cand = self.model.clone()
        self.build(cand, plan)
        sess = runtime.make_session(standins.cpu_runnable(cand)[0], threads=1)
        s = self.s
        return s.evaluate(lambda part: s.compare(part, runtime.run(sess, s.feeds(part))), held_always)

    def held_cosine(self, held: Comparison) -> str:
        """``held-back cosine X`` (and its lower bound when one is used)."""
        return f"held-back cosine {self.s.cosine_text(held)}"

    def macs(self, plan: Mapping[int, tuple[str, float]]) -> float:
        """FFN multiply-adds kept, as a fraction of dense (2:4 and unstructured run dense: 1.0)."""
        total = kept = 0.0
        for i, f in enumerate(self.ffns):
            m = 2.0 * f.hidden * f.width
            pattern, level = plan.get(i, ("neurons", 0.0))
            total += m
            kept += m * (1 - level if pattern in FASTER else 1.0)
        return kept / total if total else 1.0

    def describe(self, plan: Mapping[int, tuple[str, float]]) -> str:
        return " ".join(f"{level:.0%}" if level else "dense" for _, level in
                        (plan[i] for i in range(len(self.ffns))))

    def row(self, pattern: str, plan, calib: Comparison | None, held: Comparison | None, verdict: str) -> None:
        def m(c: Comparison | None) -> str:
            return "—" if c is None else f"{self.s.cosine_text(c)}/{c.worst('cosine_min'):.4f}"

        self.table.append(f"{pattern:12s} | {self.describe(plan):40s} | FFN MACs {self.macs(plan):5.1%} | "
                          f"calib cos/min {m(calib)} | held {m(held)} | {verdict}")

    # ------------------------------------------------------------ the search

    def search(self, pattern: str) -> tuple[dict[int, tuple[str, float]] | None, Comparison | None]:
        """The sparsest plan of ``pattern`` meeting the budget on calibration and then held-back feeds.

        A ladder from every layer at the sparsest level to dense (the layer with the largest local error
        relaxed first), binary-searched (quality assumed monotone along it): a rung passes when it meets the
        budget on the calibration feeds and then on the held-back feeds.
        """
        rungs = lossy.ladder(len(self.ffns), [*LEVELS[pattern], 0.0],
                             lambda i, level: self.layer(i, pattern, level).local_error)[:-1]
        plans = [{i: (pattern, level) for i, level in enumerate(r)} for r in rungs]
        j, seen = self.s.first_confirmed(
            len(plans), lambda j: self.evaluate(plans[j]),
            lambda j, m: self.row(pattern, plans[j], m.calib, m.held, self.s.verdict(m)))
        return (None, None) if j is None else (plans[j], seen[j].held)

    def go(self) -> PassResult:
        o, ctx, model = self.opts, self.ctx, self.model
        self.ffns = _ffn.find(model)
        self.s = s = lossy.BudgetSearch.of(o, ctx, budget_share=o.budget_share, confidence=o.confidence)
        if not self.ffns:
            s.note(_ffn.NO_FFN_NOTE)
            return s.result(model, False)
        patterns = [o.pattern] if o.pattern != "auto" else list(FASTER)
        if "blocks" in patterns and any(d % o.block_size or d % o.block_cols for f in self.ffns
                                        for d in (f.hidden, f.width)):
            if o.pattern == "blocks":
                s.note(f"not applied: blocks {o.block_size}x{o.block_cols} do not divide the FFN shapes")
                return s.result(model, False)
            patterns.remove("blocks")
        if {"blocks", "2:4"} & set(patterns) and model.opset_imports.get("", 0) < custom_ops.BODY_OPSET:
            if o.pattern in ("blocks", "2:4"):
                s.note(f"not applied: the {custom_ops.DOMAIN} ops need opset >= {custom_ops.BODY_OPSET}")
                return s.result(model, False)
            patterns = [p for p in patterns if p not in ("blocks", "2:4")]
        if "2:4" in patterns and any(f.hidden % 4 or f.width % 4 for f in self.ffns):
            s.note("not applied: FFN shapes not divisible by 4")
            return s.result(model, False)
        s.rows(model, ctx)
        self.stats = _ffn.collect(model, self.ffns, s.calib)
        missing = [f.key for f in self.ffns if self.stats.get(f.x.name) is None or self.stats.get(f.a.name) is None
                   or self.stats[f.x.name].xtx is None or self.stats[f.a.name].xtx is None]
        if missing:
            s.note(f"not applied: no calibration activations for {', '.join(missing)}")
            return s.result(model, False)
        ref_sess = runtime.make_session(standins.cpu_runnable(model)[0], threads=1)
        s.reference(lambda feeds: runtime.run(ref_sess, feeds))
        s.note(f"{len(self.ffns)} FFN blocks; scores {o.scores}, compensation {'on' if o.compensate else 'off'}; "
               f"{len(s.calib)} calibration / {len(s.held)} held-back feeds")

        if o.sparsity:
            plan = {i: (o.pattern, o.sparsity) for i in range(len(self.ffns))}
            m = self.evaluate(plan, held_always=True)
            held = m.held
            fails = s.fails(held) if s.given else []
            self.row(o.pattern, plan, m.calib, held, "breaks the budget" if fails else "as asked")
            self._table_note()
            s.note(f"asked for {o.pattern} at {o.sparsity:.0%}: {self.held_cosine(held)}, "
                   f"cosine_min {held.worst('cosine_min'):.4f}, max_abs {held.worst('max_abs'):.3g}; "
                   f"FFN multiply-adds {self.macs(plan):.0%} of dense")
            if fails:
                s.note(f"budget {s.budget} not met ({'; '.join(fails)}): model unchanged")
                return s.result(model, False, met=False, held=held)
            counts = self.build(model, plan)
            return s.result(model, True, met=True if s.given else None, held=held, rule_counts=counts)

        s.note_default()
        best: tuple[float, str, dict, Comparison] | None = None
        for pattern in patterns:
            plan, held = self.search(pattern)
            if plan is not None and (best is None or self.macs(plan) < best[0]):
                best = (self.macs(plan), pattern, plan, held)
        self._table_note()
        if best is None or (best[0] >= 1.0 and o.pattern in ("auto", *FASTER)):
            s.note(f"declined: no {'/'.join(patterns)} sparsity meets the budget {s.budget} on held-back feeds"
                   "; model unchanged")
            return s.result(model, False, met=False)
        macs, pattern, plan, held = best
        counts = self.build(model, plan)
        s.note(f"chose {pattern}: per-layer sparsity {self.describe(plan)}; FFN multiply-adds {macs:.0%} of dense; "
               f"{self.held_cosine(held)}, cosine_min {held.worst('cosine_min'):.4f}")
        return s.result(model, True, met=True, held=held, rule_counts=counts)

    def _table_note(self) -> None:
        if self.table:
            self.s.note("measured (pattern | per-layer sparsity | FFN MACs | calib | held | verdict):\n  "
                        + "\n  ".join(self.table))


register(SparsifyPass)

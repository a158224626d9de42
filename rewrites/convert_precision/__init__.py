"""``convert-precision``: float weights and compute to fp16 or bf16, with fp32 islands (lossy, under a budget).

    x(fp32) ─▶ MatMul(W) ─▶ Add(b) ─▶ Softmax ─▶ MatMul(V) ─▶ y(fp32)
becomes
    x ─Cast─▶ MatMul(W16) ─▶ Add(b16) ─Cast─▶ Softmax ─Cast─▶ MatMul(V16) ─Cast─▶ y
                                              └ fp32 island ┘

Every node is one of three kinds:

- *compute* (MatMul, Gemm, Gelu, LayerNormalization, contrib ops...): runs in the target precision
  where its type constraints accept it; standard ops from their ONNX schema, ``com.microsoft`` ops from
  the types their CUDA kernels register (``CONTRIB_CUDA``; e.g. PackedMultiHeadAttention and
  EmbedLayerNormalization have no bf16 kernel and stay fp32 under ``precision=bf16``). Outputs whose
  type the op fixes by an attribute (LayerNormalization's Mean/InvStdDev, ``stash_type``) keep it: the
  normalization statistics of LayerNormalization (``stash_type=1``) and of the Skip/Simplified
  LayerNormalization kernels are computed in fp32 by the op itself; a LayerNormalization with another
  ``stash_type`` is blocked.
- *blocked* (option ``block``; default ``DEFAULT_BLOCK``: Softmax, exponentials and logarithms, Pow and
  the accumulating reductions): fp32 islands. So are nodes with subgraphs and ops of unknown domains.
- *follow* (data movement, comparisons and cheap elementwise ops): runs in the precision of its
  computed inputs (the target precision if any is, else fp32), so an island grows through the
  elementwise tail of a statistic (RMSNorm's ``Add(eps) -> Sqrt -> Reciprocal``) instead of casting
  back and forth.

Casts sit only where a value crosses between the two precisions, one per value and precision,
inserted once and shared. Constants (initializers, ``Constant``, ``ConstantOfShape``) and
``Cast(to=FLOAT)`` nodes are converted at their source: a consumer in each precision gets its own
copy, never a Cast of a Cast. Finite values beyond the target's range are clamped to its largest
finite value (the notes count them). A final cleanup folds any ``Cast(Cast(x))`` chain left (a round
trip through a wider float becomes ``x``; a chain whose first cast is exact becomes one Cast).

``keep_io_types=true`` (default): float graph inputs and outputs stay fp32 (Casts at the boundary);
``false``: they change to the target type.

Verification: ONNX Runtime's CPU provider has no fp16/bf16 kernel for most ops; the pipeline runs
such nodes through the precision stand-ins of ``graphopt.runtime.standins`` (inputs cast to fp32, the op in
fp32, outputs rounded to the target type: what the CUDA kernels compute, with fp32 accumulation), and
the report names them. The budget (``default_budget``, or ``--budget``) is confirmed by the pipeline
on held-back feeds against the input model; the pass itself makes one candidate.

Refuses (model unchanged, note): a model with no float initializer and no float compute; a model whose
subgraphs (If/Loop/Scan bodies) read float values of the main graph directly (nodes with subgraphs
are otherwise fp32 islands, their bodies untouched).
"""

from __future__ import annotations

import onnx_ir as ir

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.rewrites.common import lossy
from graphopt.rewrites.convert_precision.convert import DEFAULT_BLOCK, F32, PRECISIONS, Converter


def _captured_floats(graph: ir.Graph) -> list[str]:
    """Names of main-graph float values that nodes inside subgraphs read directly (implicit captures)."""
    names = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.graph is graph:
            continue
        for v in node.inputs:
            if v is None or v.dtype != F32:
                continue
            owner = v.producer().graph if v.producer() is not None else v.graph
            if owner is graph and v.name not in names:
                names.append(v.name or "?")
    return names


def _float_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values()
               if v.const_value is not None and v.dtype is not None and v.dtype.is_floating_point())


class ConvertPrecisionPass(GraphoptPass):
    """Convert float weights and compute to fp16/bf16 with fp32 islands for sensitive ops (lossy)."""

    name = "convert-precision"
    exact = False
    default_budget = "cosine>=0.999"
    run_after = ("cleanup", "fuse", "remove-padding")

    def __init__(self, *, precision: str = "fp16", keep_io_types: bool = True,
                 block: str = ",".join(DEFAULT_BLOCK)):
        super().__init__()
        if precision not in PRECISIONS:
            raise UsageError(f"convert-precision.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.keep_io_types = keep_io_types
        self.block = block

    def _block_set(self) -> frozenset[str]:
        return frozenset(b.strip() for b in self.block.split(",") if b.strip())

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        # nothing to search: the conversion is fixed by the options; the pipeline verifies the budget
        # (``BudgetOutcome.measured`` stays empty)
        s = lossy.BudgetSearch.of(self, ctx)
        low = PRECISIONS[self.precision]
        run = Converter(model, low, self._block_set(), self.keep_io_types)
        model.graph.sort()
        run.infer_dtypes()  # adds element types only where the model has none
        captured = _captured_floats(model.graph)
        if captured:
            s.note(f"not applied: subgraphs (If/Loop/Scan bodies) read outer float values ({', '.join(captured[:3])}); "
                   "converting them would change the bodies' input types", log=False)
            return s.result(model, False)
        before = _float_bytes(model)
        run.run()
        computed_low = sum(1 for v, p in run.prec.items() if p == low and not v.is_graph_input())
        if not run.counts["initializers"] and not computed_low:
            s.note("not applied: no float initializer or float compute", log=False)
            return s.result(model, False)
        after = _float_bytes(model)
        s.note(f"{self.precision}: float initializers {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB; "
               f"{run.counts['casts']} Cast(s) at precision boundaries", log=False)
        if run.fp32_ops:
            s.note("kept fp32: " + ", ".join(f"{k} x{v}" for k, v in sorted(run.fp32_ops.items())), log=False)
        if run.clamped:
            s.note(f"{run.clamped} constant value(s) beyond the {self.precision} range clamped to its largest "
                   "finite value", log=False)
        if ctx.provider != "cuda":
            s.note("targets GPUs: ONNX Runtime's CPU provider runs most fp16/bf16 ops by casting to fp32 (slower)",
                   log=False)
        return s.result(model, True, rule_counts={k: v for k, v in run.counts.items() if v})

register(ConvertPrecisionPass)

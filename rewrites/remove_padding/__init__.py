"""remove-padding: run every token-wise op of a transformer encoder on packed real tokens only.

Serving batches are mostly padding. This whole-graph rewrite computes the real-token positions from
the attention mask once (any padding side, any mask pattern: ``NonZero(Flatten(mask))``) and runs every
op that treats tokens independently (embeddings, projections, bias/residual adds, LayerNorms, GELU,
FFN, fused SkipLayerNormalization/BiasGelu/EmbedLayerNormalization) on packed ``[1, N+1, ...]`` tensors:
the ``N`` real tokens plus one scratch row (a copy of the first real token, see ``index.py``)::

    input_ids [B,S] --pack--> [1,N+1] --Gather(emb)+Add--LayerNorm--> x [1,N+1,H]
                                                                          |
      unfused attention core (standard ops):                              v
        unpack Q,K,V --> [B,S,H] --Reshape/Transpose/MatMul/Softmax(+mask)/MatMul--> [B,S,H] --pack-->
      fused attention (com.microsoft Attention / MultiHeadAttention), attention_groups=G > 0:
        rows sorted by length, cut into G groups, each laid out [B_g, L_g] (L_g = its longest row):
        Q,K,V packed --Gather--> MultiHeadAttention per group (mask bias gathered into the layout,
        filler keys masked) --Concat/Gather--> context [1,N+1,H]
                                                                          |
      ... <-- LayerNorm <-- Add(residual) <-- MatMul+Add (output proj) <--+
      graph output: [1,N+1,H] --unpack--> [B,S,H] with padded positions set to 0
              or, with ``packed_output=True``, [N,H]: the real tokens in row-major (batch, position) order

With ``--provider cuda`` (``ctx.provider == "cuda"``), fused attention instead runs as
com.microsoft ``PackedMultiHeadAttention`` on the packed rows (no padding outside the op)::

    q, k, v [1,N+1,H] --Squeeze--> [N+1,H] --PackedMultiHeadAttention(bias, token_offset, cu)--> [N+1,Hv] --Unsqueeze-->
    cu [B+2]: [0, cumsum(real tokens per row ++ [1])]   token_offset [B+1, L]: see ``index.PackedAttentionIndex``

The op reads each row's real tokens as one right-padded sequence (the scratch row is a sequence of
its own), which is exact for any padding side or holes because a key padding mask does not care
where in the row the keys are. The op masks by sequence lengths only, so it is used only when the
attention op's mask is the attention mask input itself (through Cast/Identity) and there is no
attention bias; otherwise that op keeps the CPU formulation (length groups), with the reason in
the result's ``notes``. ONNX Runtime has no CPU kernel for the op: the pipeline verifies such a model on
CPU through a standard-op stand-in (``graphopt/runtime/standins.py``), and ``tools/cuda_checks.py`` checks
the CUDA kernel on a GPU. ``packed_attention=False`` keeps the CPU formulation on CUDA too.
ORT's CUDA kernel takes float and float16. In float32 its fused kernels (TensorRT, flash) are off
and memory-efficient attention starts at ``L >= 256``, so below that it runs the unfused kernel,
which re-pads Q/K/V inside the op to ``[B+1, L]`` by ``token_offset`` (``L``: the longest row).

Broadcast operands are packed the cheap way: a ``[1,S,H]`` or ``[S,H]`` position embedding by the
sequence index of each token, a ``[B,1,...]`` operand by its batch index, ``[H]`` biases as they are.

Which ops run packed is decided from dimension labels measured by running the model twice with
different batch/sequence sizes (``probe.probe_labels``), so it works on TorchScript and dynamo
exports, eager or sdpa attention, unfused or fused, without matching a pattern. An op is packed when it
is token-wise (an allow-list, axis attributes checked, ``tokenwise.py``), its outputs are ``[B,S,...]``
and an input is packed already or hidden-state data (values computed from the mask alone stay as they are).

Flattened token rows (GPT-2's Conv1D, and other exports of ``nn.Linear`` as ``Gemm``) are token-wise
too: a ``[B*S, ...]`` value whose rows are the (batch, position) pairs in row-major order (a Reshape
of a ``[B,S,...]`` value) is packed as ``[N+1, ...]`` rows, so a Gemm or MatMul over them mixes nothing::

    x [1,N+1,H] --Reshape--> [N+1,H] --Gemm(W, b)--> [N+1,3H] --Reshape--> [1,N+1,3H]

First-token pooling (a sequence classifier's ``Gather(x, 0, axis=1)`` or ``Slice`` of ``[0:1]`` on the
sequence axis) reads one row per sequence from the packed rows, at each sequence's start offset in the
packing (``index.PackIndex.row_starts``); the pooler and classifier then run on ``[B, H]`` as before::

    hidden [1,N+1,H] --Squeeze--> [N+1,H] --Gather(row_starts [B])--> pooled [B,H] --> Gemm/Tanh/Gemm --> logits

That is position 0 of every row whose position 0 is a real token (right padding, what the pipeline's
feeds and BERT tokenizers make), bit for bit. A row whose position 0 is padding (left padding) pools its
first real token instead of the padding position the model read; the result's notes say so.

Exactness: token-wise ops give the same real-token values on packed input (MLAS rows are computed
independently, so the unfused exports match bit for bit). Values entering the attention core are
unpacked with a real token's values at padded positions instead of the padding embeddings' values.
Real-token outputs are unchanged when padded keys get exactly zero attention weight, which holds when
the softmax input carries the mask's large negative bias (``exp`` underflows to 0). The pass checks
that every op reached from an unpacked value before it is packed again is an attention-core op, that
the region has a Softmax over the last axis, and that every such Softmax depends on the mask input.
Grouped attention keeps the original bias values of every real (query, key) pair (gathered from the
``[B|1,1,S,S]`` bias or ``[B,S]`` key mask into the group layout) and gives filler keys the float32
minimum, so each real query sees exactly the same keys with the same scores.

Refuses (model unchanged, reason in the result's ``notes``) when: there is no rank-2 attention-mask input
or its batch/sequence dimensions are static; the graph is packed already; the opset is below 15; the graph has subgraphs (If/Loop/Scan); the model cannot be probed; nothing is
token-wise; a value leaving the packed region reaches an op that mixes positions outside attention
(e.g. mean pooling, a ReduceSum over the sequence or over flattened token rows, pooling of another
position than the first or a token shift by Gather/Slice/Concat on data) or a graph output; or a Softmax there does not
depend on the mask / is not over the key axis. A fused attention op without a mask input, with past
state, causal, or with other mask layouts is not grouped (it then runs on the unpacked batch when the
checks above pass).

The package: ``probe.py`` (dimension labels), ``tokenwise.py`` (which ops are token-wise, in which
layout), ``plan.py`` (which ops run packed and how: the checks above), ``index.py`` (the pack/unpack
index values), ``emit.py`` (the rewrite), this file (the pass).
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from graphopt.data.metrics import MASK_NAMES
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError, first_line
from graphopt.opsets import MS_DOMAIN, default_opset
from graphopt.runtime import ort_compat

from .emit import rewrite
from .plan import AttentionStrategy, Refusal, make_plan
from .probe import probe_labels

logger = logging.getLogger(__name__)



class RemovePaddingPass(GraphoptPass):
    """Run token-wise ops on packed real tokens; only attention sees padding (exact on real tokens)."""

    name = "remove-padding"
    exact = True
    run_after = ("fuse",)
    emits = (f"{MS_DOMAIN}::MultiHeadAttention", f"{MS_DOMAIN}::PackedMultiHeadAttention")

    def __init__(self, *, packed_output: bool = False, attention_groups: int = 8, packed_attention: bool = True,
                 attention_op: str = "mha"):
        super().__init__()
        if attention_op not in ATTENTION_OPS:
            raise UsageError(f"remove-padding.attention_op must be one of {', '.join(ATTENTION_OPS)}, "
                             f"got {attention_op!r}")
        #: the op of CPU length groups: ``mha`` (com.microsoft MultiHeadAttention), ``onnx`` (ONNX
        #: Attention, opset 23: the model's opset is raised to 23 and it needs ORT >= 1.23; faster and
        #: better-scaling attention on ORT 1.32 CPU) or ``auto`` (``onnx`` where the installed ONNX Runtime
        #: runs it, else ``mha``; what the ``int8`` recipe uses)
        self.attention_op = attention_op
        #: output ``[N, hidden]`` (real tokens, row-major) instead of ``[B, S, hidden]`` with zero padding
        self.packed_output = packed_output
        #: fused attention (com.microsoft MultiHeadAttention/Attention) runs on this many length-sorted
        #: groups of rows, each padded only to its own longest row; 0 keeps it on the padded batch
        self.attention_groups = attention_groups
        #: with provider cuda, fused attention runs as com.microsoft PackedMultiHeadAttention (no padding
        #: at all) where that is exact; False keeps the length groups of MultiHeadAttention
        self.packed_attention = packed_attention

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        mask = _find_mask(model.graph)
        reason = _precondition_refusal(model, mask)
        if reason is not None:
            return _refused(model, reason)
        try:
            labels = probe_labels(model, mask)
        except Exception as e:  # the model cannot run on probe feeds: nothing can be proven
            return _refused(model, f"cannot probe dimensions ({type(e).__name__}: {first_line(e, 200)})")
        cuda = ctx.provider == "cuda"
        try:
            plan = make_plan(model, mask, labels, groups=int(self.attention_groups),
                             packed_attention=cuda and bool(self.packed_attention))
        except Refusal as e:
            return _refused(model, str(e))
        notes = list(plan.notes)
        onnx_attention = rewrite(model, plan, packed_output=self.packed_output,
                                 sum_norm=not cuda and default_opset(model) >= 17,
                                 onnx_attention=resolve_attention_op(self.attention_op) == "onnx")
        if onnx_attention:
            model.opset_imports[""] = max(default_opset(model), ONNX_ATTENTION_OPSET)
            notes.append(f"{onnx_attention} length groups run ONNX Attention: opset raised to "
                         f"{model.opset_imports['']}")
        token_wise = plan.count(None)
        grouped = plan.count(AttentionStrategy.GROUPED)
        packed = plan.count(AttentionStrategy.PACKED)
        if packed:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            notes.append(f"{packed} attention op(s) run as com.microsoft PackedMultiHeadAttention, which ONNX "
                         "Runtime implements for CUDA only: the model runs on the CUDA provider, not on CPU")
        graph_io = {v.name for v in model.graph.inputs} | {v.name for v in model.graph.outputs}
        for name, value in list(model.graph.initializers.items()):
            if not value.uses() and name not in graph_io:  # e.g. a QKV weight now split in three
                model.graph.initializers.pop(name)
        counts = {"packed_ops": token_wise}
        if plan.pools:
            counts["first_token_pooling"] = plan.pools
        if grouped:
            counts["grouped_attention"] = grouped
        if onnx_attention:
            counts["onnx_attention"] = onnx_attention
        if packed:
            counts["packed_attention"] = packed
        for note in notes:
            logger.info("%s: %s", self.name, note)
        logger.info("remove-padding: %d ops run on packed tokens, %d attention ops grouped by length, "
                    "%d PackedMultiHeadAttention", token_wise, grouped, packed)
        return PassResult(model, True, notes=notes, rule_counts=counts)


#: ``attention_op`` values; ONNX's Attention op (with a CPU kernel in ORT >= 1.23) needs this opset
ATTENTION_OPS = ("mha", "onnx", "auto")
ONNX_ATTENTION_OPSET = 23
#: the first ONNX Runtime with a CPU kernel for ONNX Attention (opset 23)
ONNX_ATTENTION_ORT = "1.23.0"


def resolve_attention_op(attention_op: str, ort_version: str | None = None) -> str:
    """``auto`` -> ``onnx`` when ONNX Runtime (the installed one, or ``ort_version``) has ONNX Attention's
    CPU kernel, else ``mha``; ``mha`` / ``onnx`` unchanged."""
    if attention_op != "auto":
        return attention_op
    if ort_version is None:
        import onnxruntime

        ort_version = onnxruntime.__version__
    return "onnx" if ort_compat.version_key(ort_version) >= ort_compat.version_key(ONNX_ATTENTION_ORT) else "mha"


def _refused(model: ir.Model, reason: str) -> PassResult:
    note = f"not applied: {reason}"
    logger.info("%s: %s", RemovePaddingPass.name, note)
    return PassResult(model, False, notes=[note])


def _precondition_refusal(model: ir.Model, mask: ir.Value | None) -> str | None:
    """Why the graph cannot be packed at all (None: it may be; the planner decides)."""
    graph = model.graph
    if mask is None:
        return "no rank-2 attention mask input (attention_mask/input_mask/mask)"
    if any(isinstance(d, int) for d in mask.shape.dims):
        return (f"attention mask {mask.name!r} has a static shape {mask.shape} (batch and sequence must be "
                "dynamic to be told apart)")
    opset = default_opset(model)
    if opset < 15:
        return f"opset {opset} < 15 (Shape start/end needed)"
    if any(out.name == "packing_row_index" for node in graph for out in node.outputs):
        return "the graph is packed already (remove-padding ran on it)"
    if _has_subgraphs(graph):
        return "the graph has subgraphs (If/Loop/Scan)"
    return None


def _find_mask(graph: ir.Graph) -> ir.Value | None:
    inputs = [v for v in graph.inputs if v.name not in graph.initializers]
    for name in MASK_NAMES:
        for v in inputs:
            if v.name == name and v.shape is not None and len(v.shape) == 2:
                return v
    cands = [v for v in inputs if "mask" in v.name.lower() and v.shape is not None and len(v.shape) == 2]
    return cands[0] if len(cands) == 1 else None


def _has_subgraphs(graph: ir.Graph) -> bool:
    return any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for node in graph for a in node.attributes.values()
    )


register(RemovePaddingPass)

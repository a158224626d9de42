"""remove-padding: run every token-wise op of a transformer encoder on packed real tokens only.

Serving batches are mostly padding. This whole-graph rewrite computes the real-token positions from
the attention mask once (any padding side, any mask pattern: ``NonZero(Flatten(mask))``) and runs every
op that treats tokens independently (embeddings, projections, bias/residual adds, LayerNorms, GELU,
FFN, fused SkipLayerNormalization/BiasGelu/EmbedLayerNormalization) on packed ``[1, N+1, ...]`` tensors:
the ``N`` real tokens plus one scratch row (a copy of the first real token, see ``_packing.py``)::

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

With ``--provider cuda`` (``context.provider == "cuda"``), fused attention instead runs as
com.microsoft ``PackedMultiHeadAttention`` on the packed rows (no padding outside the op)::

    q, k, v [1,N+1,H] --Squeeze--> [N+1,H] --PackedMultiHeadAttention(bias, token_offset, cu)--> [N+1,Hv] --Unsqueeze-->
    cu [B+2]: [0, cumsum(real tokens per row ++ [1])]   token_offset [B+1, L]: see ``_packing.PackedAttentionIndex``

The op reads each row's real tokens as one right-padded sequence (the scratch row is a sequence of
its own), which is exact for any padding side or holes because a key padding mask does not care
where in the row the keys are. The op masks by sequence lengths only, so it is used only when the
attention op's mask is the attention mask input itself (through Cast/Identity) and there is no
attention bias; otherwise that op keeps the CPU formulation (length groups), with the reason in
``context.notes``. ONNX Runtime has no CPU kernel for the op: the pipeline verifies such a model on
CPU through a standard-op stand-in (``graphopt/standins.py``), and ``tools/cuda_checks.py`` checks
the CUDA kernel on a GPU. ``packed_attention=False`` keeps the CPU formulation on CUDA too.
ORT's CUDA kernel takes float and float16. In float32 its fused kernels (TensorRT, flash) are off
and memory-efficient attention starts at ``L >= 256``, so below that it runs the unfused kernel,
which re-pads Q/K/V inside the op to ``[B+1, L]`` by ``token_offset`` (``L``: the longest row).

Broadcast operands are packed the cheap way: a ``[1,S,H]`` or ``[S,H]`` position embedding by the
sequence index of each token, a ``[B,1,...]`` operand by its batch index, ``[H]`` biases as they are.

Which ops run packed is decided from dimension labels measured by running the model twice with
different batch/sequence sizes (``_packing.probe_labels``), so it works on TorchScript and dynamo
exports, eager or sdpa attention, unfused or fused, without matching a pattern. An op is packed when it
is token-wise (an allow-list, axis attributes checked), its outputs are ``[B,S,...]`` and an input is
packed already or hidden-state data (values computed from the mask alone stay as they are).

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

Refuses (model unchanged, reason in ``context.notes``) when: there is no rank-2 attention-mask input
or its batch/sequence dimensions are static; the graph is packed already; the opset is below 15; the graph has subgraphs (If/Loop/Scan); the model cannot be probed; nothing is
token-wise; a value leaving the packed region reaches an op that mixes positions outside attention
(e.g. mean pooling, a ReduceSum over the sequence, CLS pooling or a token shift by Gather/Slice/Concat
on data) or a graph output; or a Softmax there does not
depend on the mask / is not over the key axis. A fused attention op without a mask input, with past
state, causal, or with other mask layouts is not grouped (it then runs on the unpacked batch when the
checks above pass).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from graphopt.opsets import default_opset
from graphopt.registry import GraphoptPass, register

from ._packing import GroupIndex, PackedAttentionIndex, PackIndex, const_ints, probe_labels

logger = logging.getLogger(__name__)

_MASK_NAMES = ("attention_mask", "input_mask", "mask")
_MS = "com.microsoft"

#: standard ops whose output at a position depends only on the inputs at that position
_ELEMENTWISE = frozenset(
    "Add Sub Mul Div Pow Sqrt Erf Tanh Relu Sigmoid Gelu Cast Where Neg Reciprocal Exp Log Abs Identity "
    "Clip Max Min Equal Less Greater LessOrEqual GreaterOrEqual Not And Or Xor IsNaN IsInf Softplus "
    "Softsign HardSigmoid HardSwish LeakyRelu Elu Selu Mish Floor Ceil Round Sign Sin Cos Sum".split()
)
_MS_ELEMENTWISE = frozenset("BiasGelu FastGelu Gelu QuickGelu BiasAdd".split())
_REDUCE = frozenset("ReduceMean ReduceSum ReduceMax ReduceMin ReduceSumSquare ReduceL2".split())

#: ops allowed between an unpacked value and the point where it is packed again (the attention core)
_CORE_OPS = frozenset(
    "Reshape Transpose MatMul Mul Div Add Sub Softmax Where IsNaN Not Cast Slice Squeeze Unsqueeze Expand "
    "Concat Shape Gather Sqrt Identity Split Equal And Or Neg ConstantOfShape Range Constant Max Min Less "
    "Greater LessOrEqual GreaterOrEqual".split()
)
_MS_CORE_OPS = frozenset(("MultiHeadAttention", "Attention"))
#: core ops allowed on shape vectors only: on data they could move values between positions
#: (e.g. CLS pooling, a token shift), which is exact only where the padding is
_SELECTING = frozenset("Slice Gather Concat Split Expand".split())

_TOKEN = ("B", "S", "BS", "?")
#: additive bias of filler key slots in grouped attention (exp underflows to exactly 0)
_FILL = float(np.finfo(np.float32).min)


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


class _Refuse(Exception):
    pass


class _Planner:
    """Decides which nodes run packed, and checks the attention core (raises _Refuse)."""

    def __init__(self, model: ir.Model, mask: ir.Value, labels: dict, groups: int = 0, packed_attention: bool = False):
        self.groups = groups
        #: fused attention runs as com.microsoft PackedMultiHeadAttention where it is exact (CUDA)
        self.packed_attention = packed_attention
        #: attention ops left on the padded batch (attention_groups=0) that PackedMultiHeadAttention refused
        self.unpacked_attention: dict[int, tuple[ir.Node, str]] = {}
        self.model = model
        self.graph = model.graph
        self.mask = mask
        self.labels = labels
        self.packed_nodes: list[ir.Node] = []
        self.packed_values: set[int] = set()
        #: node -> output rank
        self.rank: dict[int, int] = {}
        self.hidden = self._forward_closure([v for v in self.graph.inputs if v is not mask], skip_shape=True)
        self.mask_derived = self._forward_closure([mask], skip_shape=False)

    def lab(self, v: ir.Value | None):
        if v is None:
            return None
        if v.const_value is not None and v.name not in self.labels:
            return tuple(int(d) for d in v.const_value.shape)
        return self.labels.get(v.name)

    def _forward_closure(self, roots, skip_shape: bool) -> set[int]:
        seen: set[int] = set()
        todo = list(roots)
        while todo:
            v = todo.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            for user, _ in v.uses():
                if skip_shape and user.op_type in ("Shape", "Size"):
                    continue
                todo.extend(o for o in user.outputs)
        return seen

    # ------------------------------------------------------------ classification

    def classify(self, v: ir.Value, rank: int):
        """How a non-packed operand of a rank-``rank`` token-wise op is packed: "free", a lead tuple, or None."""
        labs = self.lab(v)
        if labs is None:
            return None
        k = len(labs)
        if k <= rank - 2:
            return "free" if not any(d in _TOKEN for d in labs) else None
        if any(d in _TOKEN for d in labs[2 - (rank - k):]):
            return None
        if k == rank - 1:
            return "free" if labs[0] == 1 else ("S",) if labs[0] == "S" else None
        if k != rank:
            return None
        lead = (labs[0], labs[1])
        if lead == (1, 1):
            return "free"
        if lead in (("B", "S"), (1, "S"), ("B", 1)):
            return lead
        return None

    def _token_major(self, v: ir.Value) -> int | None:
        labs = self.lab(v)
        if labs is None or len(labs) < 2 or labs[:2] != ("B", "S"):
            return None
        if any(d in _TOKEN for d in labs[2:]):
            return None
        return len(labs)

    def spec(self, node: ir.Node) -> list[str] | None:
        """Per-input modes when ``node`` is token-wise by op type and attributes, else None.

        Modes: "bcast" (broadcast against the output rank: packed, or packed on entry, or left as is
        when it has no batch/sequence dims), "own" (a token input of its own rank), "param" (must have
        no batch/sequence dims), "skip" (left as is: masks of attention ops).
        """
        op, dom, n = node.op_type, node.domain or "", len(node.inputs)
        if dom == _MS and op == "EmbedLayerNormalization":
            return self._spec_embed(node)
        if dom == _MS and op in ("MultiHeadAttention", "Attention") and (self.groups > 0 or self.packed_attention):
            modes = self._spec_attention(node)
            if modes is not None and self.groups == 0:
                reason = self.packed_attention_refusal(node)
                if reason is not None:  # no length groups asked for: attention stays on the padded batch
                    self.unpacked_attention[id(node)] = (node, reason)
                    return None
            return modes
        outs = [o for o in node.outputs if o.name]
        if not outs:
            return None
        ranks = [self._token_major(o) for o in outs]
        if any(r is None for r in ranks) or len(set(ranks)) != 1:
            return None
        r = ranks[0]
        self.rank[id(node)] = r
        if dom in ("", "ai.onnx"):
            if op in _ELEMENTWISE:
                return ["bcast"] * n
            if op == "MatMul":
                w = self.lab(node.inputs[1])
                a = self.lab(node.inputs[0])
                if w is None or a is None or len(w) > 2 or len(a) != r:
                    return None
                return ["bcast", "param"]
            if op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
                if _norm_axis(_attr(node, "axis", -1), r) < 2:
                    return None
                return ["bcast"] + ["param"] * (n - 1)
            if op in ("Softmax", "LogSoftmax"):
                return ["bcast"] if _norm_axis(_attr(node, "axis", -1), r) >= 2 else None
            if op == "Gather":
                idx = self.lab(node.inputs[1])
                if _attr(node, "axis", 0) != 0 or idx is None or len(idx) < 2:
                    return None
                return ["param", "own"]
            if op == "Transpose":
                perm = _attr(node, "perm")
                return ["bcast"] if perm is not None and list(perm[:2]) == [0, 1] else None
            if op == "Concat":
                return ["bcast"] * n if _norm_axis(_attr(node, "axis"), r) >= 2 else None
            if op == "Split":
                return ["bcast"] + ["param"] * (n - 1) if _norm_axis(_attr(node, "axis", 0), r) >= 2 else None
            if op in _REDUCE:
                axes = _attr(node, "axes")
                if axes is None and n > 1 and node.inputs[1] is not None:
                    c = node.inputs[1].const_value
                    axes = None if c is None else [int(a) for a in c.numpy().reshape(-1)]
                ins_rank = len(self.lab(node.inputs[0]) or ())
                if not axes or ins_rank != r or any(_norm_axis(int(a), r) < 2 for a in axes):
                    return None
                return ["bcast"] + ["param"] * (n - 1)
            return None
        if dom == _MS:
            if op in _MS_ELEMENTWISE:
                return ["bcast"] * n
            if op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
                return ["bcast", "bcast"] + ["param"] * (n - 2)
        return None

    def _spec_embed(self, node: ir.Node) -> list[str] | None:
        """EmbedLayerNormalization: ids/segments/position ids are token inputs; runs as Gathers+LayerNorm."""
        outs = node.outputs
        if self._token_major(outs[0]) != 3:
            return None
        if len(outs) > 2 and outs[2].name and self._token_major(outs[2]) != 3:
            return None
        if len(outs) > 1 and outs[1].uses() and (len(node.inputs) < 8 or node.inputs[7] is None):
            return None  # mask_index is used but there is no mask to compute it from
        if _attr(node, "mask_index_type", 1) != 1 and len(outs) > 1 and outs[1].uses():
            return None
        self.rank[id(node)] = 3
        modes = ["own", "own", "param", "param", "param", "param", "param", "skip", "own"]
        return modes[: len(node.inputs)]

    def _spec_attention(self, node: ir.Node) -> list[str] | None:
        """Self-attention with a padding mask: runs on length-sorted compact groups (see GroupIndex)."""
        ins = list(node.inputs) + [None] * 10
        if self._token_major(node.outputs[0]) != 3 or any(o.uses() for o in node.outputs[1:]):
            return None
        if _attr(node, "unidirectional", 0) or _attr(node, "do_rotary", 0) or _attr(node, "past_present_share_buffer", 0):
            return None
        if node.op_type == "Attention":
            if self._token_major(ins[0]) != 3 or ins[4] is not None or any(x is not None for x in ins[6:]):
                return None
            w = self.lab(ins[1])
            if w is None or len(w) != 2 or not all(isinstance(d, int) for d in w):
                return None
            kpm, bias = ins[3], ins[5]
            modes = ["own", "param", "param", "skip", "skip", "skip"]
        else:
            if any(self._token_major(x) != 3 for x in ins[:3]) or any(x is not None for x in ins[6:]):
                return None
            if ins[3] is not None and len(self.lab(ins[3]) or ()) != 1:
                return None
            kpm, bias = ins[4], ins[5]
            modes = ["own", "own", "own", "param", "skip", "skip"]
        if kpm is None and bias is None:
            return None  # nothing masks the padded keys: real outputs depend on padding
        if kpm is not None and (self.lab(kpm) != ("B", "S") or id(kpm) not in self.mask_derived):
            return None
        if bias is not None:
            lab = self.lab(bias)
            if lab is None or len(lab) != 4 or lab[0] not in ("B", 1) or lab[1] != 1 or lab[2:] != ("S", "S"):
                return None
            if bias.dtype not in (None, ir.DataType.FLOAT) or id(bias) not in self.mask_derived:
                return None
        self.rank[id(node)] = 3
        return modes[: len(node.inputs)]

    def packed_attention_refusal(self, node: ir.Node) -> str | None:
        """Why a grouped attention op cannot be PackedMultiHeadAttention (None: it can, exactly).

        PackedMultiHeadAttention masks by sequence lengths alone, so it is exact only when the op's
        mask is the key padding mask of the real tokens (the attention mask input itself) and there
        is no other attention bias.
        """
        if not self.packed_attention:
            return "packed attention is off"
        ins = list(node.inputs) + [None] * 10
        if node.op_type == "Attention":
            kpm, bias = ins[3], ins[5]
            sizes = _attr(node, "qkv_hidden_sizes")
            if sizes and int(sizes[0]) != int(sizes[1]):
                return f"query and key widths differ ({int(sizes[0])} vs {int(sizes[1])})"
        else:
            kpm, bias = ins[4], ins[5]
            wq, wk = (self.lab(x) for x in ins[:2])
            if wq is None or wk is None or wq[2] != wk[2] or not isinstance(wq[2], int):
                return "query and key widths differ or are unknown"
        if bias is not None:
            return (f"it has an attention bias {bias.name!r} (PackedMultiHeadAttention masks by sequence "
                    "lengths only)")
        if kpm is None:
            return "it has no key padding mask"
        v = kpm
        while v is not self.mask:
            p = v.producer()
            if p is None or (p.domain or "") not in ("", "ai.onnx") or p.op_type not in ("Cast", "Identity"):
                return (f"its mask {kpm.name!r} is not the attention mask {self.mask.name!r} itself (through "
                        "Cast/Identity), so it may not be a plain key padding mask")
            v = p.inputs[0]
        if node.outputs[0].dtype not in (None, ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return f"its type {node.outputs[0].dtype} is neither float nor float16"
        return None

    # ------------------------------------------------------------ planning

    def plan(self) -> None:
        for node in self.graph:
            modes = self.spec(node)
            if modes is None:
                continue
            r = self.rank[id(node)]
            trigger = False
            ok = True
            for i, x in enumerate(node.inputs):
                if x is None:
                    continue
                mode = modes[i]
                if mode == "skip":
                    continue
                if id(x) in self.packed_values:
                    if mode == "param" or (mode == "bcast" and len(self.lab(x) or ()) != r):
                        ok = False
                        break
                    trigger = True
                    continue
                if mode == "param":
                    labs = self.lab(x)
                    if labs is None or any(d in _TOKEN for d in labs):
                        ok = False
                        break
                    continue
                cls = self.classify(x, r if mode == "bcast" else len(self.lab(x) or ()))
                if cls is None:
                    ok = False
                    break
                if cls == ("B", "S") and id(x) in self.hidden:  # hidden-state data (not the mask alone)
                    trigger = True
            if ok and trigger:
                self.packed_nodes.append(node)
                self.packed_values.update(id(o) for o in node.outputs if self._token_major(o) is not None)
        if not self.packed_nodes:
            raise _Refuse("no token-wise op on hidden states found")
        self._check_core()

    def _is_data(self, v: ir.Value) -> bool:
        """A tensor with batch/sequence-sized dims (not a shape vector or a scalar)."""
        labs = self.lab(v)
        return labs is None or (len(labs) >= 2 and any(d in _TOKEN for d in labs))

    def _check_core(self) -> None:
        packed_set = set(map(id, self.packed_nodes))
        outputs = set(map(id, self.graph.outputs))
        frontier: list[ir.Node] = []
        for node in self.packed_nodes:
            for o in node.outputs:
                for user, _ in o.uses():
                    if id(user) in packed_set or (user.op_type == "Shape" and not user.domain):
                        if user.op_type == "Shape" and id(user.outputs[0]) in outputs:
                            raise _Refuse("a Shape of a packed value is a graph output")
                        continue
                    frontier.append(user)
        seen: set[int] = set()
        softmaxes: list[ir.Node] = []
        attention: list[ir.Node] = []
        while frontier:
            node = frontier.pop()
            if id(node) in seen or id(node) in packed_set:
                continue
            seen.add(id(node))
            dom = node.domain or ""
            if dom in ("", "ai.onnx") and node.op_type in _CORE_OPS:
                if node.op_type == "Softmax":
                    softmaxes.append(node)
                if node.op_type in _SELECTING and any(self._is_data(o) for o in node.outputs):
                    raise _Refuse(f"{node.op_type} {node.name!r} selects or shifts positions of padded values")
            elif dom == _MS and node.op_type in _MS_CORE_OPS:
                attention.append(node)
            else:
                raise _Refuse(
                    f"{node.op_type} {node.name!r} mixes positions outside attention (reached from a packed value)"
                )
            for o in node.outputs:
                if id(o) in outputs:
                    raise _Refuse(f"graph output {o.name!r} is computed from padded values by {node.op_type} {node.name!r}")
                frontier.extend(u for u, _ in o.uses())
        if seen and not softmaxes and not attention:
            raise _Refuse("values leave the packed region but reach no attention softmax")
        for sm in softmaxes:
            if sm.inputs[0] is None or id(sm.inputs[0]) not in self.mask_derived:
                raise _Refuse(f"Softmax {sm.name!r} does not depend on the attention mask")
            rank = len(self.lab(sm.inputs[0]) or ())
            if _norm_axis(_attr(sm, "axis", -1), rank) != rank - 1:
                raise _Refuse(f"Softmax {sm.name!r} is not over the last (key) axis")
        for att in attention:
            mask_inputs = att.inputs[3:6] if att.op_type == "Attention" else att.inputs[4:6]
            if not any(m is not None and id(m) in self.mask_derived for m in mask_inputs):
                raise _Refuse(f"{att.op_type} {att.name!r} has no mask input derived from the attention mask")


def _dedupe_names(graph: ir.Graph) -> None:
    """Rename values whose name is taken by an earlier one (new values come last: they get the suffix).

    Graph inputs, initializers and graph outputs keep their names.
    """
    outputs = {id(v) for v in graph.outputs}
    seen = {v.name for v in graph.inputs} | set(graph.initializers) | {v.name for v in graph.outputs}
    for node in graph:
        for out in node.outputs:
            if not out.name or id(out) in outputs:
                continue
            if out.name in seen:
                k = 1
                while f"{out.name}_{k}" in seen:
                    k += 1
                out.name = f"{out.name}_{k}"
            seen.add(out.name)


def _find_mask(graph: ir.Graph) -> ir.Value | None:
    inputs = [v for v in graph.inputs if v.name not in graph.initializers]
    for name in _MASK_NAMES:
        for v in inputs:
            if v.name == name and v.shape is not None and len(v.shape) == 2:
                return v
    cands = [v for v in inputs if "mask" in v.name.lower() and v.shape is not None and len(v.shape) == 2]
    return cands[0] if len(cands) == 1 else None


def _has_subgraphs(graph: ir.Graph) -> bool:
    return any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for node in graph for a in node.attributes.values()
    )


def _emit_embed(tape: ir.tape.Tape, index: PackIndex, node: ir.Node, inputs: list, sum_norm: bool = False) -> list:
    """Packed EmbedLayerNormalization as Gathers + SkipLayerNormalization: [output, None, embedding_sum].

    With ``sum_norm`` (CPU) the norm is ``Sum`` + ``LayerNormalization`` instead.

    The last embedding term is the SkipLayerNormalization's skip input, so the packed graph stays
    fused. When the embedding sum (third output) is read, Add + LayerNormalization keep it explicit.
    """
    ids, seg, word, pos_table, seg_table, gamma, beta = (list(inputs) + [None] * 7)[:7]
    pos_ids = inputs[8] if len(inputs) > 8 and inputs[8] is not None else index.idx_s
    x = tape.op("Gather", [word, ids])
    skip = tape.op("Gather", [pos_table, pos_ids])
    if seg is not None and seg_table is not None:
        x, skip = tape.op("Add", [x, skip]), tape.op("Gather", [seg_table, seg])
    eps = float(_attr(node, "epsilon", 1e-12))
    sum_out = node.outputs[2] if len(node.outputs) > 2 else None
    if sum_out is not None and (sum_out.uses() or sum_out.is_graph_output()):
        total = tape.op("Add", [x, skip])
        out = tape.op("LayerNormalization", [total, gamma, beta], {"axis": -1, "epsilon": eps})
    elif sum_norm:
        total = None
        out = tape.op("LayerNormalization", [tape.op("Sum", [x, skip]), gamma, beta], {"axis": -1, "epsilon": eps})
    else:
        total = None
        out = tape.op("SkipLayerNormalization", [x, skip, gamma, beta], {"epsilon": eps}, domain=_MS)
    outs: list = [out, None, total]
    return outs[: len(node.outputs)]


def _mask_index(tape: ir.tape.Tape, node: ir.Node) -> ir.Value:
    """mask_index (mask_index_type 1) of an EmbedLayerNormalization: real tokens per row, int32."""
    mask = tape.op("Cast", [node.inputs[7]], {"to": ir.DataType.INT32})
    return tape.op("ReduceSum", [mask, const_ints(tape, [1])], {"keepdims": 0})


def _splittable_attention(node: ir.Node, plan: _Planner) -> bool:
    """A com.microsoft Attention that becomes packed MatMul + MultiHeadAttention on unpacked Q/K/V."""
    if node.domain != _MS or node.op_type != "Attention":
        return False
    ins = list(node.inputs) + [None] * 7
    w = plan.lab(ins[1])
    if w is None or len(w) != 2 or not all(isinstance(d, int) for d in w):
        return False
    if ins[4] is not None or ins[6] is not None:  # past state
        return False
    if _attr(node, "unidirectional", 0) or _attr(node, "do_rotary", 0) or _attr(node, "past_present_share_buffer", 0):
        return False
    if len(node.outputs) > 1 and any(o.uses() for o in node.outputs[1:]):
        return False
    mask = ins[3]
    if mask is not None and len(plan.lab(mask) or ()) not in (1, 2):
        return False  # 3-D/4-D masks have no MultiHeadAttention key_padding_mask form
    return True


def _emit_split_attention(
    tape: ir.tape.Tape, index: PackIndex, node: ir.Node, packed_x: ir.Value, plan: _Planner
) -> ir.Value:
    """Attention(x, W, b, mask, -, bias) -> MHA(unpack(q), unpack(k), unpack(v), mask, bias) with a packed QKV MatMul."""
    ins = list(node.inputs) + [None] * 7
    weights, bias, mask, attn_bias = ins[1], ins[2], ins[3], ins[5]
    width = int(plan.lab(weights)[1])
    sizes = _attr(node, "qkv_hidden_sizes")
    sizes = [int(x) for x in sizes] if sizes else [width // 3] * 3
    qkv = tape.op("MatMul", [packed_x, weights])
    if bias is not None:
        qkv = tape.op("Add", [qkv, bias])
    q, k, v = tape.op_multi_out("Split", [qkv, const_ints(tape, sizes)], {"axis": -1}, num_outputs=3)
    attrs: dict = {"num_heads": int(_attr(node, "num_heads"))}
    for name in ("scale", "mask_filter_value"):
        if _attr(node, name) is not None:
            attrs[name] = float(_attr(node, name))
    mha_inputs = [index.unpack(q, 3), index.unpack(k, 3), index.unpack(v, 3), None, mask, attn_bias]
    while mha_inputs[-1] is None:
        mha_inputs.pop()
    out = tape.op("MultiHeadAttention", mha_inputs, attrs, domain=_MS)
    out.name = f"{node.outputs[0].name}_mha"
    return out


def _slice_initializer(graph: ir.Graph, weights: ir.Value, part: str, array: np.ndarray) -> ir.Value:
    """A new initializer holding ``array`` (a column slice of ``weights``), with a unique name."""
    base = f"{weights.name}_{part}"
    name, i = base, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(weights.dtype),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _packed_qkv(tape: ir.tape.Tape, node: ir.Node, ins: list, plan: _Planner) -> tuple:
    """Packed (q, k, v, projection bias, key padding mask, attention bias) of a grouped attention op."""
    if node.op_type == "Attention":
        weights, bias = ins[1], ins[2]
        width = int(plan.lab(weights)[1])
        sizes = _attr(node, "qkv_hidden_sizes")
        sizes = [int(x) for x in sizes] if sizes else [width // 3] * 3
        # three MatMuls on column slices of the weights (folded by ORT) instead of MatMul + Split copies;
        # the projection bias goes to MultiHeadAttention, which adds it while it re-lays Q/K/V
        # constant weights are split into three initializers, so later passes (quantize) see plain
        # MatMul(x, W) with a constant W
        projections = []
        w_all = weights.const_value.numpy() if weights.const_value is not None else None
        for i, (lo, hi) in enumerate(((0, sizes[0]), (sizes[0], sizes[0] + sizes[1]),
                                      (sizes[0] + sizes[1], sum(sizes)))):
            if w_all is not None:
                w = _slice_initializer(plan.model.graph, weights, "qkv"[i], np.ascontiguousarray(w_all[:, lo:hi]))
            else:
                w = tape.op("Slice", [weights, const_ints(tape, [lo]), const_ints(tape, [hi]), const_ints(tape, [1])])
            projections.append(tape.op("MatMul", [ins[0], w]))
        q, k, v = projections
        return q, k, v, bias, ins[3], ins[5]
    return ins[0], ins[1], ins[2], ins[3], ins[4], ins[5]


def _attention_attrs(node: ir.Node, names=("scale", "mask_filter_value")) -> dict:
    attrs: dict = {"num_heads": int(_attr(node, "num_heads"))}
    for name in names:
        if _attr(node, name) is not None:
            attrs[name] = float(_attr(node, name))
    return attrs


def _emit_packed_attention(
    tape: ir.tape.Tape, pidx: PackedAttentionIndex, node: ir.Node, inputs: list, plan: _Planner
) -> ir.Value:
    """PackedMultiHeadAttention on the packed rows ``[N+1, H]``; returns the packed ``[1, N+1, Hv]`` context."""
    q, k, v, bias, _, _ = _packed_qkv(tape, node, list(inputs) + [None] * 10, plan)
    rows = [tape.op("Squeeze", [x, const_ints(tape, [0])]) for x in (q, k, v)]
    out = tape.op("PackedMultiHeadAttention", [*rows, bias, pidx.token_offset, pidx.cumulative_sequence_length],
                  _attention_attrs(node, ("scale",)), domain=_MS)
    out.name = f"{node.outputs[0].name}_packed_mha"
    return tape.op("Unsqueeze", [out, const_ints(tape, [0])])


def _emit_grouped_attention(
    tape: ir.tape.Tape, groups: GroupIndex, node: ir.Node, inputs: list, plan: _Planner
) -> ir.Value:
    """MultiHeadAttention per length group on packed Q/K/V; returns the packed ``[1, N, Hv]`` context."""
    ins = list(inputs) + [None] * 10
    attrs = _attention_attrs(node)
    q, k, v, bias, kpm, attn_bias = _packed_qkv(tape, node, ins, plan)
    hv = plan.lab(node.outputs[0])[2]
    lead_batch = attn_bias is not None and plan.lab(attn_bias)[0] == "B"
    parts = []
    for g in range(groups.groups):
        g_ins = [groups.gather(q, g), groups.gather(k, g), groups.gather(v, g), bias,
                 groups.key_mask(kpm, g) if kpm is not None else None,
                 groups.attention_bias(attn_bias, lead_batch, g, _FILL) if attn_bias is not None else None]
        if kpm is None and attn_bias is None:
            raise AssertionError("planner admits only masked attention")
        while g_ins[-1] is None:
            g_ins.pop()
        out = tape.op("MultiHeadAttention", g_ins, attrs, domain=_MS)
        parts.append(tape.op("Reshape", [out, const_ints(tape, [-1, int(hv)])]))
    flat = tape.op("Concat", parts, {"axis": 0}) if len(parts) > 1 else parts[0]
    return tape.op("Gather", [flat, groups.inverse], {"axis": 0})


class RemovePadding(GraphoptPass):
    """Run token-wise ops on packed real tokens; only attention sees padding (exact on real tokens)."""

    name = "remove-padding"
    exact = True
    run_after = ("fuse",)
    emits = ("com.microsoft::MultiHeadAttention", "com.microsoft::PackedMultiHeadAttention")

    def __init__(self, *, packed_output: bool = False, attention_groups: int = 8, packed_attention: bool = True):
        super().__init__()
        #: output ``[N, hidden]`` (real tokens, row-major) instead of ``[B, S, hidden]`` with zero padding
        self.packed_output = packed_output
        #: fused attention (com.microsoft MultiHeadAttention/Attention) runs on this many length-sorted
        #: groups of rows, each padded only to its own longest row; 0 keeps it on the padded batch
        self.attention_groups = attention_groups
        #: with provider cuda, fused attention runs as com.microsoft PackedMultiHeadAttention (no padding
        #: at all) where that is exact; False keeps the length groups of MultiHeadAttention
        self.packed_attention = packed_attention

    def _note(self, text: str) -> None:
        logger.info("%s: %s", self.name, text)
        self.context.notes.append(text)  # the report prefixes the pass name

    def _refuse(self, model: ir.Model, reason: str) -> ir.passes.PassResult:
        self._note(f"not applied: {reason}")
        return ir.passes.PassResult(model, modified=False)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        mask = _find_mask(graph)
        if mask is None:
            return self._refuse(model, "no rank-2 attention mask input (attention_mask/input_mask/mask)")
        if any(isinstance(d, int) for d in mask.shape.dims):
            return self._refuse(model, f"attention mask {mask.name!r} has a static shape {mask.shape} (batch and "
                                       "sequence must be dynamic to be told apart)")
        opset = default_opset(model)
        if opset < 15:
            return self._refuse(model, f"opset {opset} < 15 (Shape start/end needed)")
        if any(out.name == "packing_row_index" for node in graph for out in node.outputs):
            return self._refuse(model, "the graph is packed already (remove-padding ran on it)")
        if _has_subgraphs(graph):
            return self._refuse(model, "the graph has subgraphs (If/Loop/Scan)")
        try:
            labels = probe_labels(model, mask)
        except Exception as e:  # the model cannot run on probe feeds: nothing can be proven
            return self._refuse(model, f"cannot probe dimensions ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        cuda = self.context.provider == "cuda"
        planner = _Planner(model, mask, labels, groups=max(0, int(self.attention_groups)),
                           packed_attention=cuda and bool(self.packed_attention))
        try:
            planner.plan()
        except _Refuse as e:
            return self._refuse(model, str(e))
        attention = [n for n in planner.packed_nodes if n.domain == _MS and n.op_type in ("MultiHeadAttention", "Attention")]
        packed_attention: set[int] = set()
        if planner.packed_attention:
            for node in attention:
                reason = planner.packed_attention_refusal(node)
                if reason is None:
                    packed_attention.add(id(node))
                else:
                    self._note(f"{node.op_type} {node.name or node.outputs[0].name!r} runs as MultiHeadAttention per "
                               f"length group, not PackedMultiHeadAttention: {reason}")
            for node, reason in planner.unpacked_attention.values():
                self._note(f"{node.op_type} {node.name or node.outputs[0].name!r} stays on the padded batch "
                           f"(attention_groups=0), not PackedMultiHeadAttention: {reason}")
        self._rewrite(model, planner, packed_attention)
        if packed_attention:
            model.opset_imports.setdefault(_MS, 1)
            self._note(f"{len(packed_attention)} attention op(s) run as com.microsoft PackedMultiHeadAttention, "
                       "which ONNX Runtime implements for CUDA only: the model runs on the CUDA provider, not on CPU")
        graph_io = {v.name for v in model.graph.inputs} | {v.name for v in model.graph.outputs}
        for name, value in list(model.graph.initializers.items()):
            if not value.uses() and name not in graph_io:  # e.g. a QKV weight now split in three
                model.graph.initializers.pop(name)
        grouped = len(attention) - len(packed_attention)
        self.context.rule_counts["packed_ops"] = len(planner.packed_nodes) - len(attention)
        if grouped:
            self.context.rule_counts["grouped_attention"] = grouped
        if packed_attention:
            self.context.rule_counts["packed_attention"] = len(packed_attention)
        logger.info("remove-padding: %d ops run on packed tokens, %d attention ops grouped by length, "
                    "%d PackedMultiHeadAttention", len(planner.packed_nodes) - len(attention), grouped,
                    len(packed_attention))
        return ir.passes.PassResult(model, modified=True)

    # ------------------------------------------------------------ rewrite

    def _rewrite(self, model: ir.Model, plan: _Planner, packed_attention: set[int]) -> None:
        graph = model.graph
        tape = ir.tape.Tape()
        index = PackIndex(tape, plan.mask)
        groups: GroupIndex | None = None
        pidx: PackedAttentionIndex | None = None
        twin: dict[int, ir.Value] = {}
        new_nodes: list[ir.Node] = []
        for node in plan.packed_nodes:
            modes = plan.spec(node)
            assert modes is not None
            r = plan.rank[id(node)]
            inputs: list[ir.Value | None] = []
            for i, x in enumerate(node.inputs):
                if x is None or modes[i] in ("param", "skip"):
                    inputs.append(x)
                elif id(x) in twin:
                    inputs.append(twin[id(x)])
                else:
                    cls = plan.classify(x, r if modes[i] == "bcast" else len(plan.lab(x) or ()))
                    inputs.append(x if cls == "free" else index.pack(x, cls, r))
            if node.domain == _MS and node.op_type == "EmbedLayerNormalization":
                # CPU: Sum + LayerNormalization, as `fuse` ends residual norms there (the CPU
                # SkipLayerNormalization kernel is the slow one; see rewrites/fuse_residual_norm.py)
                outs = _emit_embed(tape, index, node, inputs,
                                   sum_norm=self.context.provider != "cuda" and default_opset(model) >= 17)
            elif node.domain == _MS and node.op_type in ("MultiHeadAttention", "Attention"):
                if id(node) in packed_attention:
                    if pidx is None:
                        pidx = PackedAttentionIndex(tape, index)
                    outs = [_emit_packed_attention(tape, pidx, node, inputs, plan)]
                else:
                    if groups is None:
                        groups = GroupIndex(tape, index, plan.groups)
                    outs = [_emit_grouped_attention(tape, groups, node, inputs, plan)]
            else:
                new = ir.Node(
                    node.domain,
                    node.op_type,
                    inputs,
                    attributes=list(node.attributes.values()),
                    num_outputs=len(node.outputs),
                    version=node.version,
                    name=f"{node.name}_packed" if node.name else None,
                )
                new_nodes.append(new)
                outs = list(new.outputs)
            for old_out, new_out in zip(node.outputs, outs):
                if new_out is None:
                    continue
                if old_out.name:
                    new_out.name = f"{old_out.name}_packed"
                new_out.type = old_out.type
                twin[id(old_out)] = new_out
        removed: list[ir.Node] = list(plan.packed_nodes)
        packed_set = set(map(id, plan.packed_nodes))
        for node in plan.packed_nodes:
            for out in node.outputs:
                unpacked = None
                rank = len(plan.lab(out) or ())
                for user, idx in list(out.uses()):
                    if id(user) in packed_set:
                        continue
                    if id(out) not in twin:  # EmbedLayerNormalization's mask_index
                        user.replace_input_with(idx, _mask_index(tape, node))
                        continue
                    if idx == 0 and _splittable_attention(user, plan):
                        mha = _emit_split_attention(tape, index, user, twin[id(out)], plan)
                        user.outputs[0].replace_all_uses_with(mha)
                        removed.append(user)
                        continue
                    if user.op_type == "Shape" and not user.domain:
                        shape = index.padded_shape(twin[id(out)])
                        start, end = _attr(user, "start"), _attr(user, "end")
                        if start is not None or end is not None:
                            s = const_ints(tape, [start or 0])
                            e = const_ints(tape, [end if end is not None else rank])
                            shape = tape.op("Slice", [shape, s, e])
                        user.outputs[0].replace_all_uses_with(shape)
                        removed.append(user)
                        continue
                    if unpacked is None:
                        unpacked = index.unpack(twin[id(out)], rank, name=f"{out.name}_unpacked")
                    user.replace_input_with(idx, unpacked)
        for i, out in enumerate(list(graph.outputs)):
            if id(out) not in twin:
                continue
            p = twin[id(out)]
            rank = len(plan.lab(out))
            name, out.name = out.name, f"{out.name}_padded"
            if self.packed_output:
                final = index.real_rows(p)
                rest = list(out.shape.dims[2:]) if out.shape is not None else [None] * (rank - 2)
                final.shape = ir.Shape(["total_tokens", *rest])
            else:
                final = index.unpack_zeros(p, rank, out.dtype)
                final.shape = out.shape
            final.type = out.type
            final.name = name
            graph.outputs[i] = final
        graph.extend(list(tape.nodes) + new_nodes)
        graph.remove(removed, safe=True)
        _dedupe_names(graph)
        graph.sort()


register(RemovePadding)

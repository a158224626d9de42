"""The rewrite of ``remove-padding``: builds the packed graph a ``Plan`` describes.

Each planned step becomes its packed twin (a copy of the op on packed inputs, or for fused ops a
packed formulation: EmbedLayerNormalization as Gathers + norm, attention as PackedMultiHeadAttention
or MultiHeadAttention per length group, a Reshape between ``[B, S, ...]`` and flattened ``[B*S, ...]``
rows as a Reshape of the packed rows). A first-token pooling becomes a Gather of each sequence's
first packed row, which takes over the pooled value. Readers of a packed value outside the plan get its unpacked
form, a padded ``Shape``, or (an unfused-by-design Attention) a packed QKV projection with
MultiHeadAttention on the unpacked Q/K/V. Graph outputs are unpacked with zeros at padded positions,
or returned as real-token rows.

Every node that re-emits a planned node (its twin, the packed attention and its projections, the
embedding Gathers and norm) inherits that node's provenance (``graphopt.engine.provenance.inherit``), so a
fused op keeps the pass that made it: ``fuse → remove-padding``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.engine import provenance
from graphopt.runtime.contrib import (
    MS_DOMAIN,
    attention_attributes,
    attention_input_list,
    attention_inputs,
    embed_inputs,
)

from .index import GroupIndex, PackedAttentionIndex, PackIndex, const_ints
from .plan import AttentionStrategy, Plan, Step, splittable_attention
from .probe import Dim
from .tokenwise import Mode

#: additive bias of filler key slots in grouped attention (exp underflows to exactly 0)
_FILL = float(np.finfo(np.float32).min)


def rewrite(model: ir.Model, plan: Plan, *, packed_output: bool, sum_norm: bool, onnx_attention: bool = False) -> int:
    """Rewrite ``model`` in place as ``plan`` says; returns how many ONNX ``Attention`` (opset 23) it emitted.

    ``packed_output``: graph outputs are ``[N, ...]`` real-token rows instead of ``[B, S, ...]``;
    ``sum_norm``: a packed EmbedLayerNormalization ends in Sum + LayerNormalization (the CPU form);
    ``onnx_attention``: length groups with a key padding mask (no attention bias) run ONNX ``Attention``
    (the projection bias added after each Q/K/V MatMul, a bool ``[B_g, 1, L_g, L_g]`` mask per group)
    instead of com.microsoft MultiHeadAttention; the caller raises the model's opset to 23.
    """
    graph = model.graph
    tape = ir.tape.Tape()
    index = PackIndex(tape, plan.mask)
    attention = _Attention(tape, index, plan, graph, onnx_attention=onnx_attention)
    twin: dict[int, ir.Value] = {}
    new_nodes: list[ir.Node] = []
    for step in plan.steps:
        node = step.node
        if step.pool:
            _emit_pool(tape, index, step, twin[id(node.inputs[0])], plan)
            continue
        inputs = _packed_inputs(step, index, twin)
        if node.domain == MS_DOMAIN and node.op_type == "EmbedLayerNormalization":
            outs = _emit_embed(tape, index, node, inputs, sum_norm=sum_norm)
        elif step.attention is not None:
            outs = [attention.emit(step, inputs)]
        elif not node.domain and node.op_type == "Reshape":
            outs = [_emit_reshape(tape, step, inputs[0], plan)]
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
            provenance.inherit(new, node)
            new_nodes.append(new)
            outs = list(new.outputs)
        for old_out, new_out in zip(node.outputs, outs):
            if new_out is None:
                continue
            if old_out.name:
                new_out.name = f"{old_out.name}_packed"
            new_out.type = old_out.type
            twin[id(old_out)] = new_out
    removed = [s.node for s in plan.steps] + _reconnect_readers(tape, index, plan, twin)
    _replace_graph_outputs(graph, index, plan, twin, packed_output)
    graph.extend(list(tape.nodes) + new_nodes)
    graph.remove(removed, safe=True)
    _dedupe_names(graph)
    graph.sort()
    return attention.onnx_emitted


def _packed_inputs(step: Step, index: PackIndex, twin: dict[int, ir.Value]) -> list[ir.Value | None]:
    inputs: list[ir.Value | None] = []
    for x, mode, lead in zip(step.node.inputs, step.modes, step.entries):
        if x is None or mode in (Mode.PARAM, Mode.SKIP):
            inputs.append(x)
        elif id(x) in twin:
            inputs.append(twin[id(x)])
        else:
            inputs.append(x if lead is None else index.pack(x, lead))
    return inputs


def _reconnect_readers(tape: ir.tape.Tape, index: PackIndex, plan: Plan, twin: dict[int, ir.Value]) -> list[ir.Node]:
    """Readers outside the plan read the unpacked (or reshaped) form; returns the nodes they replace."""
    removed: list[ir.Node] = []
    packed_set = {id(s.node) for s in plan.steps}
    for step in plan.steps:
        flat = step.lead == 1
        for out in step.node.outputs:
            unpacked = None
            rank = plan.labels.rank(out)
            for user, idx in list(out.uses()):
                if id(user) in packed_set:
                    continue
                if id(out) not in twin:  # EmbedLayerNormalization's mask_index
                    user.replace_input_with(idx, _mask_index(tape, step.node))
                    continue
                if idx == 0 and not flat and splittable_attention(user, plan.labels):
                    mha = _emit_split_attention(tape, index, user, twin[id(out)], plan)
                    user.outputs[0].replace_all_uses_with(mha)
                    removed.append(user)
                    continue
                if user.op_type == "Shape" and not user.domain:
                    shape = index.padded_shape(twin[id(out)], flat=flat)
                    start, end = user.attributes.get_int("start"), user.attributes.get_int("end")
                    if start is not None or end is not None:
                        s = const_ints(tape, [start or 0])
                        e = const_ints(tape, [end if end is not None else rank])
                        shape = tape.op("Slice", [shape, s, e])
                    user.outputs[0].replace_all_uses_with(shape)
                    removed.append(user)
                    continue
                if unpacked is None:
                    unpacked = index.unpack(twin[id(out)], name=f"{out.name}_unpacked", flat=flat)
                user.replace_input_with(idx, unpacked)
    return removed


def _replace_graph_outputs(graph: ir.Graph, index: PackIndex, plan: Plan, twin: dict[int, ir.Value],
                           packed_output: bool) -> None:
    leads = {id(o): s.lead for s in plan.steps for o in s.node.outputs}
    for i, out in enumerate(list(graph.outputs)):
        if id(out) not in twin:
            continue
        p = twin[id(out)]
        rank, lead = plan.labels.rank(out), leads[id(out)]
        name, out.name = out.name, f"{out.name}_padded"
        if packed_output:
            final = index.real_rows(p, flat=lead == 1)
            rest = list(out.shape.dims[lead:]) if out.shape is not None else [None] * (rank - lead)
            final.shape = ir.Shape(["total_tokens", *rest])
        else:
            final = index.unpack_zeros(p, rank, out.dtype, flat=lead == 1)
            final.shape = out.shape
        final.type = out.type
        final.name = name
        graph.outputs[i] = final


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


def _emit_reshape(tape: ir.tape.Tape, step: Step, packed: ir.Value, plan: Plan) -> ir.Value:
    """A Reshape that merges, splits or keeps the token dims, on packed rows: ``[1, N+1, *rest] <-> [N+1, *rest]``."""
    node = step.node
    rest = [int(d) for d in plan.labels(node.outputs[0])[step.lead:]]
    out = tape.op("Reshape", [packed, const_ints(tape, ([1, -1] if step.lead == 2 else [-1]) + rest)])
    provenance.inherit(out.producer(), node)
    return out


def _emit_pool(tape: ir.tape.Tape, index: PackIndex, step: Step, packed: ir.Value, plan: Plan) -> None:
    """First-token pooling read from the packed rows: row ``b`` is sequence ``b``'s first real token.

    ``Gather(x, 0, axis=1)`` gives ``[B, *rest]``; a ``Slice`` of ``[0:1]`` (or a ``Gather`` of ``[0]``)
    keeps the axis, ``[B, 1, *rest]``. The pooled value takes over the node's output (its readers and
    a graph output alike, under the same name).
    """
    starts = index.row_starts  # shared by every pooling: made before this one's nodes
    node, start = step.node, len(tape.nodes)
    rows = tape.op("Squeeze", [packed, const_ints(tape, [0])])  # [N + 1, *rest]
    pooled = tape.op("Gather", [rows, starts], {"axis": 0})  # [B, *rest]
    if step.rank == plan.labels.rank(node.inputs[0]):
        pooled = tape.op("Unsqueeze", [pooled, const_ints(tape, [1])])
    _inherit_since(tape, start, node)
    old = node.outputs[0]
    pooled.type, pooled.shape = old.type, old.shape
    name = old.name
    if old.is_graph_output():
        old.name = f"{name}_unpooled"
        pooled.name = name
    else:
        pooled.name = f"{name}_pooled" if name else None
    old.replace_all_uses_with(pooled, replace_graph_outputs=True)


# ------------------------------------------------------------------ embeddings

def _emit_embed(tape: ir.tape.Tape, index: PackIndex, node: ir.Node, inputs: list, sum_norm: bool = False) -> list:
    """Packed EmbedLayerNormalization as Gathers + SkipLayerNormalization: [output, None, embedding_sum].

    With ``sum_norm`` (CPU) the norm is ``Sum`` + ``LayerNormalization`` instead.

    The last embedding term is the SkipLayerNormalization's skip input, so the packed graph stays
    fused. When the embedding sum (third output) is read, Add + LayerNormalization keep it explicit.
    ``inputs`` are the node's inputs as the packed op reads them (ids, segments, positions packed).
    """
    start = len(tape.nodes)
    e = embed_inputs(node, inputs)
    pos_ids = e.position_ids if e.position_ids is not None else index.idx_s
    x = tape.op("Gather", [e.word_embedding, e.input_ids])
    skip = tape.op("Gather", [e.position_embedding, pos_ids])
    if e.segment_ids is not None and e.segment_embedding is not None:
        x, skip = tape.op("Add", [x, skip]), tape.op("Gather", [e.segment_embedding, e.segment_ids])
    eps = node.attributes.get_float("epsilon", 1e-12)
    norm_inputs = [e.gamma, e.beta]
    sum_out = node.outputs[2] if len(node.outputs) > 2 else None
    if sum_out is not None and (sum_out.uses() or sum_out.is_graph_output()):
        total = tape.op("Add", [x, skip])
        out = tape.op("LayerNormalization", [total, *norm_inputs], {"axis": -1, "epsilon": eps})
    elif sum_norm:
        total = None
        out = tape.op("LayerNormalization", [tape.op("Sum", [x, skip]), *norm_inputs], {"axis": -1, "epsilon": eps})
    else:
        total = None
        out = tape.op("SkipLayerNormalization", [x, skip, *norm_inputs], {"epsilon": eps}, domain=MS_DOMAIN)
    _inherit_since(tape, start, node)
    outs: list = [out, None, total]
    return outs[: len(node.outputs)]


def _inherit_since(tape: ir.tape.Tape, start: int, old: ir.Node) -> None:
    """The nodes recorded on ``tape`` from position ``start`` on rebuild ``old`` (provenance)."""
    for n in tape.nodes[start:]:
        provenance.inherit(n, old)


def _mask_index(tape: ir.tape.Tape, node: ir.Node) -> ir.Value:
    """mask_index (mask_index_type 1) of an EmbedLayerNormalization: real tokens per row, int32."""
    mask = tape.op("Cast", [embed_inputs(node).mask], {"to": ir.DataType.INT32})
    return tape.op("ReduceSum", [mask, const_ints(tape, [1])], {"keepdims": 0})


# ------------------------------------------------------------------ attention

class _Attention:
    """Emits fused attention on packed tokens; the group / packed-attention indexes are built on first use."""

    def __init__(self, tape: ir.tape.Tape, index: PackIndex, plan: Plan, graph: ir.Graph, *,
                 onnx_attention: bool = False):
        self.tape, self.index, self.plan, self.graph = tape, index, plan, graph
        self._groups: GroupIndex | None = None
        self._packed: PackedAttentionIndex | None = None
        self.onnx_attention = onnx_attention
        self.onnx_emitted = 0
        self._bool_masks: dict[tuple[int, int], ir.Value] = {}

    def emit(self, step: Step, inputs: list[ir.Value | None]) -> ir.Value:
        """The packed ``[1, N+1, Hv]`` context of a planned attention step."""
        node, t = step.node, self.tape
        attrs = attention_attributes(node)
        if step.attention is AttentionStrategy.PACKED:
            if self._packed is None:
                self._packed = PackedAttentionIndex(t, self.index)
            q, k, v, bias, _, _ = self._packed_qkv(node, inputs)
            rows = [t.op("Squeeze", [x, const_ints(t, [0])]) for x in (q, k, v)]
            ins = attention_input_list("PackedMultiHeadAttention", query=rows[0], key=rows[1], value=rows[2],
                                       bias=bias, token_offset=self._packed.token_offset,
                                       cumulative_sequence_length=self._packed.cumulative_sequence_length)
            out = t.op("PackedMultiHeadAttention", ins, attrs.for_mha("scale"), domain=MS_DOMAIN)
            provenance.inherit(out.producer(), node)
            out.name = f"{node.outputs[0].name}_packed_mha"
            return t.op("Unsqueeze", [out, const_ints(t, [0])])
        if self._groups is None:
            self._groups = GroupIndex(t, self.index, self.plan.groups, nonempty=self.onnx_attention)
        groups = self._groups
        q, k, v, bias, kpm, attn_bias = self._packed_qkv(node, inputs)
        if kpm is None and attn_bias is None:
            raise AssertionError("the plan admits only masked attention")
        hv = self.plan.labels(node.outputs[0])[2]
        lead_batch = attn_bias is not None and self.plan.labels(attn_bias)[0] == Dim.B
        if self.onnx_attention and kpm is not None and attn_bias is None and attrs.stateless_bidirectional:
            return self._onnx_groups(node, attrs, q, k, v, bias, kpm, int(hv))
        parts = []
        for g in range(groups.groups):
            ins = attention_input_list(
                "MultiHeadAttention", query=groups.gather(q, g), key=groups.gather(k, g),
                value=groups.gather(v, g), bias=bias,
                key_padding_mask=groups.key_mask(kpm, g) if kpm is not None else None,
                attention_bias=groups.attention_bias(attn_bias, lead_batch, g, _FILL) if attn_bias is not None else None)
            out = t.op("MultiHeadAttention", ins, attrs.for_mha("scale", "mask_filter_value"), domain=MS_DOMAIN)
            provenance.inherit(out.producer(), node)
            parts.append(t.op("Reshape", [out, const_ints(t, [-1, int(hv)])]))
        flat = t.op("Concat", parts, {"axis": 0}) if len(parts) > 1 else parts[0]
        return t.op("Gather", [flat, groups.inverse], {"axis": 0})

    def _onnx_groups(self, node: ir.Node, attrs, q, k, v, bias, kpm, hv: int) -> ir.Value:
        """The length groups as ONNX ``Attention`` (opset 23): ~30% faster than com.microsoft
        MultiHeadAttention on ORT 1.32's CPU at MiniLM's group shapes, the same numbers. The projection
        bias is added to the packed Q/K/V (``quantize`` folds those Adds into its integer ops)."""
        t, groups = self.tape, self._groups
        if bias is not None:
            sizes = attrs.qkv_sizes(int(self.plan.labels(bias)[0]))
            b_all = bias.const_value.numpy() if bias.const_value is not None else None
            starts = (0, sizes[0], sizes[0] + sizes[1])
            added = []
            for i, (x, lo) in enumerate(zip((q, k, v), starts)):
                hi = lo + sizes[i]
                if b_all is not None:
                    b = _slice_initializer(self.graph, bias, f"bias_{'qkv'[i]}", np.ascontiguousarray(b_all[lo:hi]))
                else:
                    b = t.op("Slice", [bias, const_ints(t, [lo]), const_ints(t, [hi]), const_ints(t, [0])])
                added.append(t.op("Add", [x, b]))
                provenance.inherit(added[-1].producer(), node)
            q, k, v = added
        kw: dict[str, int | float] = {"q_num_heads": int(attrs.num_heads), "kv_num_heads": int(attrs.num_heads)}
        if attrs.scale is not None:
            kw["scale"] = float(attrs.scale)
        parts = []
        for g in range(groups.groups):
            out = t.op("Attention", [groups.gather(q, g), groups.gather(k, g), groups.gather(v, g),
                                     self._bool_mask(kpm, g)], kw)
            provenance.inherit(out.producer(), node)
            parts.append(t.op("Reshape", [out, const_ints(t, [-1, hv])]))
            self.onnx_emitted += 1
        flat = t.op("Concat", parts, {"axis": 0}) if len(parts) > 1 else parts[0]
        return t.op("Gather", [flat, groups.inverse], {"axis": 0})

    def _bool_mask(self, kpm: ir.Value, g: int) -> ir.Value:
        """Group ``g``'s key padding mask as ONNX Attention's bool ``[B_g, 1, L_g, L_g]`` (made once)."""
        key = (id(kpm), g)
        if key not in self._bool_masks:
            t = self.tape
            keys = t.op("Cast", [self._groups.key_mask(kpm, g)], {"to": ir.DataType.BOOL})  # [Bg, Lg]
            shape = t.op("Shape", [keys])
            rows, length = (t.op("Slice", [shape, const_ints(t, [i]), const_ints(t, [i + 1])]) for i in (0, 1))
            target = t.op("Concat", [rows, const_ints(t, [1]), length, length], {"axis": 0})
            self._bool_masks[key] = t.op("Expand", [t.op("Unsqueeze", [keys, const_ints(t, [1, 2])]), target])
        return self._bool_masks[key]

    def _packed_qkv(self, node: ir.Node, inputs: list[ir.Value | None]) -> tuple:
        """Packed (q, k, v, projection bias, key padding mask, attention bias) of an attention step."""
        a = attention_inputs(node, inputs)  # the packed inputs, read by name
        if node.op_type != "Attention":
            return a.query, a.key, a.value, a.bias, a.key_padding_mask, a.attention_bias
        # three MatMuls on column slices of the weights (folded by ORT) instead of MatMul + Split copies;
        # the projection bias goes to MultiHeadAttention, which adds it while it re-lays Q/K/V.
        # constant weights are split into three initializers, so later passes (quantize) see plain
        # MatMul(x, W) with a constant W
        t, weights = self.tape, a.weights
        sizes = attention_attributes(node).qkv_sizes(int(self.plan.labels(weights)[1]))
        w_all = weights.const_value.numpy() if weights.const_value is not None else None
        projections = []
        for i, (lo, hi) in enumerate(((0, sizes[0]), (sizes[0], sizes[0] + sizes[1]),
                                      (sizes[0] + sizes[1], sum(sizes)))):
            if w_all is not None:
                w = _slice_initializer(self.graph, weights, "qkv"[i], np.ascontiguousarray(w_all[:, lo:hi]))
            else:
                w = t.op("Slice", [weights, const_ints(t, [lo]), const_ints(t, [hi]), const_ints(t, [1])])
            projections.append(t.op("MatMul", [a.input, w]))
            provenance.inherit(projections[-1].producer(), node)
        q, k, v = projections
        return q, k, v, a.bias, a.mask_index, a.attention_bias


def _emit_split_attention(
    tape: ir.tape.Tape, index: PackIndex, node: ir.Node, packed_x: ir.Value, plan: Plan
) -> ir.Value:
    """Attention(x, W, b, mask, -, bias) -> MHA(unpack(q), unpack(k), unpack(v), mask, bias) with a packed QKV MatMul."""
    a = attention_inputs(node)
    attrs = attention_attributes(node)
    start = len(tape.nodes)
    qkv = tape.op("MatMul", [packed_x, a.weights])
    if a.bias is not None:
        qkv = tape.op("Add", [qkv, a.bias])
    sizes = attrs.qkv_sizes(int(plan.labels(a.weights)[1]))
    q, k, v = tape.op_multi_out("Split", [qkv, const_ints(tape, sizes)], {"axis": -1}, num_outputs=3)
    ins = attention_input_list("MultiHeadAttention", query=index.unpack(q), key=index.unpack(k),
                               value=index.unpack(v), key_padding_mask=a.mask_index, attention_bias=a.attention_bias)
    out = tape.op("MultiHeadAttention", ins, attrs.for_mha("scale", "mask_filter_value"), domain=MS_DOMAIN)
    out.name = f"{node.outputs[0].name}_mha"
    for n in tape.nodes[start:]:  # the projection, split and attention rebuild the Attention (not the unpacks)
        if n.op_type in ("MatMul", "Add", "Split", "MultiHeadAttention"):
            provenance.inherit(n, node)
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

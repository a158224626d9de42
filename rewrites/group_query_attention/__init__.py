"""``group-query-attention``: each layer's attention of a causal LM with past becomes ONNX Runtime's
``com.microsoft.GroupQueryAttention``, rotary inside, past and present wired to the KV cache (exact).

After ``fuse`` a Llama-style export computes, per layer (see ``match.py``)::

    RotaryEmbedding(q) ─┐
    Concat(past_key, RotaryEmbedding(k))   ─▶ present.N.key   ─Unsqueeze─Expand─Reshape─┤ MultiHeadAttention
    Concat(past_value, v)                  ─▶ present.N.value ─Unsqueeze─Expand─Reshape─┤   (causal + padding
    attention_mask ─(causal + padding bias)─────────────────────────────────────────────┘    bias)

that is, every decode step copies the whole cache twice (Concat, then the head expansion). Rewritten, as
ONNX Runtime GenAI's builder writes it::

    seqlens_k = Cast(ReduceSum(attention_mask, [1]) - 1, int32)          (shared by all layers)
    total_sequence_length = Cast(Shape(attention_mask)[1], int32)        (a scalar)
    GroupQueryAttention(q3d, k3d, v3d, past_key, past_value, seqlens_k, total_sequence_length,
                        cos_cache, sin_cache, num_heads, kv_num_heads, do_rotary=1, rotary_interleaved)
        ─▶ output, present.N.key, present.N.value

``cos_cache`` / ``sin_cache`` are constants ``[max_positions, D/2]`` (option ``max_positions``, 4096),
computed once by ONNX Runtime with the export's own ops (``probe.py``). The model's metadata then says
``graphopt.kv_cache = shared-buffer`` and ``graphopt.max_positions``: the generation runtime binds one
buffer as both past and present (GroupQueryAttention sees the sharing and writes only the new positions).

The contract GroupQueryAttention imposes, which the rewritten graph has and the input model did not:
the attention mask of every row is a prefix of ones (right padding: real tokens first, then padding),
and every row's positions start at 0 (row ``b``'s new tokens sit at positions ``sum(mask[b]) - S ...
sum(mask[b]) - 1``; the input model put every row at ``past, past + 1, ...``). For feeds that keep it (full
masks, or a prefill whose padding is on the right) the outputs are those of the input model at every real
token; what the model computes at padded positions is unspecified. Verification feeds for such graphs keep it
(``graphopt.data.feeds.generated``).

Refuses (graph unchanged, the reason in the notes and under ``--explain``) when: the graph has no
``past_key_values.N.key/value`` inputs with ``present.N.key/value`` outputs, or has inputs besides
``input_ids``, ``attention_mask`` and the past (``position_ids``); any layer's attention is not the form above
(no fused MultiHeadAttention, no rotary, a partial / scaled / packed rotary, query and key rotaries that differ,
a present used elsewhere, heads that do not divide, positions that do not start at the past length); the rotary
caches are not ``Cos``/``Sin`` of ``Range(0, n, 1) x inv_freq`` (or constants); the attention bias is not the
causal + padding mask of ``attention_mask`` (checked by running it, ``probe.py``); not every past is used by a
matched layer; the provider is CUDA and the cache float32 (ORT's CUDA kernel takes fp16/bf16 only).
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate.signature import KV_CACHE_KEY, MAX_POSITIONS_KEY
from graphopt.opsets import MS_DOMAIN

from .match import Layer, Refusal, match_layer
from .probe import mask_is_causal_padding, rotary_tables

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")


def _signature_reason(graph: ir.Graph) -> str | None:
    ins = [v.name for v in graph.inputs if v.name not in graph.initializers]
    past = [n for n in ins if _PAST.match(n)]
    if not past:
        return "no past_key_values.N.key/value inputs (not a causal LM with past)"
    if "attention_mask" not in ins or "input_ids" not in ins:
        return "no input_ids and attention_mask inputs"
    other = [n for n in ins if n not in ("input_ids", "attention_mask") and not _PAST.match(n)]
    if other:
        return f"inputs besides input_ids, attention_mask and the past: {', '.join(other)}"
    presents = {_PRESENT.match(v.name).groups() for v in graph.outputs if _PRESENT.match(v.name or "")}
    missing = [n for n in past if _PAST.match(n).groups() not in presents]
    if missing:
        return f"past {missing[0]!r} has no present output"
    return None


class GroupQueryAttentionPass(GraphoptPass):
    """Causal-LM attention with past to GroupQueryAttention (rotary inside, KV cache shared in place)."""

    name = "group-query-attention"
    exact = True
    emits = (f"{MS_DOMAIN}::GroupQueryAttention",)
    run_after = ("fuse",)

    def __init__(self, *, max_positions: int = 4096):
        super().__init__()
        if max_positions < 1:
            raise UsageError(f"group-query-attention.max_positions must be >= 1, got {max_positions}")
        self.max_positions = max_positions

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        why = _signature_reason(graph)
        if why is None and ctx.provider == "cuda" and any(
                v.dtype == ir.DataType.FLOAT for v in graph.inputs if _PAST.match(v.name)):
            why = "ONNX Runtime's CUDA GroupQueryAttention takes fp16/bf16 only; this cache is float32"
        layers: list[Layer] = []
        if why is None:
            past_inputs = {v.name for v in graph.inputs if _PAST.match(v.name)}
            mhas = [n for n in graph if n.op_type == "MultiHeadAttention" and n.domain == MS_DOMAIN]
            try:
                if not mhas:
                    raise Refusal("no fused MultiHeadAttention (run fuse first)")
                layers = [match_layer(n, past_inputs) for n in mhas]
                used = {v.name for lay in layers for v in (lay.past_key, lay.past_value)}
                if used != past_inputs:
                    raise Refusal(f"past {sorted(past_inputs - used)[0]!r} is used by no matched attention")
                first = layers[0]
                tables = rotary_tables(first.cos, first.sin, self.max_positions)
                if tables[0].shape[1] * 2 != first.head_dim:
                    raise Refusal(f"rotary cache of {tables[0].shape[1]} frequencies does not cover head_dim "
                                  f"{first.head_dim} (partial rotary)")
                for lay in layers[1:]:
                    if (lay.cos, lay.sin) != (first.cos, first.sin):
                        other = rotary_tables(lay.cos, lay.sin, self.max_positions)
                        if not all(np.array_equal(a, b) for a, b in zip(tables, other)):
                            raise Refusal("layers use different rotary caches", lay.mha)
                why = mask_is_causal_padding(model, [lay.bias for lay in layers], first.kv_heads, first.head_dim)
            except Refusal as e:
                why = str(e)
        if why is not None:
            return PassResult(model, False, notes=[f"not applied: {why}"])
        _rewrite(model, layers, tables)
        model.metadata_props[KV_CACHE_KEY] = "shared-buffer"
        model.metadata_props[MAX_POSITIONS_KEY] = str(self.max_positions)
        return PassResult(model, True, rule_counts={"group_query_attention": len(layers)},
                          notes=[f"group-query-attention: {len(layers)} layers; rotary caches for "
                                 f"{self.max_positions} positions; the graph needs right-padded masks"])


def _const(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                 const_value=ir.tensor(arr, name=name))
    graph.register_initializer(v)
    return v


def _rewrite(model: ir.Model, layers: list[Layer], tables: tuple[np.ndarray, np.ndarray]) -> None:
    graph = model.graph
    mask = next(v for v in graph.inputs if v.name == "attention_mask")
    one = _const(graph, "gqa_one_i64", np.array([1], np.int64))
    cos = _const(graph, "gqa_cos_cache", tables[0])
    sin = _const(graph, "gqa_sin_cache", tables[1])
    i32 = ir.DataType.INT32
    total = ir.node("ReduceSum", [mask, one], attributes={"keepdims": 0})
    minus = ir.node("Sub", [total.outputs[0], one])
    seqlens = ir.node("Cast", [minus.outputs[0]], attributes={"to": i32})
    shape = ir.node("Shape", [mask], attributes={"start": 1, "end": 2})
    squeeze = ir.node("Squeeze", [shape.outputs[0]])
    total_len = ir.node("Cast", [squeeze.outputs[0]], attributes={"to": i32})
    shared = [total, minus, seqlens, shape, squeeze, total_len]
    for node, name in zip(shared, ("mask_sum", "mask_sum_minus_1", "seqlens_k", "mask_shape_1", "mask_len",
                                   "total_sequence_length")):
        node.name = f"gqa_{name}"
        node.outputs[0].name = f"gqa_{name}"
    seqlens.outputs[0].type = ir.TensorType(i32)
    seqlens.outputs[0].shape = ir.Shape([mask.shape[0] if mask.shape is not None else None])
    total_len.outputs[0].type = ir.TensorType(i32)
    total_len.outputs[0].shape = ir.Shape([])
    graph.insert_before(next(iter(graph)), shared)
    for i, lay in enumerate(layers):
        attrs = {"num_heads": lay.num_heads, "kv_num_heads": lay.kv_heads, "do_rotary": 1,
                 "rotary_interleaved": lay.interleaved}
        if lay.scale is not None:
            attrs["scale"] = lay.scale
        node = ir.node("GroupQueryAttention", [lay.q3d, lay.k3d, lay.v3d, lay.past_key, lay.past_value,
                                               seqlens.outputs[0], total_len.outputs[0], cos, sin],
                       attributes=attrs, domain=MS_DOMAIN, num_outputs=3, name=f"GroupQueryAttention_{i}")
        graph.insert_before(lay.mha, node)
        out, pk, pv = node.outputs
        old = lay.mha.outputs[0]
        out.name, out.shape, out.type = f"gqa_{i}_output", old.shape, old.type
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        for new, present in ((pk, lay.present_key), (pv, lay.present_value)):
            name = present.name
            new.shape, new.type = present.shape, present.type
            present.replace_all_uses_with(new, replace_graph_outputs=True)
            present.name = f"{name}_replaced"
            new.name = name
    common_passes.RemoveUnusedNodesPass()(model)


register(GroupQueryAttentionPass)

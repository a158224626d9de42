"""graphopt.runtime.contrib: named inputs and attributes of ORT's com.microsoft attention ops."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import pytest

from graphopt.errors import GraphoptError
from graphopt.opsets import MS_DOMAIN
from graphopt.runtime import contrib


def _values(*names: str) -> list[ir.Value | None]:
    return [ir.Value(name=n) if n else None for n in names]


def _node(op: str, inputs, domain: str = MS_DOMAIN, **attrs) -> ir.Node:
    return ir.node(op, inputs, attributes=attrs, domain=domain)


def test_schemas_match_onnxruntime():
    """The tables are ORT's own input lists (an ORT upgrade that renumbers an input fails here)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    ort = {s.name: tuple(i.name for i in s.inputs) for s in get_all_operator_schema() if s.domain == MS_DOMAIN}
    for op, names in contrib.ATTENTION_SCHEMAS.items():
        assert ort[op] == names, op
    assert ort["EmbedLayerNormalization"] == contrib.EMBED_SCHEMA
    fields = {f.name for f in dataclasses.fields(contrib.AttentionInputs)}
    assert {n for names in contrib.ATTENTION_SCHEMAS.values() for n in names} <= fields


def test_attention_inputs_by_name():
    x, w, b, bias = _values("x", "w", "b", "bias")
    a = contrib.attention_inputs(_node("Attention", [x, w, b, None, None, bias], num_heads=2))
    assert (a.input, a.weights, a.bias, a.attention_bias) == (x, w, b, bias)
    assert a.mask_index is None and a.mask is None and a.past_state == () and a.query is None
    q, k, v, kpm, pk = _values("q", "k", "v", "kpm", "pk")
    m = contrib.attention_inputs(_node("MultiHeadAttention", [q, k, v, None, kpm, None, pk]))
    assert (m.query, m.key, m.value, m.mask, m.key_padding_mask) == (q, k, v, kpm, kpm)
    assert m.past_state == (pk,) and m.input is None
    # QAttention numbers mask_index differently (5, not 3): the name finds it
    qa = contrib.attention_inputs(_node("QAttention", [*_values("x", "w", "b", "xs", "ws"), kpm]))
    assert qa.mask_index is kpm and qa.mask is kpm and qa.weight is not None
    # replacement inputs, read with the node's schema
    assert contrib.attention_inputs(_node("Attention", [x, w]), [b, None, None, kpm]).mask_index is kpm


def test_attention_inputs_refuses_other_ops():
    with pytest.raises(GraphoptError, match="not a com.microsoft attention op"):
        contrib.attention_inputs(_node("Attention", _values("x"), domain=""))
    with pytest.raises(GraphoptError, match="has 8 inputs; its schema has 7"):
        contrib.attention_inputs(_node("Attention", _values(*"abcdefgh")))
    with pytest.raises(GraphoptError, match="not a com.microsoft EmbedLayerNormalization"):
        contrib.embed_inputs(_node("Attention", _values("x")))


def test_embed_inputs_by_name():
    ids, seg, word, pos, segt, g, b, mask = _values("ids", "seg", "word", "pos", "segt", "g", "b", "mask")
    e = contrib.embed_inputs(_node("EmbedLayerNormalization", [ids, seg, word, pos, segt, g, b, mask]))
    assert (e.input_ids, e.word_embedding, e.segment_embedding, e.mask, e.position_ids) == (ids, word, segt, mask, None)


def test_attention_input_list():
    q, k, v, kpm = _values("q", "k", "v", "kpm")
    assert contrib.attention_input_list("MultiHeadAttention", query=q, key=k, value=v, key_padding_mask=kpm,
                                        attention_bias=None) == [q, k, v, None, kpm]
    assert contrib.attention_input_list("MultiHeadAttention", query=q) == [q]
    with pytest.raises(ValueError, match="no input 'mask_index'"):
        contrib.attention_input_list("MultiHeadAttention", query=q, mask_index=kpm)


def test_attention_attributes():
    x, w = _values("x", "w")
    plain = contrib.attention_attributes(_node("Attention", [x, w], num_heads=4, scale=0.5))
    assert plain.num_heads == 4 and plain.stateless_bidirectional
    assert plain.qkv_sizes(96) == [32, 32, 32]
    assert plain.for_mha("scale", "mask_filter_value") == {"num_heads": 4, "scale": 0.5}
    sized = contrib.attention_attributes(_node("Attention", [x, w], num_heads=4, qkv_hidden_sizes=[32, 32, 64],
                                               unidirectional=1))
    assert sized.qkv_sizes(128) == [32, 32, 64] and not sized.stateless_bidirectional
    with pytest.raises(GraphoptError, match="Attention .* has no num_heads"):
        contrib.attention_attributes(_node("Attention", [x, w])).for_mha()

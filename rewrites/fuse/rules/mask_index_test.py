"""Tests of the mask_index step of ``fuse``: small Attention graphs per mask encoding and refusal."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.engine import registry
from graphopt.engine.registry import PassContext
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(0)
B, S, D, H = 3, 5, 8, 2
LOWEST = float(np.finfo(np.float32).min)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _expand_to_square(src: str, dst: str) -> list:
    """dst = Expand(src, [B, 1, S, S]) with B, S read from the mask's shape."""
    return [
        helper.make_node("Shape", ["mask"], [f"{dst}_shp"]),
        helper.make_node("Gather", [f"{dst}_shp", "i0"], [f"{dst}_b"], axis=0),
        helper.make_node("Gather", [f"{dst}_shp", "i1"], [f"{dst}_s"], axis=0),
        helper.make_node("Concat", [f"{dst}_b", "one_i", f"{dst}_s", f"{dst}_s"], [f"{dst}_tgt"], axis=0),
        helper.make_node("Expand", [src, f"{dst}_tgt"], [dst]),
    ]


def _shape_consts():
    return [_const("i0", [0], np.int64), _const("i1", [1], np.int64), _const("one_i", [1], np.int64)]


def _classic(c):
    """bias = Expand(Unsqueeze((1 - float(mask)) * c, [1, 2]), [B, 1, S, S]): BERT's classic form."""
    nodes = [
        helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "mf"], ["inv"]),
        helper.make_node("Mul", ["inv", "c"], ["neg"]),
        helper.make_node("Unsqueeze", ["neg", "axes12"], ["b4"]),
        *_expand_to_square("b4", "bias"),
    ]
    return nodes, [_const("one", 1.0), _const("c", c), _const("axes12", [1, 2], np.int64), *_shape_consts()]


def _where(c):
    """bias = Where(Expand(bool(mask)[:, None, None, :], [B, 1, S, S]), 0, c): transformers 5 / sdpa."""
    nodes = [
        helper.make_node("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["mb", "axes12"], ["m4"]),
        *_expand_to_square("m4", "m4e"),
        helper.make_node("Where", ["m4e", "zero", "c"], ["bias"]),
    ]
    inits = [_const("axes12", [1, 2], np.int64), *_shape_consts(), _const("zero", 0.0), _const("c", c)]
    return nodes, inits


def _model(mask_nodes, mask_inits, extra_inputs=(), extra_outputs=()) -> ir.Model:
    att = helper.make_node("Attention", ["x", "W", "bw", "", "", "bias"], ["y"], domain="com.microsoft", num_heads=H)
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D]),
        helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"]),
        *extra_inputs,
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", D]), *extra_outputs]
    inits = [_const("W", RNG.standard_normal((D, 3 * D)) * 0.5), _const("bw", RNG.standard_normal(3 * D) * 0.1),
             *mask_inits]
    graph = helper.make_graph([*mask_nodes, att], "g", inputs, outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _feeds():
    mask = np.ones((B, S), np.int64)
    mask[1, 3:] = 0
    mask[2] = 0  # an all-padding row
    rel = RNG.standard_normal((B, 1, 1, S)).astype(np.float32)
    return [{"x": RNG.standard_normal((B, S, D)).astype(np.float32), "mask": mask, "rel": rel}]


def _fuse(model: ir.Model):
    feeds = _feeds()
    ref = run(make_session(model, optimize=False), feeds)
    before = collections.Counter(n.op_type for n in model.graph)
    p = registry.create("fuse")
    result = p(model, PassContext(explain=True))
    got = run(make_session(result.model, optimize=False), feeds)
    return result, p, before, ref[0], got[0]


def _attention(model):
    (node,) = [n for n in model.graph if n.op_type == "Attention"]
    return node


@pytest.mark.parametrize("encoding,c", [("classic", -10000.0), ("classic", LOWEST), ("where", LOWEST),
                                        ("where", -np.inf)])
def test_mask_index_per_encoding(encoding, c):
    nodes, inits = (_classic if encoding == "classic" else _where)(c)
    result, p, _, ref, got = _fuse(_model(nodes, inits))
    ops = collections.Counter(n.op_type for n in result.model.graph)
    assert dict(ops) == {"Cast": 1, "Attention": 1}, ops  # every mask-building node is gone
    node = _attention(result.model)
    assert node.inputs[3].name == "mask_int32" and (len(node.inputs) < 6 or node.inputs[5] is None)
    filt = node.attributes["mask_filter_value"].value
    assert filt == (LOWEST if np.isinf(c) else np.float32(c))
    assert result.rule_counts["mask_index"] == 1
    y_ref, y = ref["y"], got["y"]
    # real tokens: identical; the all-padding row too, except where the export itself gives NaN (-inf)
    rows = slice(0, 2) if np.isinf(c) else slice(None)
    np.testing.assert_allclose(y[rows], y_ref[rows], atol=1e-6, rtol=0)
    assert np.isfinite(y).all()


def _refused(model, reason):
    result, p, _, ref, got = _fuse(model)
    # unmodified: the pipeline keeps the input graph exactly (the working copy was only prepared)
    assert not result.modified
    node = _attention(result.model)
    assert node.inputs[3] is None and node.inputs[5] is not None
    assert "mask_index" not in result.rule_counts
    from graphopt.rewrites.fuse.rules.mask_index import MaskIndexStep

    step = MaskIndexStep()
    assert step.apply_to_model(result.model) == 0
    assert any(reason in r for r in step.reasons), step.reasons
    np.testing.assert_array_equal(got["y"], ref["y"])


def test_refuses_small_constant():
    _refused(_model(*_classic(-100.0)), "is above -10000.0")


def test_refuses_inverted_mask():
    nodes, inits = _classic(-10000.0)
    nodes[1] = helper.make_node("Identity", ["mf"], ["inv"])  # m * c: masks the kept keys
    _refused(_model(nodes, inits), "not 0 at every kept key")


def test_refuses_bias_reading_other_input():
    nodes, inits = _classic(LOWEST)
    nodes[-1] = helper.make_node("Expand", ["b4", "bias_tgt"], ["b0"])
    nodes.append(helper.make_node("Add", ["b0", "rel"], ["bias"]))
    rel = helper.make_tensor_value_info("rel", TensorProto.FLOAT, ["batch", 1, 1, "seq"])
    _refused(_model(nodes, inits, extra_inputs=[rel]), "reads the values of 2 graph inputs")


def test_refuses_constant_depending_on_length():
    nodes, inits = _classic(-10000.0)
    # the masked value is c * S: a different constant per sequence length
    nodes[3] = helper.make_node("Unsqueeze", ["neg2", "axes12"], ["b4"])
    nodes[3:3] = [
        helper.make_node("Shape", ["mask"], ["len_i"], start=1, end=2),
        helper.make_node("Cast", ["len_i"], ["len"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["neg", "len"], ["neg2"]),
    ]
    _refused(_model(nodes, inits), "masked value differs between masks")


def test_mask_index_off_keeps_bias():
    model = _model(*_classic(LOWEST))
    p = registry.create("fuse", {"mask_index": False})
    result = p(model)
    assert not result.modified
    assert _attention(result.model).inputs[5] is not None

"""Tests of the EmbedLayerNormalization rule (through the ``fuse`` pass): positive and refusals."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.data.metrics import compare
from graphopt.engine import registry
from graphopt.engine.registry import PassContext
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(1)
V, T, P, D = 50, 2, 32, 8


def _embed_model(*, pos_table=None, start=0, ln_axis=-1, end_from="ids") -> ir.Model:
    """word[ids] + type[tt] + pos[Slice(arange, 0, S)] -> LayerNorm (TorchScript-style shape arithmetic)."""
    table = np.arange(P, dtype=np.int64)[None, :] if pos_table is None else pos_table
    src = "input_ids" if end_from == "ids" else "other"
    nodes = [
        helper.make_node("Shape", [src], ["shp"]),
        helper.make_node("Gather", ["shp", "one"], ["seq"], axis=0),
        helper.make_node("Unsqueeze", ["seq", "zero1"], ["end"]),
        helper.make_node("Slice", ["pos_ids_table", "start", "end", "one1"], ["pos_ids"]),
        helper.make_node("Gather", ["word", "input_ids"], ["w"]),
        helper.make_node("Gather", ["type", "token_type_ids"], ["t"]),
        helper.make_node("Add", ["w", "t"], ["wt"]),
        helper.make_node("Gather", ["pos", "pos_ids"], ["p"]),
        helper.make_node("Add", ["wt", "p"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=ln_axis, epsilon=1e-12),
    ]
    f = lambda name, shape: numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)  # noqa: E731
    inits = [
        f("word", (V, D)), f("type", (T, D)), f("pos", (P, D)), f("gamma", (D,)), f("beta", (D,)),
        numpy_helper.from_array(table, "pos_ids_table"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "zero1"),
        numpy_helper.from_array(np.array([1], np.int64), "one1"),
        numpy_helper.from_array(np.array([start], np.int64), "start"),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    if end_from != "ids":
        inputs.append(helper.make_tensor_value_info("other", TensorProto.INT64, ["batch", "other_len"]))
    graph = helper.make_graph(
        nodes, "emb", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", D])], inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _feeds(model: ir.Model):
    b, s = 2, 6
    feed = {
        "input_ids": RNG.integers(0, V, (b, s)).astype(np.int64),
        "token_type_ids": RNG.integers(0, T, (b, s)).astype(np.int64),
    }
    if any(i.name == "other" for i in model.graph.inputs):
        feed["other"] = np.zeros((b, s), np.int64)
    return [feed]


def _fuse(model: ir.Model):
    feeds = _feeds(model)
    ref = run(make_session(model, optimize=False), feeds)
    p = registry.create("fuse", {"attention": False, "gelu": "off", "layer_norm": False})
    result = p(model, PassContext(explain=True))
    got = run(make_session(model, optimize=False), feeds)
    ops = collections.Counter(n.op_type for n in model.graph)
    return ops, compare(got, ref, feeds), result


def test_fuses_embedding_sum_and_layernorm():
    ops, cmp, result = _fuse(_embed_model())
    assert ops["EmbedLayerNormalization"] == 1 and ops["LayerNormalization"] == 0, ops
    assert ops["Gather"] == 0
    assert result.rule_counts["embed_layer_normalization"] == 1
    assert cmp.worst("max_abs") <= 1e-5


@pytest.mark.parametrize("kwargs,reason", [
    ({"pos_table": np.arange(P, dtype=np.int64)[None, ::-1].copy()}, "position id table is not 0..N-1"),
    ({"ln_axis": 1}, "normalises axis 1"),
    ({"end_from": "other"}, "not the sequence length of the input ids"),
])
def test_refusals_leave_the_graph_alone(kwargs, reason):
    ops, cmp, result = _fuse(_embed_model(**kwargs))
    assert ops["EmbedLayerNormalization"] == 0 and ops["LayerNormalization"] == 1, ops
    assert cmp.worst("max_abs") <= 1e-6
    assert any(reason in n for n in result.notes), result.notes

"""Tests of the canonical-form rules used before fusion (constants second, scalar Where, identity Reshape)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from graphopt.rewrites.fuse.rules.canonical import canonical_rules, shape_rules
from graphopt.runtime.session import make_session, run


def _model(nodes, inits, x_shape=("b", 4), y_shape=("b", 4)) -> ir.Model:
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))], inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _check(model: ir.Model, rules) -> tuple[int, ir.Model]:
    feed = [{"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}]
    ref = run(make_session(model, optimize=False), feed)
    n = rules.apply_to_model(model)
    got = run(make_session(model, optimize=False), feed)
    np.testing.assert_array_equal(got[0]["y"], ref[0]["y"])  # bit-identical
    return n, model


def test_constant_goes_second():
    c = numpy_helper.from_array(np.arange(4, dtype=np.float32), "c")
    n, m = _check(_model([helper.make_node("Add", ["c", "x"], ["y"])], [c]), canonical_rules)
    assert n == 1 and m.graph.node(0).inputs[1].name == "c"


def test_constant_second_refuses_without_constant():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])]
    n, _ = _check(_model(nodes, []), canonical_rules)
    assert n == 0


def test_where_branch_becomes_scalar():
    z = numpy_helper.from_array(np.array([0.0], np.float32), "z")
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("Where", ["nan", "z", "x"], ["y"])]
    n, m = _check(_model(nodes, [z]), canonical_rules)
    assert n == 1
    where = next(nd for nd in m.graph if nd.op_type == "Where")
    assert where.inputs[1].const_value.shape == ()


def test_where_refuses_unknown_rank():
    z = numpy_helper.from_array(np.array([0.0], np.float32), "z")
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("Where", ["nan", "z", "x"], ["y"])]
    m = _model(nodes, [z])
    for v in (m.graph.inputs[0], m.graph.node(0).outputs[0]):
        v.shape = None
    assert canonical_rules.apply_to_model(m) == 0


def test_identity_reshape_is_dropped_and_others_kept():
    s = numpy_helper.from_array(np.array([0, -1], np.int64), "s")
    m = _model([helper.make_node("Reshape", ["x", "s"], ["y"])], [s])
    m.graph.node(0).outputs[0].shape = ir.Shape(["b", 4])
    n, _ = _check(m, shape_rules)
    assert n == 1
    s2 = numpy_helper.from_array(np.array([2, -1], np.int64), "s")
    m2 = _model([helper.make_node("Reshape", ["x", "s"], ["y"])], [s2], x_shape=(2, 4), y_shape=(2, 4))
    m2.graph.node(0).outputs[0].shape = ir.Shape([2, None])
    assert shape_rules.apply_to_model(m2) == 0

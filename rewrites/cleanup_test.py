"""Tests for the ``cleanup`` pass: what it removes, and what it must leave alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt import io
from graphopt.engine import pipeline
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model
from graphopt.opsets import op_histogram


def _model(nodes, inputs, outputs, inits=(), opsets=(("", 17),), ir_version=8, functions=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], functions=list(functions))
    m.ir_version = ir_version
    return ir.serde.deserialize_model(m)


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _run_cleanup(model, feeds, **opts):
    before = run_model(model, feeds)
    res = pipeline.optimize(model, OptimizeOptions(passes="cleanup", feeds=feeds,
                                                   overrides=[f"cleanup.{k}={v}" for k, v in opts.items()]))
    assert res.ok, [p.error for p in res.report.failed()]
    after = run_model(res.model, feeds)
    for a, b in zip(after, before):
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
    return res


def test_folds_constants_removes_identity_and_dead_code():
    c = numpy_helper.from_array(np.arange(4, dtype=np.float32), "c")
    nodes = [
        helper.make_node("Mul", ["c", "c"], ["c2"]),
        helper.make_node("Add", ["x", "c2"], ["y0"]),
        helper.make_node("Identity", ["y0"], ["y1"]),
        helper.make_node("Neg", ["x"], ["dead"]),
        helper.make_node("Relu", ["y1"], ["y"]),
    ]
    m = _model(nodes, [_vi("x", [4])], [_vi("y", [4])], [c])
    res = _run_cleanup(m, [{"x": np.linspace(-3, 3, 4, dtype=np.float32)}])
    assert dict(op_histogram(res.model)) == {"Add": 1, "Relu": 1}


def test_cse_merges_duplicates():
    nodes = [
        helper.make_node("Exp", ["x"], ["a"]),
        helper.make_node("Exp", ["x"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    m = _model(nodes, [_vi("x", [3])], [_vi("y", [3])])
    res = _run_cleanup(m, [{"x": np.ones(3, np.float32)}])
    assert op_histogram(res.model)["Exp"] == 1
    res = _run_cleanup(_model(nodes, [_vi("x", [3])], [_vi("y", [3])]), [{"x": np.ones(3, np.float32)}], cse="false")
    assert op_histogram(res.model)["Exp"] == 2


def test_initializer_that_is_graph_input_is_never_folded(tmp_path):
    w = numpy_helper.from_array(np.full(3, 2.0, np.float32), "w")
    nodes = [helper.make_node("Mul", ["w", "w"], ["w2"]), helper.make_node("Add", ["x", "w2"], ["y"])]
    m = _model(nodes, [_vi("x", [3]), _vi("w", [3])], [_vi("y", [3])], [w])
    res = _run_cleanup(m, [{"x": np.ones(3, np.float32)}])
    assert op_histogram(res.model)["Mul"] == 1
    out = io.save(res.model, tmp_path / "o.onnx")
    # the caller can still override w
    got = run_model(out, [{"x": np.ones(3, np.float32), "w": np.full(3, 3.0, np.float32)}])
    np.testing.assert_allclose(got[0]["y"], np.full(3, 10.0))


def _if_model():
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["c", "c"], ["cc"]), helper.make_node("Add", ["x", "cc"], ["t"]),
         helper.make_node("Identity", ["t"], ["t_out"])],
        "then", [], [_vi("t_out", [2])],
        [numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "c")],
    )
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e_out"])], "else", [], [_vi("e_out", [2])])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    return _model(nodes, [_vi("x", [2])], [_vi("y", [2])], [zero])


def test_if_subgraphs_kept_and_cleaned():
    m = _if_model()
    feeds = [{"x": np.array([1.0, 2.0], np.float32)}, {"x": np.array([-1.0, -2.0], np.float32)}]
    res = _run_cleanup(m, feeds)
    hist = op_histogram(res.model)
    assert hist["If"] == 1 and hist["Neg"] == 1
    assert "Identity" not in hist and "Mul" not in hist  # cleaned inside the branch


def test_loop_and_scan_kept():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["acc_in", "one"], ["acc_out"])],
        "body",
        [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("acc_in", [2])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "one")],
    )
    scan_body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "xs"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["ys"])],
        "scan_body", [_vi("s_in", [2]), _vi("xs", [2])], [_vi("s_out", [2]), _vi("ys", [2])],
    )
    nodes = [
        helper.make_node("Loop", ["n", "t", "x"], ["loop_out"], body=body),
        helper.make_node("Scan", ["loop_out", "seq"], ["final", "scan_out"], body=scan_body, num_scan_inputs=1),
    ]
    t = numpy_helper.from_array(np.array(True), "t")
    m = _model(nodes, [_vi("n", [], TensorProto.INT64), _vi("x", [2]), _vi("seq", [3, 2])],
               [_vi("final", [2]), _vi("scan_out", [3, 2])], [t])
    feeds = [{"n": np.array(3, np.int64), "x": np.zeros(2, np.float32), "seq": np.arange(6, dtype=np.float32).reshape(3, 2)}]
    res = _run_cleanup(m, feeds)
    hist = op_histogram(res.model)
    assert hist["Loop"] == 1 and hist["Scan"] == 1


def test_non_default_domains_kept():
    # ai.onnx.ml Normalizer and a com.microsoft contrib op survive, and their outputs are unchanged
    nodes = [
        helper.make_node("Normalizer", ["x"], ["n"], domain="ai.onnx.ml", norm="L2"),
        helper.make_node("Gelu", ["n"], ["y"], domain="com.microsoft"),
    ]
    m = _model(nodes, [_vi("x", [2, 3])], [_vi("y", [2, 3])],
               opsets=(("", 17), ("ai.onnx.ml", 3), ("com.microsoft", 1)))
    res = _run_cleanup(m, [{"x": np.arange(6, dtype=np.float32).reshape(2, 3)}])
    assert dict(op_histogram(res.model)) == {"ai.onnx.ml::Normalizer": 1, "com.microsoft::Gelu": 1}


def test_old_opset_stays_valid():
    # opset 9 model: constant folding may not introduce newer op forms
    c = numpy_helper.from_array(np.array([1, 2], np.int64), "axes_shape")
    nodes = [
        helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]),
        helper.make_node("Shape", ["u"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Identity", ["axes_shape"], ["unused"]),
        helper.make_node("Relu", ["u"], ["y"]),
    ]
    m = _model(nodes, [_vi("x", [3])], [_vi("y", [1, 3]), _vi("sf", [2])], [c], opsets=(("", 9),), ir_version=4)
    res = _run_cleanup(m, [{"x": np.array([-1.0, 0.0, 2.0], np.float32)}])
    assert res.model.opset_imports[""] == 9
    onnx.checker.check_model(io.to_proto(res.model), full_check=True)


def test_graphopt_functions_not_inlined():
    f = helper.make_function(
        "ai.graphopt", "Double", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
        opset_imports=[helper.make_opsetid("", 17)],
    )
    nodes = [helper.make_node("Double", ["x"], ["y"], domain="ai.graphopt")]
    m = _model(nodes, [_vi("x", [2])], [_vi("y", [2])], opsets=(("", 17), ("ai.graphopt", 1)), functions=[f])
    res = _run_cleanup(m, [{"x": np.ones(2, np.float32)}], inline="true")
    assert dict(op_histogram(res.model)) == {"ai.graphopt::Double": 1}


@pytest.mark.slow
def test_minilm_torchscript_cleanup(minilm):
    path = minilm("torchscript", "eager")
    res = pipeline.optimize(path, OptimizeOptions(passes="cleanup"))
    assert res.ok
    rec = res.report.passes[0]
    assert rec.nodes_after < rec.nodes_before - 100  # the TorchScript export is full of shape chains
    assert rec.verification["max_abs"] <= 1e-5

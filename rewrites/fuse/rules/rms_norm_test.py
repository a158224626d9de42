"""Tests of fuse_rms_norm: RMSNorm ends as ONNX RMSNormalization (opset >= 23) or standard ops, never as ORT's
ONNX-domain SimplifiedLayerNormalization (which the ONNX checker rejects)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter.ort_fusions import rms_normalization, skip_normalization

from graphopt.data.metrics import compare
from graphopt.rewrites.fuse.rules.rms_norm import RmsNormStep
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(0)
D = 16


def _rms_model(opset: int, residual: bool = False) -> ir.Model:
    """y = RMSNorm(x [+ skip]) * w, written as exporters write it (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul)."""
    w = numpy_helper.from_array((1 + 0.1 * RNG.standard_normal(D)).astype(np.float32), "w")
    inits = [w, numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps")]
    inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))  # opset >= 18: axes as input
    nodes = [helper.make_node("Add", ["x", "skip"], ["h"], name="res")] if residual else []
    h = "h" if residual else "x"
    nodes += [
        helper.make_node("Pow", [h, "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="mean", keepdims=1, noop_with_empty_axes=0),
        helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
        helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
        helper.make_node("Reciprocal", ["rms"], ["inv"], name="recip"),
        helper.make_node("Mul", [h, "inv"], ["n"], name="norm"),
        helper.make_node("Mul", ["n", "w"], ["y"], name="scale"),
    ]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", D]) for n in (["x", "skip"] if residual else ["x"])]
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", D])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    onnx.checker.check_model(proto, full_check=True)
    return ir.serde.deserialize_model(proto)


def _feeds(model):
    return [{v.name: RNG.standard_normal((2, 5, D)).astype(np.float32) for v in model.graph.inputs}]


def _fuse(model):
    """The rules fuse runs for RMSNorm, then this step; returns (step result, step, op counts, max_abs)."""
    feeds = _feeds(model)
    ref = run(make_session(model, optimize=False), feeds)
    common_passes.ShapeInferencePass()(model)  # as fuse's preparation does: the rule checks dtypes
    assert rms_normalization.rms_normalization_ruleset.apply_to_model(model) == 1
    skip_normalization.skip_rms_normalization_ruleset.apply_to_model(model)
    step = RmsNormStep()
    n = step.apply_to_model(model)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)  # what failed before
    got = run(make_session(model, optimize=False), feeds)
    ops = collections.Counter(f"{node.domain}::{node.op_type}" if node.domain else node.op_type for node in model.graph)
    return n, step, ops, compare(got, ref, feeds).worst("max_abs")


def test_opset_23_gives_rms_normalization():
    model = _rms_model(23)
    n, step, ops, err = _fuse(model)
    (rms,) = list(model.graph)
    assert rms.domain == "" and rms.attributes.get_float("epsilon") == pytest.approx(1e-6)
    assert n == 1 and ops == {"RMSNormalization": 1}, ops
    assert err <= 1e-5 and step.expanded == 0


def test_below_23_left_as_standard_ops():
    n, step, ops, err = _fuse(_rms_model(20))
    assert n == 0 and step.expanded == 1
    assert ops == {"Pow": 1, "ReduceMean": 1, "Add": 1, "Sqrt": 1, "Reciprocal": 1, "Mul": 2, "Constant": 3}, ops
    assert "opset 20 < 23 has no RMSNormalization" in step.why_not(None)
    assert err <= 1e-6


def test_residual_rms_stays_skip_simplified_below_23():
    """The residual form is a real com.microsoft contrib op at any opset; only the plain form is rewritten."""
    n, step, ops, err = _fuse(_rms_model(20, residual=True))
    assert ops == {"com.microsoft::SkipSimplifiedLayerNormalization": 1}, ops
    assert n == 0 and step.expanded == 0
    assert err <= 1e-5


def _sln_model(opset: int, outputs=("y",)) -> ir.Model:
    """A bare ORT SimplifiedLayerNormalization (ONNX domain; ORT runs it, the ONNX checker rejects it)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D])
    w = numpy_helper.from_array((1 + 0.1 * RNG.standard_normal(D)).astype(np.float32), "w")
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], list(outputs), axis=-1, epsilon=1e-6, name="sln")
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", "seq", D if o == "y" else 1]) for o in outputs]
    graph = helper.make_graph([node], "g", [x], outs, [w])
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8))


@pytest.mark.parametrize("opset,outputs,want", [
    (17, ("y",), "opset 17 < 23 has no RMSNormalization"),  # ReduceMean takes axes as an attribute below 18
    (23, ("y", "inv"), "inverse-rms output is used"),  # RMSNormalization has no such output
])
def test_expanded_where_no_standard_op_fits(opset, outputs, want):
    model = _sln_model(opset, outputs)
    feeds = _feeds(model)
    ref = run(make_session(model, optimize=False), feeds)  # ORT runs its own op
    step = RmsNormStep()
    assert step.apply_to_model(model) == 0 and step.expanded == 1
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    assert [o.name for o in model.graph.outputs] == list(outputs)
    assert all(n.op_type != "SimplifiedLayerNormalization" for n in model.graph)
    got = run(make_session(model, optimize=False), feeds)
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-5
    assert want in step.why_not(model)

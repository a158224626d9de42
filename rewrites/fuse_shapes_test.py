"""Tests of the symbolic-shape preparation for fusion (``fuse_shapes``)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from graphopt.registry import create
from graphopt.rewrites.fuse_shapes import annotate_symbolic_shapes
from graphopt.runtime import make_session, run


def _label_lookup() -> ir.Model:
    """scikit-learn's label lookup as skl2onnx writes it: ArgMax -> ArrayFeatureExtractor over a 1-D
    class table -> Reshape [-1]. ORT's kernel returns [1, N] from the lookup; symbolic shape inference
    says [N], which made the Reshape look like an identity."""
    nodes = [
        helper.make_node("ArgMax", ["x"], ["idx"], axis=1, keepdims=0),
        helper.make_node("ArrayFeatureExtractor", ["classes", "idx"], ["z"], domain="ai.onnx.ml"),
        helper.make_node("Reshape", ["z", "flat"], ["y"]),
    ]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [None])],
        [numpy_helper.from_array(np.array([10, 20, 30], np.int64), "classes"),
         numpy_helper.from_array(np.array([-1], np.int64), "flat")],
    )
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)],
                              ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def test_refuses_models_with_ai_onnx_ml_ops():
    m = _label_lookup()
    reason = annotate_symbolic_shapes(m)
    assert reason is not None and "ArrayFeatureExtractor" in reason


def test_fuse_keeps_the_reshape_after_a_label_lookup():
    m = _label_lookup()
    feed = [{"x": np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)}]
    ref = run(make_session(m, optimize=False), feed)
    assert ref[0]["y"].shape == (5,)
    create("fuse", {})(m)
    assert [n.op_type for n in m.graph].count("Reshape") == 1
    got = run(make_session(m, optimize=False), feed)
    np.testing.assert_array_equal(got[0]["y"], ref[0]["y"])

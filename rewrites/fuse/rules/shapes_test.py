"""Tests of fuse_shapes: ORT's symbolic shapes written onto the values the fusion rules check."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnx import TensorProto, helper, numpy_helper

from graphopt.engine.registry import create
from graphopt.rewrites.fuse.rules.shapes import annotate_symbolic_shapes
from graphopt.runtime.session import make_session, run

D = 64


def _torchscript_reshape(opset: int = 17) -> ir.Model:
    """``Reshape(x, Concat(Shape(x)[0], Shape(x)[1], -1, 32))``: the target is computed at run time."""
    nodes = [helper.make_node("Shape", ["x"], ["sh"])]
    for i in (0, 1):
        nodes += [helper.make_node("Gather", ["sh", f"i{i}"], [f"d{i}"], axis=0),
                  helper.make_node("Unsqueeze", [f"d{i}", "axes0"], [f"u{i}"])]
    nodes += [helper.make_node("Concat", ["u0", "u1", "minus1", "c32"], ["target"], axis=0),
              helper.make_node("Reshape", ["x", "target"], ["r"]),
              helper.make_node("Relu", ["r"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array(1, np.int64), "i1"),
             numpy_helper.from_array(np.array([0], np.int64), "axes0"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(np.array([32], np.int64), "c32")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(proto)
    model = ir.serde.deserialize_model(proto)
    common_passes.ShapeInferencePass()(model)
    return model


def _value(model: ir.Model, name: str) -> ir.Value:
    return next(o for n in model.graph for o in n.outputs if o.name == name)


def _dims(value: ir.Value):
    return None if value.shape is None else [d if isinstance(d, int) else d.value for d in value.shape]


def test_run_time_reshape_target_gets_symbolic_shapes():
    model = _torchscript_reshape()
    # ONNX shape inference cannot evaluate the -1 of the computed target
    before = _dims(_value(model, "r"))
    assert before is None or before[2] != 2
    nodes = [(n.op_type, [v.name for v in n.inputs]) for n in model.graph]
    assert annotate_symbolic_shapes(model) is None
    assert _dims(_value(model, "r")) == ["B", "S", 2, 32]
    assert _dims(_value(model, "y")) == ["B", "S", 2, 32]
    assert _dims(_value(model, "target")) == [4]
    assert [(n.op_type, [v.name for v in n.inputs]) for n in model.graph] == nodes  # annotations only


def test_incomplete_inference_leaves_the_annotations_with_a_reason():
    model = _torchscript_reshape()
    r = _value(model, "r")
    custom = ir.node("Mystery", [r], domain="custom.domain", name="mystery")
    custom.outputs[0].name = "m"
    model.graph.append(custom)
    model.graph.outputs.append(custom.outputs[0])
    model.opset_imports["custom.domain"] = 1
    before = {o.name: _dims(o) for n in model.graph for o in n.outputs}
    reason = annotate_symbolic_shapes(model)
    assert reason == "symbolic shape inference failed: Incomplete symbolic shape inference"
    assert {o.name: _dims(o) for n in model.graph for o in n.outputs} == before


def test_opset_too_old_for_symbolic_inference():
    model = _torchscript_reshape()
    model.opset_imports[""] = 6  # ORT's symbolic inference declines opsets below 7
    before = _dims(_value(model, "r"))
    assert annotate_symbolic_shapes(model) == "symbolic shape inference returned nothing"
    assert _dims(_value(model, "r")) == before


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

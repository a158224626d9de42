"""Tests of fuse_residual_norm: Skip(Simplified)LayerNormalization -> Sum + (Simplified)LayerNormalization."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.analysis.fusion_status import fusion_status
from graphopt.data.metrics import compare
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.fuse.rules.residual_norm import ResidualNormStep
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(0)
D = 16


def _c(name, shape, scale=0.3, offset=0.0):
    return numpy_helper.from_array((offset + RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _model(op="SkipLayerNormalization", inputs=("x", "skip", "gamma", "beta", "bias"),
           outputs=("y",), graph_outputs=("y",), opset=17) -> ir.Model:
    inits = {"gamma": _c("gamma", (D,), 0.1, 1.0), "beta": _c("beta", (D,)), "bias": _c("bias", (D,))}
    nodes = [helper.make_node(op, list(inputs), list(outputs), domain=MS_DOMAIN, epsilon=1e-5, name="sln")]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", D]) for n in ("x", "skip")],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", "seq", D]) for o in graph_outputs],
        [inits[i] for i in inputs if i in inits],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)],
                              ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _feeds():
    return [{k: RNG.standard_normal((2, 5, D)).astype(np.float32) for k in ("x", "skip")}]


def _apply(model):
    feeds = _feeds()
    ref = run(make_session(model, optimize=False), feeds)
    step = ResidualNormStep()
    n = step.apply_to_model(model)
    got = run(make_session(model, optimize=False), feeds)
    ops = collections.Counter(node.op_type for node in model.graph)
    return n, step, ops, compare(got, ref, feeds).worst("max_abs")


@pytest.mark.parametrize("inputs", [
    ("x", "skip", "gamma", "beta", "bias"), ("x", "skip", "gamma", "beta"), ("x", "skip", "gamma"),
    ("x", "skip", "gamma", "", "bias"),
])
def test_skip_layernorm_to_sum(inputs):
    model = _model(inputs=inputs)
    n, _, ops, err = _apply(model)
    assert n == 1 and ops == {"Sum": 1, "LayerNormalization": 1}, ops
    (s,) = [node for node in model.graph if node.op_type == "Sum"]
    assert len(s.inputs) == (3 if "bias" in inputs else 2)
    assert [o.name for o in model.graph.outputs] == ["y"]
    assert fusion_status(model)["fully_fused"]
    assert err <= 1e-5


def test_skip_simplified_to_sum_and_rms_normalization():
    """At opset 23 the simplified form becomes Sum + the ONNX RMSNormalization (checker-valid)."""
    model = _model(op="SkipSimplifiedLayerNormalization", inputs=("x", "skip", "gamma", "bias"), opset=23)
    n, _, ops, err = _apply(model)
    assert n == 1 and ops == {"Sum": 1, "RMSNormalization": 1}, ops
    assert next(node for node in model.graph if node.op_type == "RMSNormalization").domain == ""
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    assert fusion_status(model)["fully_fused"]
    assert err <= 1e-5


def test_skip_simplified_kept_below_opset_23():
    """Below 23 there is no ONNX RMSNormalization (ORT's SimplifiedLayerNormalization is not ONNX): kept fused."""
    model = _model(op="SkipSimplifiedLayerNormalization", inputs=("x", "skip", "gamma", "bias"), opset=20)
    n, step, ops, err = _apply(model)
    assert n == 0 and ops == {"SkipSimplifiedLayerNormalization": 1}, ops
    assert "opset 20 < 23 has no RMSNormalization" in step.why_not(model)
    assert err == 0


def test_sum_output_kept_for_pre_ln():
    """Output 3 (input + skip + bias, the next residual of a pre-LN model) becomes the Sum's output."""
    model = _model(outputs=("y", "", "", "s"), graph_outputs=("y", "s"))
    n, _, ops, err = _apply(model)
    assert n == 1 and ops == {"Sum": 1, "LayerNormalization": 1}, ops
    assert [o.name for o in model.graph.outputs] == ["y", "s"]
    assert model.graph.outputs[1].producer().op_type == "Sum"
    assert err <= 1e-5


def test_refuses_used_mean():
    model = _model(outputs=("y", "mean"), graph_outputs=("y", "mean"))
    n, step, ops, err = _apply(model)
    assert n == 0 and ops == {"SkipLayerNormalization": 1}
    assert "output 1 (mean) is used" in step.why_not(model)
    assert err == 0


def test_refuses_old_opset():
    model = _model(opset=16)
    n, step, ops, _ = _apply(model)
    assert n == 0 and ops == {"SkipLayerNormalization": 1}
    assert "opset 16 < 17" in step.why_not(model)


def test_ort_does_not_refuse_it_back(tmp_path):
    """The reason for Sum and not Add: ORT_ENABLE_ALL re-fuses Add -> LayerNormalization into
    SkipLayerNormalization when shapes are known, but leaves Sum + LayerNormalization alone."""
    import onnxruntime as ort

    from graphopt.runtime.session import session_options

    model = _model()
    ResidualNormStep().apply_to_model(model)
    so = session_options(threads=1)
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    assert ops == {"Sum": 1, "LayerNormalization": 1}, ops

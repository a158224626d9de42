"""Tests of decomposed LayerNorm fusion in ``fuse``: variants, refusals, and the SkipLayerNorm after it."""

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
D = 16


def _c(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _ln_nodes(x: str, y: str, *, opset: int, square: str = "pow", divide: bool = True, bias: bool = True,
              axes=(-1,), eps_name: str = "eps") -> list:
    def mean(src, dst):
        if opset >= 18:
            return helper.make_node("ReduceMean", [src, "axes"], [dst], keepdims=1)
        return helper.make_node("ReduceMean", [src], [dst], axes=list(axes), keepdims=1)

    nodes = [
        mean(x, "mean"),
        helper.make_node("Sub", [x, "mean"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["sq"]) if square == "pow" else helper.make_node("Mul", ["d", "d"], ["sq"]),
        mean("sq", "var"),
        helper.make_node("Add", ["var", eps_name], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
    ]
    if divide:
        nodes.append(helper.make_node("Div", ["d", "s"], ["n"]))
    else:
        nodes += [helper.make_node("Reciprocal", ["s"], ["r"]), helper.make_node("Mul", ["d", "r"], ["n"])]
    nodes.append(helper.make_node("Mul", ["n", "gamma"], ["g" if bias else y]))
    if bias:
        nodes.append(helper.make_node("Add", ["g", "beta"], [y]))
    return nodes


def _model(*, opset=17, residual=False, extra_output=None, axes=(-1,), gamma_shape=(D,), **kw) -> ir.Model:
    nodes = []
    src = "x"
    if residual:  # x + skip, then LayerNorm: SkipLayerNormalization after the LayerNorm fusion
        nodes.append(helper.make_node("Add", ["x", "skip"], ["xs"]))
        src = "xs"
    nodes += _ln_nodes(src, "y", opset=opset, axes=axes, **kw)
    inits = [
        _c("axes", list(axes), np.int64), _c("two", 2.0), _c("eps", 1e-5),
        _c("gamma", 1 + 0.1 * RNG.standard_normal(gamma_shape)), _c("beta", 0.1 * RNG.standard_normal(D)),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D])]
    if residual:
        inputs.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", "seq", D]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", D])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, ["batch", "seq", 1]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _fuse(model, provider="cpu"):
    feeds = [{"x": RNG.standard_normal((2, 5, D)).astype(np.float32),
              "skip": RNG.standard_normal((2, 5, D)).astype(np.float32)}]
    ref = run(make_session(model, optimize=False), feeds)
    p = registry.create("fuse")
    result = p(model, PassContext(explain=True, provider=provider))
    got = run(make_session(result.model, optimize=False), feeds)
    return result, collections.Counter(n.op_type for n in result.model.graph), compare(got, ref, feeds)


@pytest.mark.parametrize("opset,square,divide,bias", [
    (17, "pow", True, True), (18, "pow", True, True), (17, "mul", True, True),
    (18, "mul", False, True), (17, "pow", True, False),
])
def test_decomposed_layernorm_fused(opset, square, divide, bias):
    result, ops, cmp = _fuse(_model(opset=opset, square=square, divide=divide, bias=bias))
    assert ops == {"LayerNormalization": 1}, ops
    assert result.modified and cmp.worst("max_abs") <= 1e-5


def test_then_skip_layernorm():
    """The residual LayerNorm: SkipLayerNormalization for CUDA, Sum + LayerNormalization for CPU."""
    result, ops, cmp = _fuse(_model(residual=True))
    assert ops == {"Sum": 1, "LayerNormalization": 1}, ops
    assert cmp.worst("max_abs") <= 1e-5
    result, ops, cmp = _fuse(_model(residual=True), provider="cuda")
    assert ops == {"SkipLayerNormalization": 1}, ops
    assert cmp.worst("max_abs") <= 1e-5


def _unfused(model):
    result, ops, cmp = _fuse(model)
    assert ops["LayerNormalization"] == 0 and ops["ReduceMean"] == 2, ops
    assert cmp.worst("max_abs") == 0
    return result


def test_refuses_intermediate_used_outside():
    _unfused(_model(extra_output="var"))


def test_refuses_other_axis():
    _unfused(_model(axes=(1,)))


def test_refuses_old_opset():
    _unfused(_model(opset=16))


def test_refuses_gamma_of_other_shape():
    _unfused(_model(gamma_shape=(1, 5, D)))


def test_refusal_reason_is_explained():
    from graphopt.rewrites.fuse import _why_not
    from graphopt.rewrites.fuse.rules.layernorm import layer_norm_rules

    model = _model(axes=(1,))
    why = _why_not(layer_norm_rules, model, "layer_normalization")
    assert why and "not just the last one" in why, why

"""Tests of fuse_mha: onnxscript's MultiHeadAttention rule, keeping a final reshape not to ``[B, S, D]``."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter.ort_fusions import sdpa

from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites import fuse
from graphopt.rewrites.fuse.rules import mha as fuse_mha
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(0)
D, H, DH = 8, 2, 4


def _attention_model(target: list[int]) -> ir.Model:
    """x ─MatMul─Reshape─Transpose (q, k, v) ─ q·kᵀ·scale ─ Softmax ─ ·v ─ Transpose ─ Reshape(target) ─ y."""
    inits = [
        numpy_helper.from_array(np.array([0, 0, H, DH], np.int64), "shape4"),
        numpy_helper.from_array(np.array(target, np.int64), "target"),
        numpy_helper.from_array(np.array(1 / np.sqrt(DH), np.float32), "scale"),
    ]
    nodes = []
    for n in "qkv":
        inits.append(numpy_helper.from_array((RNG.standard_normal((D, D)) * 0.3).astype(np.float32), f"W{n}"))
        nodes += [
            helper.make_node("MatMul", ["x", f"W{n}"], [f"{n}_p"]),
            helper.make_node("Reshape", [f"{n}_p", "shape4"], [f"{n}_r"]),
            helper.make_node("Transpose", [f"{n}_r"], [f"{n}_t"], perm=[0, 2, 3, 1] if n == "k" else [0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("MatMul", ["q_t", "k_t"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v_t"], ["o"]),
        helper.make_node("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["o_t", "target"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * len(target))], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _fuse_mha(model: ir.Model) -> int:
    assert fuse._prepare(model) is None
    assert sdpa.sdpa_rules.apply_to_model(model) == 1
    return fuse_mha.mha_rules_no_past.apply_to_model(model)


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    return run(make_session(model, optimize=False), [{"x": x}])[0]["y"]


@pytest.mark.parametrize(
    ("target", "trailing_reshape", "shape"),
    [([0, 0, D], False, (2, 5, D)),  # [B, S, D]: the MultiHeadAttention output is y
     ([-1, D], True, (10, D))],  # [B*S, D] (GPT-2's Conv1D): Reshape(mha, target) keeps y's shape
)
def test_fused_with_or_without_the_final_reshape(target, trailing_reshape, shape):
    x = RNG.standard_normal((2, 5, D)).astype(np.float32)
    model = _attention_model(target)
    want = _run(model, x)
    assert _fuse_mha(model) == 1
    ops = [(n.domain, n.op_type) for n in model.graph]
    assert ops.count((MS_DOMAIN, "MultiHeadAttention")) == 1
    assert ("", "Softmax") not in ops and ("", "Transpose") not in ops
    assert (ops[-1] == ("", "Reshape")) is trailing_reshape
    got = _run(model, x)
    assert got.shape == want.shape == shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_refuses_when_the_query_shape_is_unknown():
    """The upstream refusal: without a known ``[B, S, D]`` query shape nothing is fused, and --explain says why."""
    model = _attention_model([-1, D])
    fuse._prepare(model)
    assert sdpa.sdpa_rules.apply_to_model(model) == 1
    q = next(n for n in model.graph if n.outputs[0].name == "q_p").outputs[0]
    q.shape = None  # what a TorchScript export leaves when symbolic shape inference fails
    before = [n.op_type for n in model.graph]
    assert fuse_mha.mha_rules_no_past.apply_to_model(model) == 0
    assert [n.op_type for n in model.graph] == before
    why = fuse._why_not(fuse_mha.mha_rules_no_past, model, "mha2")
    assert why is not None and "Shape mismatch" in why and "q_p" in why


def _value(shape) -> ir.Value:
    return ir.Value(name="v", shape=None if shape is None else ir.Shape(shape))


@pytest.mark.parametrize(
    ("y", "query", "bsd"),
    [(["B", "S", 8], ["B", "S", 8], True),
     ([2, 5, 8], [2, 5, 8], True),
     (["B", "S", 8], ["B", "T", 8], False),  # another sequence length
     ([2, 5, 8], [2, 4, 8], False),
     ([None, "S", 8], [None, "S", 8], False),  # an unnamed dim proves nothing
     (["B*S", 8], ["B", "S", 8], False),  # rank 2
     (None, ["B", "S", 8], False)],
)
def test_is_bsd(y, query, bsd):
    assert fuse_mha._is_bsd(_value(y), _value(query)) is bsd

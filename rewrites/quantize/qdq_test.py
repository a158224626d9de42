"""Tests of qdq and targets: quantization targets, the numeric helpers, and each integer replacement in ORT."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import make_shared_matmuls

from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.quantize import int4, numeric, qdq
from graphopt.rewrites.quantize import targets as targets_mod
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(3)
X = RNG.standard_normal((2, 5, 8)).astype(np.float32)
#: the int8 weight storage the pass chooses for u8 activations on this CPU (s8 where ORT's kernel is exact)
WEIGHTS = numeric.int8_weights("u8")[0]


def _model() -> ir.Model:
    return ir.serde.deserialize_model(make_shared_matmuls())


def _outputs(model: ir.Model) -> dict[str, np.ndarray]:
    return run(make_session(model, optimize=False), [{"x": X}])[0]


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter((n.domain, n.op_type) for n in model.graph)


def test_find_targets_matmuls_with_their_bias():
    targets = targets_mod.find_targets(_model())
    assert [(t.key, t.kind, t.act.name, t.weight.name) for t in targets] == [
        ("mm1", "matmul", "a", "w1"), ("mm2", "matmul", "a", "w2")]
    assert targets[0].bias_add.name == "add1" and targets[1].bias_add is None
    assert targets[0].macs_per_row == 8 * 16


def test_find_targets_refusals():
    model = _model()
    # a weight computed at run time is no target; nor is a weight that is not 2-D float
    w2 = model.graph.initializers["w2"]
    neg = ir.node("Neg", [w2], name="neg")
    model.graph.insert_before(model.graph.node("mm2"), neg)
    model.graph.node("mm2").replace_input_with(1, neg.outputs[0])
    assert [t.key for t in targets_mod.find_targets(model)] == ["mm1"]
    model.graph.initializers["w1"].const_value = ir.tensor(np.ones((8, 16), np.float64), name="w1")
    assert targets_mod.find_targets(model) == []


def test_quantize_weight_per_column():
    w = RNG.standard_normal((8, 3)).astype(np.float32)
    q, scale = numeric.quantize_weight(w)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    np.testing.assert_allclose(scale, np.abs(w).max(axis=0) / 127, rtol=1e-6)
    assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-7)


def test_act_qparams_and_fake_quant():
    s, zp = numeric.act_qparams(-1.0, 3.0, "u8")
    assert s == pytest.approx(4 / 255) and zp.dtype == np.uint8 and int(zp) == 64
    s8, zp8 = numeric.act_qparams(-1.0, 3.0, "s8")
    assert s8 == pytest.approx(3 / 127) and zp8.dtype == np.int8 and int(zp8) == 0
    assert numeric.act_qparams(0.5, 2.0, "u8")[1] == 0  # the range always includes 0
    x = RNG.uniform(-1, 3, 1000).astype(np.float32)
    assert np.abs(numeric.fake_quant_act(x, -1.0, 3.0) - x).max() <= s / 2 + 1e-6
    clipped = numeric.fake_quant_act(np.array([10.0], np.float32), -1.0, 3.0)
    assert clipped[0] == pytest.approx((255 - 64) * s)  # outside the range: clipped to the top level


def _apply(cfg: targets_mod.QConfig) -> tuple[ir.Model, dict[str, int], dict, dict]:
    model = _model()
    want = _outputs(model)
    plan = {"mm1": cfg, "mm2": cfg}
    counts = qdq.apply(model, targets_mod.find_targets(model), plan)
    return model, counts, want, _outputs(model)


def _close(got, want, tol):
    for k in want:
        err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
        assert err < tol, (k, err)


@pytest.mark.parametrize("weights", sorted({WEIGHTS, "u8", "s7"}))
def test_dynamic_qop(weights):
    model, counts, want, got = _apply(targets_mod.QConfig(mode="dynamic", weights=weights))
    assert counts == {"DynamicQuantizeMatMul": 2}
    ops = _ops(model)
    assert ops[(MS_DOMAIN, "DynamicQuantizeMatMul")] == 2 and ("", "MatMul") not in ops and ("", "Add") not in ops
    assert model.opset_imports[MS_DOMAIN] == 1
    assert not {"w1", "w2", "b1"} & set(model.graph.initializers)  # float weights dropped
    node = next(n for n in model.graph if n.op_type == "DynamicQuantizeMatMul")
    q, zp = node.inputs[1].const_value.numpy(), node.inputs[3]
    if weights == "s8":  # as always: no zero point
        assert q.dtype == np.int8 and np.abs(q).max() == 127 and zp is None
    elif weights == "u8":  # the int8 values + 128, zero point 128
        assert q.dtype == np.uint8 and np.all(zp.const_value.numpy() == 128)
        assert np.abs(q.astype(np.int16) - 128).max() == 127
    else:
        assert q.dtype == np.int8 and np.abs(q).max() == 64 and zp is None
    _close(got, want, 0.03)


def test_int8_weights_follow_the_kernel_probe():
    saturates = lambda a, b: (a, b) != ("u8", "s8")  # noqa: E731 - a CPU without VNNI
    assert numeric.int8_weights("u8", lambda a, b: True) == ("s8", "")  # exact kernel: as always
    w, why = numeric.int8_weights("u8", saturates)
    assert w == "u8" and "saturates" in why and "zero point 128" in why
    assert numeric.int8_weights("s8", saturates) == ("s8", "")  # s8 x s8 exact
    w, why = numeric.int8_weights("u8", lambda a, b: False)
    assert w == "s7" and "reduce_range" in why
    q = np.array([[-127, 0, 127]], np.int8)
    stored, zp = numeric.store_weight(q, "u8")
    assert stored.dtype == np.uint8 and np.array_equal(stored.astype(np.int16) - zp, q)
    assert numeric.store_weight(q, "s8") == (q, None)


@pytest.mark.parametrize(("fmt", "op"), [("qop", (MS_DOMAIN, "MatMulIntegerToFloat")), ("qdq", ("", "MatMul"))])
def test_static_shares_one_quantize_linear(fmt, op):
    a = X * np.array([20.0] + [1.0] * 7, np.float32)
    cfg = targets_mod.QConfig(mode="static", act_range=(float(a.min()), float(a.max())), fmt=fmt, weights=WEIGHTS)
    model, counts, want, got = _apply(cfg)
    ops = _ops(model)
    assert ops[("", "QuantizeLinear")] == 1 and ops[op] == 2
    assert sum(counts.values()) == 2
    _close(got, want, 0.06)


def test_int4_matches_the_dequantized_weight():
    """MatMulNBits at accuracy level 0 computes in float: x @ dequant(q) exactly (to float rounding)."""
    cfg = targets_mod.QConfig(mode="int4", block_size=16, accuracy_level=0)
    model, counts, want, got = _apply(cfg)
    assert counts == {"MatMulNBits": 2} and _ops(model)[(MS_DOMAIN, "MatMulNBits")] == 2
    src = _model().graph.initializers
    a = X * np.array([20.0] + [1.0] * 7, np.float32)
    w2 = src["w2"].const_value.numpy()
    np.testing.assert_allclose(got["z"], a @ int4.dequant_int4(*int4.rtn_int4(w2, 16), 16, 8), rtol=1e-4, atol=1e-4)
    _close(got, want, 0.15)


def test_smooth_scales_the_weight_rows():
    """QConfig.smooth multiplies W's rows (the activation is divided upstream): here by 1, so no change."""
    cfg = targets_mod.QConfig(mode="dynamic", smooth=np.ones(8, np.float32), weights=WEIGHTS)
    _, _, want, got = _apply(cfg)
    _close(got, want, 0.03)
    cfg = targets_mod.QConfig(mode="dynamic", smooth=np.full(8, 2.0, np.float32), weights=WEIGHTS)
    _, _, want, got = _apply(cfg)
    _close({"z": got["z"]}, {"z": 2 * want["z"]}, 0.03)


def _matmul_then(node, name: str, *, seed: int, residual: bool = False) -> ir.Model:
    """x -> MatMul(w) -> ``node`` (reading h and the bias b; with ``residual``, also a graph input r) -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 8])]
    if residual:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 5, 16]))
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), node], name, inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 16])],
        [numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
    return ir.serde.deserialize_model(m)


def _matmul_biasgelu() -> ir.Model:
    """x -> MatMul(w) -> com.microsoft BiasGelu(b) -> y."""
    from onnx import helper

    return _matmul_then(helper.make_node("BiasGelu", ["h", "b"], ["y"], domain=MS_DOMAIN, name="bg"),
                        "mm-biasgelu", seed=5)


@pytest.mark.parametrize("cfg", [
    targets_mod.QConfig(mode="static", act_range=(float(X.min()), float(X.max())), weights=WEIGHTS),
    targets_mod.QConfig(mode="dynamic", weights=WEIGHTS),
    targets_mod.QConfig(mode="int4", block_size=16, accuracy_level=0),
], ids=["static", "dynamic", "int4"])
def test_biasgelu_bias_goes_into_the_integer_op(cfg):
    """MatMul -> BiasGelu: the bias moves into the integer op and BiasGelu becomes Gelu, with the same
    outputs as leaving BiasGelu after the integer op (the fold is exact)."""
    model = _matmul_biasgelu()
    targets = targets_mod.find_targets(model)
    assert targets[0].bias_gelu is not None and targets[0].bias_gelu.name == "bg"
    counts = qdq.apply(model, targets, {"mm": cfg})
    ops = _ops(model)
    assert counts["BiasGelu->Gelu"] == 1
    assert ops[(MS_DOMAIN, "Gelu")] == 1 and (MS_DOMAIN, "BiasGelu") not in ops and ("", "MatMul") not in ops
    integer = next(n for n in model.graph if n.domain == MS_DOMAIN and n.op_type != "Gelu")
    assert integer.inputs[-1] is not None and integer.inputs[-1].const_value is not None  # the bias
    got = run(make_session(model, optimize=False), [{"x": X}])[0]["y"]
    # reference: the same quantization with BiasGelu left in place
    unfolded = _matmul_biasgelu()
    t = targets_mod.find_targets(unfolded)
    t[0].bias_gelu = None
    qdq.apply(unfolded, t, {"mm": cfg})
    assert _ops(unfolded)[(MS_DOMAIN, "BiasGelu")] == 1
    want = run(make_session(unfolded, optimize=False), [{"x": X}])[0]["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_biasgelu_stays_in_qdq_form():
    model = _matmul_biasgelu()
    cfg = targets_mod.QConfig(mode="static", act_range=(float(X.min()), float(X.max())), fmt="qdq", weights=WEIGHTS)
    qdq.apply(model, targets_mod.find_targets(model), {"mm": cfg})
    ops = _ops(model)
    assert ops[(MS_DOMAIN, "BiasGelu")] == 1 and ops[("", "MatMul")] == 1 and (MS_DOMAIN, "Gelu") not in ops


def test_gathered_rows_are_dequantized_by_cast_and_mul():
    """An int8 embedding table: Gather(int8) -> Cast -> Mul(scale), equal to DequantizeLinear(axis=-1)."""
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(6).standard_normal((10, 8)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["t", "ids"], ["y"], name="emb")], "emb",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8])],
                          [numpy_helper.from_array(table, "t")])
    model = ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    qdq.apply(model, targets_mod.find_targets(model, embeddings=True), {"emb": targets_mod.QConfig("gather")})
    assert [n.op_type for n in model.graph] == ["Gather", "Cast", "Mul"]
    ids = np.array([[0, 3, 9], [1, 1, 2]], np.int64)
    got = run(make_session(model, optimize=False), [{"ids": ids}])[0]["y"]
    q, s = numeric.quantize_weight(table, axis=1)
    np.testing.assert_array_equal(got, q[ids].astype(np.float32) * s)


def _matmul_sum() -> ir.Model:
    """x -> MatMul(w) -> Sum(·, r, b) -> y (the residual form of ``fuse`` on CPU)."""
    from onnx import helper

    return _matmul_then(helper.make_node("Sum", ["h", "r", "b"], ["y"], name="res"), "mm-sum", seed=8,
                        residual=True)


@pytest.mark.parametrize("cfg", [
    targets_mod.QConfig(mode="static", act_range=(float(X.min()), float(X.max())), weights=WEIGHTS),
    targets_mod.QConfig(mode="dynamic", weights=WEIGHTS),
], ids=["static", "dynamic"])
def test_residual_sum_bias_goes_into_the_integer_op(cfg):
    model = _matmul_sum()
    targets = targets_mod.find_targets(model)
    assert targets[0].bias_sum is not None and targets[0].bias_sum.name == "res"
    counts = qdq.apply(model, targets, {"mm": cfg})
    assert counts["Sum bias->integer op"] == 1
    s = next(n for n in model.graph if n.op_type == "Sum")
    assert len(s.inputs) == 2 and "b" not in model.graph.initializers
    feed = {"x": X, "r": RNG.standard_normal((2, 5, 16)).astype(np.float32)}
    got = run(make_session(model, optimize=False), [feed])[0]["y"]
    unfolded = _matmul_sum()
    t = targets_mod.find_targets(unfolded)
    t[0].bias_sum = None
    qdq.apply(unfolded, t, {"mm": cfg})
    assert len(next(n for n in unfolded.graph if n.op_type == "Sum").inputs) == 3
    want = run(make_session(unfolded, optimize=False), [feed])[0]["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

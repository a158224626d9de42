"""Tests of _quant_qdq: quantization targets, the numeric helpers, and each integer replacement in ORT."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import make_shared_matmuls

from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites import _quant_int4 as int4
from graphopt.rewrites import _quant_qdq as qdq
from graphopt.runtime import make_session, run

RNG = np.random.default_rng(3)
X = RNG.standard_normal((2, 5, 8)).astype(np.float32)


def _model() -> ir.Model:
    return ir.serde.deserialize_model(make_shared_matmuls())


def _outputs(model: ir.Model) -> dict[str, np.ndarray]:
    return run(make_session(model, optimize=False), [{"x": X}])[0]


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter((n.domain, n.op_type) for n in model.graph)


def test_find_targets_matmuls_with_their_bias():
    targets = qdq.find_targets(_model())
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
    assert [t.key for t in qdq.find_targets(model)] == ["mm1"]
    model.graph.initializers["w1"].const_value = ir.tensor(np.ones((8, 16), np.float64), name="w1")
    assert qdq.find_targets(model) == []


def test_quantize_weight_per_column():
    w = RNG.standard_normal((8, 3)).astype(np.float32)
    q, scale = qdq.quantize_weight(w)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    np.testing.assert_allclose(scale, np.abs(w).max(axis=0) / 127, rtol=1e-6)
    assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-7)


def test_act_qparams_and_fake_quant():
    s, zp = qdq.act_qparams(-1.0, 3.0, "u8")
    assert s == pytest.approx(4 / 255) and zp.dtype == np.uint8 and int(zp) == 64
    s8, zp8 = qdq.act_qparams(-1.0, 3.0, "s8")
    assert s8 == pytest.approx(3 / 127) and zp8.dtype == np.int8 and int(zp8) == 0
    assert qdq.act_qparams(0.5, 2.0, "u8")[1] == 0  # the range always includes 0
    x = RNG.uniform(-1, 3, 1000).astype(np.float32)
    assert np.abs(qdq.fake_quant_act(x, -1.0, 3.0) - x).max() <= s / 2 + 1e-6
    clipped = qdq.fake_quant_act(np.array([10.0], np.float32), -1.0, 3.0)
    assert clipped[0] == pytest.approx((255 - 64) * s)  # outside the range: clipped to the top level


def _apply(cfg: qdq.QConfig) -> tuple[ir.Model, dict[str, int], dict, dict]:
    model = _model()
    want = _outputs(model)
    plan = {"mm1": cfg, "mm2": cfg}
    counts = qdq.apply(model, qdq.find_targets(model), plan)
    return model, counts, want, _outputs(model)


def _close(got, want, tol):
    for k in want:
        err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
        assert err < tol, (k, err)


def test_dynamic_qop():
    model, counts, want, got = _apply(qdq.QConfig(mode="dynamic"))
    assert counts == {"DynamicQuantizeMatMul": 2}
    ops = _ops(model)
    assert ops[(MS_DOMAIN, "DynamicQuantizeMatMul")] == 2 and ("", "MatMul") not in ops and ("", "Add") not in ops
    assert model.opset_imports[MS_DOMAIN] == 1
    assert not {"w1", "w2", "b1"} & set(model.graph.initializers)  # float weights dropped
    _close(got, want, 0.03)


@pytest.mark.parametrize(("fmt", "op"), [("qop", (MS_DOMAIN, "MatMulIntegerToFloat")), ("qdq", ("", "MatMul"))])
def test_static_shares_one_quantize_linear(fmt, op):
    a = X * np.array([20.0] + [1.0] * 7, np.float32)
    cfg = qdq.QConfig(mode="static", act_range=(float(a.min()), float(a.max())), fmt=fmt)
    model, counts, want, got = _apply(cfg)
    ops = _ops(model)
    assert ops[("", "QuantizeLinear")] == 1 and ops[op] == 2
    assert sum(counts.values()) == 2
    _close(got, want, 0.06)


def test_int4_matches_the_dequantized_weight():
    """MatMulNBits at accuracy level 0 computes in float: x @ dequant(q) exactly (to float rounding)."""
    cfg = qdq.QConfig(mode="int4", block_size=16, accuracy_level=0)
    model, counts, want, got = _apply(cfg)
    assert counts == {"MatMulNBits": 2} and _ops(model)[(MS_DOMAIN, "MatMulNBits")] == 2
    src = _model().graph.initializers
    a = X * np.array([20.0] + [1.0] * 7, np.float32)
    w2 = src["w2"].const_value.numpy()
    np.testing.assert_allclose(got["z"], a @ int4.dequant_int4(*int4.rtn_int4(w2, 16), 16, 8), rtol=1e-4, atol=1e-4)
    _close(got, want, 0.15)


def test_smooth_scales_the_weight_rows():
    """QConfig.smooth multiplies W's rows (the activation is divided upstream): here by 1, so no change."""
    cfg = qdq.QConfig(mode="dynamic", smooth=np.ones(8, np.float32))
    _, _, want, got = _apply(cfg)
    _close(got, want, 0.03)
    cfg = qdq.QConfig(mode="dynamic", smooth=np.full(8, 2.0, np.float32))
    _, _, want, got = _apply(cfg)
    _close({"z": got["z"]}, {"z": 2 * want["z"]}, 0.03)

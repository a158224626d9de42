"""Tests of _quant_smooth: SmoothQuant factors, alpha choice, and dividing the activation (fold or Mul)."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import make_shared_matmuls

from graphopt.rewrites import _quant_calib as calib
from graphopt.rewrites import _quant_qdq as qdq
from graphopt.rewrites import _quant_smooth as smooth
from graphopt.runtime import make_session, run

RNG = np.random.default_rng(4)
X = RNG.standard_normal((2, 5, 8)).astype(np.float32)


def _stats(model: ir.Model) -> calib.Stats:
    return calib.collect(model, [{"x": X}], ["a"])["a"]


def _outputs(model: ir.Model) -> dict[str, np.ndarray]:
    return run(make_session(model, optimize=False), [{"x": X}])[0]


def test_smooth_factors_formula_and_clip():
    stats = calib.Stats(chan_min=np.array([-4.0, -1.0, 0.0]), chan_max=np.array([1.0, 9.0, 1e-9]))
    w1 = np.array([[1.0, -2.0], [0.5, 0.5], [1.0, 1.0]], np.float32)
    w2 = np.array([[0.25], [-3.0], [1.0]], np.float32)
    s = smooth.smooth_factors(stats, [w1, w2], alpha=0.5)
    amax, wmax = np.array([4.0, 9.0, 1e-5]), np.array([2.0, 3.0, 1.0])
    np.testing.assert_allclose(s, np.clip(np.sqrt(amax) / np.sqrt(wmax), 1e-3, 1e3), rtol=1e-6)
    assert s[2] == pytest.approx(np.sqrt(1e-5))
    big = calib.Stats(chan_min=np.array([-1e9]), chan_max=np.array([1e9]))
    assert smooth.smooth_factors(big, [np.ones((1, 1), np.float32)], alpha=1.0)[0] == pytest.approx(1e3)


def test_smoothing_lowers_the_error_of_an_outlier_channel():
    model = ir.serde.deserialize_model(make_shared_matmuls())
    stats = _stats(model)
    group = [t for t in qdq.find_targets(model) if t.act.name == "a"]
    w = group[0].weight_array
    s, alpha = smooth.choose(stats, group, "auto", static=False)
    assert alpha in smooth.ALPHAS
    plain = smooth.local_error(stats.rows, w, None, None)
    assert smooth.local_error(stats.rows, w, s, None) < plain
    # auto picks the alpha with the least summed error over the layers reading the activation
    weights = [t.weight_array for t in group]

    def total(a: float) -> float:
        return sum(smooth.local_error(stats.rows, wi, smooth.smooth_factors(stats, weights, a), None) for wi in weights)

    assert total(alpha) == min(total(a) for a in smooth.ALPHAS)
    s_fixed, a_fixed = smooth.choose(stats, group, "0.5", static=False)
    assert a_fixed == 0.5 and np.array_equal(s_fixed, smooth.smooth_factors(stats, weights, 0.5))


def _smooth(layernorm: bool, ln_is_output: bool = False):
    model = ir.serde.deserialize_model(make_shared_matmuls(layernorm=layernorm))
    if ln_is_output:
        model.graph.outputs.append(model.graph.node("ln").outputs[0])
    want = _outputs(model)
    targets = qdq.find_targets(model)
    s = np.linspace(0.5, 4.0, 8).astype(np.float32)
    counts = smooth.apply_smoothing(model, targets, {"a": s})
    for t in targets:  # what _quant_qdq.apply does with QConfig.smooth
        t.weight.const_value = ir.tensor(t.weight_array * s.reshape(-1, 1), name=t.weight.name)
    return model, targets, counts, want, s


def test_mul_when_the_producer_cannot_absorb_it():
    model, targets, counts, want, s = _smooth(layernorm=False)
    assert counts == {"smooth-mul": 1}
    mul = model.graph.node("a_smooth")
    assert mul.op_type == "Mul" and all(t.act is mul.outputs[0] for t in targets)
    np.testing.assert_allclose(mul.inputs[1].const_value.numpy(), 1 / s, rtol=1e-6)
    got = _outputs(model)
    for k in want:  # x / s then diag(s) W: the same in float
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_folded_into_layernorm():
    model, targets, counts, want, s = _smooth(layernorm=True)
    assert counts == {"smooth-fold-layernorm": 1}
    assert collections.Counter(n.op_type for n in model.graph)["Mul"] == 1  # only the model's own outlier Mul
    assert all(t.act.name == "a" for t in targets)
    got = _outputs(model)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_not_folded_when_the_layernorm_output_is_read_elsewhere():
    model, targets, counts, want, _ = _smooth(layernorm=True, ln_is_output=True)
    assert counts == {"smooth-mul": 1}
    got = _outputs(model)
    for k in want:  # the LayerNorm output itself is unchanged
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4)

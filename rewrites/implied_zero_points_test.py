"""Tests of ``implied-zero-points``: the exact Q4_1 chain read with ONNX Runtime's implied zero point 8."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from graphopt.engine.registry import PassContext, create
from graphopt.rewrites import implied_zero_points as izp
from graphopt.rewrites.quantize import blocks8
from graphopt.rewrites.quantize.blocks8_test import K, N, _q41, _q41_graph
from graphopt.runtime.session import make_session


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


@pytest.mark.parametrize("level", [0, 1])
def test_the_chain_without_zero_points_is_the_same_function(level):
    rng = np.random.default_rng(3)
    q, d, m = _q41(rng)
    model = _q41_graph(q, d, m)
    for n in model.graph:
        if n.op_type == "MatMulNBits":
            n.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", level)
    xs = [rng.standard_normal((1, 1, K)).astype(np.float32), np.zeros((1, 1, K), np.float32),
          np.full((1, 1, K), 1e4, np.float32)]
    before = make_session(model, optimize=False)
    refs = [before.run(None, {"x": x})[0] for x in xs]
    assert izp.drop_zero_points(model) == 1
    nbn = next(n for n in model.graph if n.op_type == "MatMulNBits")
    assert len(nbn.inputs) == 3 and "zp" not in model.graph.initializers and "m" not in model.graph.initializers
    assert _ops(model) == {"MatMulNBits": 1, "Reshape": 1, "ReduceSum": 1, "MatMul": 1, "Add": 1}
    after = make_session(model, optimize=False)
    for x, ref in zip(xs, refs):
        got = after.run(None, {"x": x})[0]
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(ref).max())))
    w = (d * q + m).reshape(K, N)  # fp32 activations: the Q4_1 weight itself
    np.testing.assert_allclose(after.run(None, {"x": xs[0]})[0][0, 0], xs[0][0, 0] @ w, rtol=1e-4, atol=1e-5)
    assert izp.drop_zero_points(model) == 0  # nothing left to rewrite


def test_nonzero_zero_points_and_plain_graphs_are_left_alone():
    rng = np.random.default_rng(4)
    model = _q41_graph(*_q41(rng))
    zp = model.graph.initializers["zp"]
    zp.const_value = ir.tensor(np.full(zp.shape[0], 0x88, np.uint8), name="zp")
    assert izp.drop_zero_points(model) == 0
    res = create("implied-zero-points")(model, PassContext())
    assert not res.modified and "not applied" in res.notes[0]
    assert len(next(n for n in model.graph if n.op_type == "MatMulNBits").inputs) == 4


def test_folding_minimums_reads_the_implied_form_too():
    rng = np.random.default_rng(5)
    q, d, m = _q41(rng)
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    a, b = _q41_graph(q, d, m), _q41_graph(q, d, m)
    assert izp.drop_zero_points(b) == 1
    ca, cb = blocks8.fold_minimums(a), blocks8.fold_minimums(b)
    assert ca.count == cb.count == 1 and _ops(b) == {"MatMulNBits": 1}
    np.testing.assert_array_equal(make_session(a, optimize=False).run(None, {"x": x})[0],
                                  make_session(b, optimize=False).run(None, {"x": x})[0])


@pytest.mark.parametrize("slower, kept", [(1.10, False), (1.0, True), (0.9, True)])
def test_kept_unless_the_decode_step_measures_slower(monkeypatch, slower, kept):
    rng = np.random.default_rng(6)
    model = _q41_graph(*_q41(rng))
    p = create("implied-zero-points")
    monkeypatch.setattr(type(p), "_timed", lambda self, a, b: (1e-3, slower * 1e-3))
    res = p(model, PassContext())
    assert res.modified is kept, res.notes
    assert len(next(n for n in model.graph if n.op_type == "MatMulNBits").inputs) == (3 if kept else 4)
    assert res.notes[1].startswith("decode step, 1 thread: 1.00 ->")


def test_a_graph_that_is_not_a_decoder_is_rewritten_untimed():
    rng = np.random.default_rng(7)
    model = _q41_graph(*_q41(rng))
    res = create("implied-zero-points")(model, PassContext())
    assert res.modified and res.rule_counts == {"implied-zero-points": 1}
    assert "not timed" in res.notes[1]


def test_level_4_chains_are_left_to_quantize_int4_and_closer_to_the_weights_there():
    """The pass leaves accuracy_level 4 (int8 activations: not exact); ``levels=(4,)`` (quantize-int4's use)
    rewrites them, and the result is no farther from the Q4_1 weight's fp32 product than before."""
    rng = np.random.default_rng(8)
    q, d, m = _q41(rng)
    model = _q41_graph(q, d, m)
    for n in model.graph:
        if n.op_type == "MatMulNBits":
            n.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", 4)
    assert izp.drop_zero_points(model) == 0
    w = (d * q + m).reshape(K, N)
    xs = rng.standard_normal((16, 1, 1, K)).astype(np.float32)
    before = make_session(model, optimize=False)
    err0 = [np.abs(before.run(None, {"x": x})[0][0, 0] - x[0, 0] @ w).max() for x in xs]
    assert izp.drop_zero_points(model, levels=(4,)) == 1
    after = make_session(model, optimize=False)
    err1 = [np.abs(after.run(None, {"x": x})[0][0, 0] - x[0, 0] @ w).max() for x in xs]
    assert np.median(err1) <= np.median(err0), (np.median(err1), np.median(err0))

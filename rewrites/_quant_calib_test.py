"""Tests of _quant_calib: activation statistics over calibration feeds, and the range calibrators."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import make_shared_matmuls

from graphopt.rewrites import _quant_calib as calib

RNG = np.random.default_rng(1)


def _model() -> ir.Model:
    return ir.serde.deserialize_model(make_shared_matmuls())


def _feeds(n: int = 3) -> list[dict[str, np.ndarray]]:
    feeds = []
    for i in range(n):
        mask = np.ones((2, 6), np.int64)
        mask[1, 3 + i:] = 0  # right padding: its rows must not count
        feeds.append({"x": RNG.standard_normal((2, 6, 8)).astype(np.float32), "attention_mask": mask})
    return feeds


def _real_rows(feeds, name: str) -> np.ndarray:
    """The activation's rows at unpadded positions, computed in numpy."""
    w0 = np.array([20.0] + [1.0] * 7, np.float32)
    rows = []
    for f in feeds:
        a = f["x"] * w0
        assert name == "a"
        rows.append(a[f["attention_mask"].astype(bool)])
    return np.concatenate(rows)


def test_collect_min_max_channels_rows_and_xtx_leave_padding_out():
    feeds = _feeds()
    stats = calib.collect(_model(), feeds, ["a", "a", "not_a_value"], xtx_for=["a"], sample_rows=8)
    assert set(stats) == {"a"}  # duplicates merged, unknown names dropped
    s, want = stats["a"], _real_rows(feeds, "a")
    assert s.n_rows == want.shape[0] == sum(int(f["attention_mask"].sum()) for f in feeds)
    assert s.lo == pytest.approx(want.min()) and s.hi == pytest.approx(want.max())
    np.testing.assert_allclose(s.chan_min, want.min(axis=0), rtol=1e-6)
    np.testing.assert_allclose(s.chan_absmax, np.abs(want).max(axis=0), rtol=1e-6)
    assert s.chan_absmax[0] > 5 * s.chan_absmax[1:].max()  # the outlier channel
    np.testing.assert_allclose(s.xtx, want.T.astype(np.float64) @ want, rtol=1e-5)
    # sampled rows are real rows: every one occurs among the unpadded rows
    assert s.rows.shape == (3 * (8 // 3), 8)
    assert all(np.any(np.all(np.isclose(want, r), axis=1)) for r in s.rows)
    assert s.hist is None


def test_collect_nothing_to_do():
    assert calib.collect(_model(), _feeds(), []) == {}
    assert calib.collect(_model(), [], ["a"]) == {}


def test_histograms_cover_every_real_value():
    feeds = _feeds(2)
    s = calib.collect(_model(), feeds, ["y"], histograms=True)["y"]
    assert s.hist.shape == (calib.BINS,) and int(s.hist.sum()) == s.n_rows * 16
    assert s.edge == pytest.approx(max(abs(s.lo), abs(s.hi)))


def _stats_of(values: np.ndarray) -> calib.Stats:
    s = calib.Stats(lo=float(values.min()), hi=float(values.max()), n_rows=values.size)
    s.edge = max(abs(s.lo), abs(s.hi))
    s.hist, _ = np.histogram(values, bins=calib.BINS, range=(-s.edge, s.edge))
    return s


def test_minmax_range_includes_zero():
    s = calib.Stats(lo=0.5, hi=2.0)
    assert calib.act_range(s, "minmax") == (0.0, 2.0)
    assert calib.act_range(calib.Stats(lo=-3.0, hi=-1.0), "percentile") == (-3.0, 0.0)  # no histogram: min/max


def test_percentile_and_entropy_clip_a_rare_outlier():
    values = np.concatenate([RNG.uniform(-1, 1, 100_000), [50.0]]).astype(np.float32)
    s = _stats_of(values)
    lo, hi = calib.act_range(s, "percentile", percentile=99.9)
    assert -1.05 < lo < -0.9 and 0.9 < hi < 1.05
    lo, hi = calib.act_range(s, "entropy")
    assert lo < 0 < hi < 50.0 and lo >= s.lo
    # no outlier to clip: percentile 100 keeps the observed range (to a bin)
    lo, hi = calib.act_range(s, "percentile", percentile=100.0)
    assert lo == pytest.approx(s.lo, abs=s.edge * 2 / calib.BINS) and hi == pytest.approx(s.hi)


def test_unknown_calibrator():
    with pytest.raises(ValueError, match="unknown calibrator 'median'"):
        calib.act_range(_stats_of(np.array([-1.0, 1.0])), "median")

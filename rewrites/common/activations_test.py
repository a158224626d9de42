"""Tests of _quant_calib: activation statistics over calibration feeds, and the range calibrators."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import make_shared_matmuls

from graphopt.rewrites.common import activations as calib

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


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A 2-layer generated decoder (models/big_decoder.py) with external data, its MatMul inputs, feeds."""
    from conftest import load_models_module

    big = load_models_module("big_decoder")
    path = big.build(big.Size(hidden=64, intermediate=128, layers=2, heads=4, vocab=500),
                     tmp_path_factory.mktemp("dec") / "dec.onnx")
    from graphopt import io

    model = io.load(path)
    acts = [n.inputs[0].name for n in model.graph if n.op_type == "MatMul" and n.inputs[1].is_initializer()]
    rng = np.random.default_rng(3)
    feeds = [{"input_ids": rng.integers(0, 500, (2, 5 + i))} for i in range(3)]
    return model, acts, feeds


def _same_stats(a: calib.Stats, b: calib.Stats, rows: bool) -> None:
    assert (a.lo, a.hi, a.n_rows, a.edge) == (b.lo, b.hi, b.n_rows, b.edge)
    for f in ("chan_min", "chan_max", "xtx", "hist") + (("rows",) if rows else ()):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def test_layerwise_collection_gives_the_whole_models_statistics(decoder):
    """Segment by segment (one segment's weights in memory at a time) the statistics are those of the
    whole model: exactly, sampled rows included, wherever the cuts fall."""
    model, acts, feeds = decoder
    kw = dict(histograms=True, xtx_for=acts, sample_rows=16)
    cuts = calib.segments(model, 1)
    assert len(cuts) > len(acts) // 2  # about one cut per weight
    whole = calib.collect(model, feeds, acts, **kw)
    one = calib.collect(model, feeds, acts, segment_bytes=1 << 40, **kw)  # layer-wise, a single segment
    done = []
    fine = calib.collect(model, feeds, acts, segment_bytes=1, on_done=lambda n, s: done.append(n), **kw)
    assert list(whole) == list(one) == list(fine) == list(dict.fromkeys(acts))
    assert done == list(fine)  # each activation reported once, as its segment finishes, in graph order
    for n in acts:
        _same_stats(one[n], fine[n], rows=True)
        _same_stats(whole[n], fine[n], rows=False)  # rows: sampled from another random stream
        assert fine[n].rows.shape == whole[n].rows.shape

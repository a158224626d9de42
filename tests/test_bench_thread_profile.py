"""tools/bench_thread_profile.py: the Amdahl fit per op type, the estimate for more cores, and one short run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from testmodels import make_mlp

from conftest import load_tools_module
from graphopt.data.feeds import save_dir


@pytest.fixture(scope="module")
def tool():
    return load_tools_module("bench_thread_profile")


def test_fit_fully_parallel_serial_and_mixed_ops(tool):
    assert tool.fit_amdahl({1: 10.0, 2: 5.0}) == pytest.approx((10.0, 1.0))
    assert tool.fit_amdahl({1: 10.0, 2: 10.0}) == pytest.approx((10.0, 0.0))
    # with 1 and 2 threads: p = 2 * (1 - t2 / t1)
    assert tool.fit_amdahl({1: 10.0, 2: 7.0}) == pytest.approx((10.0, 0.6))
    # least squares over more counts recovers exact Amdahl times
    t = {n: tool.amdahl(8.0, 0.75, n) for n in (1, 2, 4)}
    assert tool.fit_amdahl(t) == pytest.approx((8.0, 0.75))
    assert tool.fit_amdahl({2: 6.0, 4: 4.0}) == pytest.approx((10.0, 0.8))  # no 1-thread point needed


def test_fit_clips_p_to_zero_and_one(tool):
    # slower with 2 threads: serial, t1 the least-squares constant (the mean)
    assert tool.fit_amdahl({1: 10.0, 2: 12.0}) == pytest.approx((11.0, 0.0))
    # superlinear (t2 < t1/2): fully parallel, t1 = argmin (10 - t1)^2 + (4 - t1/2)^2 = 12 / 1.25
    assert tool.fit_amdahl({1: 10.0, 2: 4.0}) == pytest.approx((9.6, 1.0))
    assert tool.fit_amdahl({1: 0.0, 2: 0.0}) == (0.0, 0.0)
    with pytest.raises(ValueError):
        tool.fit_amdahl({1: 10.0})


def test_estimate_mixed_model(tool):
    per_op = {"MatMul": {1: 8.0, 2: 4.0}, "Gather": {1: 2.0, 2: 2.0}, "Gelu": {1: 4.0, 2: 3.0}}
    e = tool.estimate(per_op, {1: 1.0, 2: 1.2}, [8, 16])
    assert sorted(e["round_ms"]) == [1, 2, 8, 16]
    assert e["ops"]["Gelu"]["p"] == pytest.approx(0.5)
    assert e["overhead"]["ms"] == pytest.approx(1.1)  # serial: the mean of the measured values
    assert e["overhead"]["p_if_fitted"] == 0.0  # it grew with threads: a fitted p clips to 0
    # MatMul 8/n + Gather 2 + Gelu 4 * (0.5 + 0.5/n) + overhead 1.1
    assert e["round_ms"][1] == pytest.approx(15.1)
    assert e["round_ms"][2] == pytest.approx(10.1)
    assert e["round_ms"][16] == pytest.approx(0.5 + 2 + 2.125 + 1.1)
    assert e["scaling"][16] == pytest.approx(15.1 / 5.725)
    assert e["scaling"][1] == 1.0
    assert e["ops"]["MatMul"]["ms"][8] == pytest.approx(1.0)


def test_estimate_counts_an_op_missing_at_one_count_as_zero(tool):
    e = tool.estimate({"A": {1: 4.0}, "B": {1: 2.0, 2: 1.0}}, {1: 0.0, 2: 0.0}, [4])
    assert e["ops"]["A"]["p"] == 1.0 and e["ops"]["B"]["p"] == pytest.approx(1.0)


def test_end_to_end_on_a_tiny_model(tool, tmp_path, capsys):
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    make_mlp(a)
    make_mlp(b, seed=1)
    rng = np.random.default_rng(0)
    save_dir([{"x": rng.standard_normal((n, 8)).astype(np.float32)} for n in (4, 6)], tmp_path / "feeds")
    out = tmp_path / "r.json"
    assert tool.main([str(a), str(b), "--calib", str(tmp_path / "feeds"), "--rounds", "2", "--estimate", "8,16",
                      "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "16t scaling (÷ base, est.)" in text and "framework overhead (serial)" in text and "Amdahl" in text
    doc = json.loads(out.read_text())
    assert doc["threads"] == [1, 2] and doc["estimate"] == [8, 16] and doc["items_per_round"] == 10
    assert [m["model"] for m in doc["models"]] == ["a", "b"]
    for m in doc["models"]:
        # per round: each kernel once per feed (ORT fuses MatMul-Add-Relu into FusedGemm: 2 to 4 kernels a run)
        assert all(c % 2 == 0 for c in m["calls"].values()) and 4 <= sum(m["calls"].values()) <= 8
        for n in ("1", "2"):
            r = m["rounds"][n]
            assert len(r["model_run_ms_rounds"]) == 2 and len(r["wall_ms_rounds"]) == 2
            assert all(v > 0 for v in r["model_run_ms_rounds"])
            assert len(r["cpu_ms_rounds"]) == 2 and 0 < m["measured"][n]["cores_busy"] <= int(n) + 0.5
            assert m["measured"][n]["model_run_ms"] > sum(m["measured"][n]["per_op_ms"].values()) > 0
        e = m["estimate"]
        for n in ("1", "2", "8", "16"):
            assert e["round_ms"][n] > 0 and e["items_per_s"][n] > 0
            assert 0 < e["scaling"][n] <= int(n) + 1e-9
        assert all(0 <= o["p"] <= 1 for o in e["ops"].values())
        assert len(e["per_round_scaling"]) == 2 and all(0 < sc["16"] <= 16 for sc in e["per_round_scaling"])
    assert doc["models"][0]["estimate"]["scaling_vs_baseline"]["16"] == 1.0
    assert all(r["16"] == 1.0 for r in doc["models"][0]["estimate"]["per_round_scaling_vs_baseline"])
    assert "memory bandwidth" in doc["caveats"]


def _row(tool, name, t1, t2, busy2):
    """A report row from measured per-op times at 1 and 2 threads."""
    per_op = {op: {1: a, 2: b} for op, (a, b) in {"MatMul": (t1, t2), "Gather": (1.0, 1.0)}.items()}
    measured = {n: {"model_run_ms": sum(t[n] for t in per_op.values()) + 0.5, "overhead_ms": 0.5,
                    "cores_busy": 1.0 if n == 1 else busy2, "per_op_ms": {op: t[n] for op, t in per_op.items()}}
                for n in (1, 2)}
    return {"model": name, "calls": {"MatMul": 6, "Gather": 12}, "measured": measured,
            "measured_scaling": {n: measured[1]["model_run_ms"] / measured[n]["model_run_ms"] for n in (1, 2)},
            "estimate": tool.estimate(per_op, {1: 0.5, 2: 0.5}, [16])}


def test_per_round_estimate_uses_that_round_alone(tool):
    measured = {n: {"per_op_ms_rounds": {"MatMul": [8.0 / n, 8.0 / n ** 0.5]}, "overhead_ms_rounds": [0.0, 0.0]}
                for n in (1, 2)}
    assert tool.per_round_estimate(measured, 0, [16])["scaling"][16] == pytest.approx(16.0)
    # round 1: t2 = t1 / sqrt(2): p = 2 * (1 - 2 ** -0.5)
    p = 2 * (1 - 2 ** -0.5)
    assert tool.per_round_estimate(measured, 1, [16])["scaling"][16] == pytest.approx(1 / ((1 - p) + p / 16))


def test_report_divides_by_the_baseline_and_flags_sessions_without_their_cores(tool):
    base, slow = _row(tool, "base", 10.0, 5.0, 1.9), _row(tool, "opt", 4.0, 3.0, 1.02)
    text = tool.report([base, slow], [1, 2], [16], items=32)
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| opt |"))
    # opt: 1t 5.5 ms, 2t 4.5 ms; estimated at 16t: MatMul 4 * (0.5 + 0.5 / 16) + 1 + 0.5 = 3.625 ms
    s_base, s_opt = 11.5 / (10 / 16 + 1.5), 5.5 / 3.625
    assert f"{s_opt:.2f}x ({s_opt / s_base:.2f})" in row and "1.00/1.02" in row
    assert "Warning" in text and "opt at 2t (1.02)" in text and "base at 2t" not in text
    assert "| framework overhead (serial) |" in text and "memory bandwidth" in text

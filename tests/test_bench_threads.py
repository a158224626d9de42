"""``graphopt bench --threads 1,2``: throughput and scaling per thread count, each count interleaved."""

from __future__ import annotations

import json

from graphopt import io, runtime
from graphopt.bench import BenchResult, bench_thread_counts, scaling
from graphopt.feeds import runnable


def test_bench_threads_json_per_count_and_scaling(run_cli, mlp_path):
    code, out, err = run_cli("bench", mlp_path, mlp_path, "--threads", "1,2", "--rounds", "2", "--warmup", "0",
                             "--batch", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["threads"] == [1, 2]
    rows = doc["results"]
    assert [(r["threads"], r["model"]) for r in rows] == [
        (1, str(mlp_path)), (1, str(mlp_path) + "'"), (2, str(mlp_path)), (2, str(mlp_path) + "'")]
    assert all(r["rounds"] == 2 and r["items_per_s"] > 0 for r in rows)
    # scaling is each model's throughput over its own throughput at the first count
    by = {(r["threads"], r["model"]): r for r in rows}
    for (_, m), r in by.items():
        assert abs(r["scaling"] - r["items_per_s"] / by[(1, m)]["items_per_s"]) < 1e-9
    assert all(by[(1, m)]["scaling"] == 1.0 for (_, m) in by)


def test_bench_threads_table(run_cli, mlp_path):
    code, out, err = run_cli("bench", mlp_path, "--threads", "2,1", "--rounds", "1", "--warmup", "0")
    assert code == 0, err
    assert "scaling vs 2t" in out and "interleaved per thread count" in out


def test_bench_single_thread_count_keeps_its_format(run_cli, mlp_path):
    code, out, err = run_cli("bench", mlp_path, "--threads", "2", "--rounds", "1", "--warmup", "0", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["threads"] == 2 and "scaling" not in doc["results"][0] and doc["results"][0]["threads"] == 2


def test_bench_threads_bad_list_is_one_line(run_cli, mlp_path):
    for bad in ("1,x", "0", "2,2"):
        code, _, err = run_cli("bench", mlp_path, "--threads", bad, "--rounds", "1")
        assert code != 0 and "--threads" in err and len(err.strip().splitlines()) == 1


def test_bench_thread_counts_sessions_per_count(mlp_path, monkeypatch):
    made = []
    real = runtime.make_session

    def spy(model, **kw):
        made.append((kw.get("threads"), kw.get("spinning")))
        return real(model, **kw)

    feeds, _ = runnable(io.load(mlp_path), count=1, batch=2, seq=8, padded=False)
    monkeypatch.setattr(runtime, "make_session", spy)
    res = bench_thread_counts({"a": str(mlp_path), "b": str(mlp_path)}, feeds, [1, 3], rounds=2, warmup=0)
    assert list(res) == [1, 3] and all(len(r[0].round_seconds) == 2 for r in res.values())
    assert made == [(1, False), (1, False), (3, False), (3, False)]


def test_scaling_ratio():
    one = {1: [BenchResult("m", [1.0, 1.0], 10)], 2: [BenchResult("m", [0.5, 0.5], 10)]}
    assert scaling(one) == {1: {"m": 1.0}, 2: {"m": 2.0}}

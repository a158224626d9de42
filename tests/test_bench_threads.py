"""``graphopt bench --threads 1,2``: throughput and scaling per thread count, each count interleaved."""

from __future__ import annotations

import json

from graphopt import io
from graphopt.bench import BenchResult, bench_thread_counts, bench_thread_pairs, paired_scaling, scaling
from graphopt.bench import session_bench as bench_mod
from graphopt.data.feeds import runnable
from graphopt.runtime import session as runtime


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


def test_paired_scaling_is_the_median_of_per_round_ratios():
    """Round by round: a slow phase (round 2, everything 2x slower) cancels in each round's ratio, and the
    ratio to the baseline's scaling in the same round cancels a round where only 2 threads lost a core."""
    res = {1: [BenchResult("base", [4.0, 8.0, 4.0], 10), BenchResult("m", [1.0, 2.0, 1.0], 10)],
           2: [BenchResult("base", [2.0, 4.0, 4.0], 10), BenchResult("m", [0.625, 1.25, 1.0], 10)]}
    assert paired_scaling(res) == {1: {"base": 1.0, "m": 1.0}, 2: {"base": 2.0, "m": 1.6}}
    # per round m/base: 1.6/2, 1.6/2, 1/1 -> median 0.8
    assert paired_scaling(res, relative_to="base")[2] == {"base": 1.0, "m": 0.8}


def test_bench_thread_pairs_runs_each_models_counts_back_to_back(mlp_path, monkeypatch):
    feeds, _ = runnable(io.load(mlp_path), count=1, batch=2, seq=8, padded=False)
    orders = []
    real = bench_mod.bench_sessions

    def spy(sessions, feeds, **kw):
        orders.extend(kw["schedule"](r) for r in range(3))
        return real(sessions, feeds, **kw)

    monkeypatch.setattr(bench_mod, "bench_sessions", spy)
    res = bench_thread_pairs({"a": str(mlp_path), "b": str(mlp_path)}, feeds, [1, 2], rounds=3, warmup=0)
    assert orders == [["1\ta", "2\ta", "1\tb", "2\tb"], ["2\tb", "1\tb", "2\ta", "1\ta"],
                      ["1\ta", "2\ta", "1\tb", "2\tb"]]
    assert list(res) == [1, 2] and [r.name for r in res[2]] == ["a", "b"]
    assert all(len(r.round_seconds) == 3 and min(r.round_seconds) > 0 for rs in res.values() for r in rs)


def test_bench_paired_json_and_table(run_cli, mlp_path):
    code, out, err = run_cli("bench", mlp_path, mlp_path, "--threads", "1,2", "--paired", "--rounds", "3",
                             "--warmup", "0", "--batch", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["paired"] is True
    by = {(r["threads"], r["model"]): r for r in doc["results"]}
    assert set(by) == {(n, m) for n in (1, 2) for m in (str(mlp_path), str(mlp_path) + "'")}
    assert all(by[(1, m)]["scaling"] == 1.0 and by[(1, m)]["scaling_vs_first_model"] == 1.0 for (_, m) in by)
    assert by[(2, str(mlp_path))]["scaling_vs_first_model"] == 1.0 and by[(2, str(mlp_path))]["scaling"] > 0
    code, out, err = run_cli("bench", mlp_path, "--threads", "1,2", "--paired", "--rounds", "1", "--warmup", "0")
    assert code == 0, err
    assert "paired by round" in out and "first's scaling" in out
    for bad in (["--threads", "2"], ["--threads", "1,2", "--provider", "cuda"]):
        code, _, err = run_cli("bench", mlp_path, *bad, "--paired", "--rounds", "1")
        assert code != 0 and "--paired" in err and len(err.strip().splitlines()) == 1


def test_bench_instances_runs_concurrent_single_thread_sessions(mlp_path, monkeypatch):
    """--scale-by instances: a count of 2 is two single-thread sessions running every feed at once, so a
    round holds twice the items; scaling compares throughput, not round time."""
    made = []
    real = runtime.make_session

    def spy(model, **kw):
        made.append(kw.get("threads"))
        return real(model, **kw)

    feeds, _ = runnable(io.load(mlp_path), count=2, batch=3, seq=8, padded=False)
    monkeypatch.setattr(runtime, "make_session", spy)
    res = bench_thread_pairs({"a": str(mlp_path)}, feeds, [1, 2], rounds=2, warmup=0, scale_by="instances")
    assert made == [1, 1, 1]  # one session for the count 1, two single-thread sessions for the count 2
    assert [r.items_per_round for r in (res[1][0], res[2][0])] == [6, 12]
    one = {1: [BenchResult("m", [1.0, 1.0], 6)], 2: [BenchResult("m", [1.0, 1.25], 12)]}
    assert abs(paired_scaling(one)[2]["m"] - 1.8) < 1e-12  # per round 2.0 and 1.6


def test_bench_scale_by_is_checked(run_cli, mlp_path):
    for bad in (["--threads", "1,2", "--scale-by", "instances"], ["--threads", "1,2", "--paired", "--scale-by", "cores"]):
        code, _, err = run_cli("bench", mlp_path, *bad, "--rounds", "1")
        assert code != 0 and "--scale-by" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli("bench", mlp_path, "--threads", "1,2", "--paired", "--scale-by", "instances",
                             "--rounds", "1", "--warmup", "0", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["scale_by"] == "instances" and {r["threads"] for r in doc["results"]} == {1, 2}

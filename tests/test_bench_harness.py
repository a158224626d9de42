"""graphopt.bench.harness: calls are interleaved round-robin, medians and ratios are right, the JSON has
its documented keys, the markdown table is plain. No models."""

from __future__ import annotations

import json

import pytest

from graphopt.bench import harness
from graphopt.bench.harness import BenchResult


def _recorder(calls: list, names=("a", "b", "c")):
    return {n: (lambda n=n: calls.append(n)) for n in names}


def test_rounds_are_round_robin_rotating_after_warmup_in_order():
    calls: list[str] = []
    res = harness.round_robin(_recorder(calls), rounds=3, warmup=1)
    assert calls == ["a", "b", "c",  # warm-up, in the given order
                     "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r.name for r in res] == ["a", "b", "c"]
    assert all(len(r.round_seconds) == 3 for r in res)


def test_steps_run_back_to_back_per_turn_or_interleaved_by_step():
    calls: list[str] = []
    steps = {n: [lambda n=n, i=i: calls.append(f"{n}{i}") for i in range(2)] for n in ("a", "b")}
    harness.round_robin(steps, rounds=2, warmup=0)
    assert calls == ["a0", "a1", "b0", "b1", "b0", "b1", "a0", "a1"]
    calls.clear()
    res = harness.round_robin(steps, rounds=2, warmup=0, by_step=True)
    assert calls == ["a0", "b0", "b1", "a1", "a0", "b0", "b1", "a1"]
    assert all(len(r.round_seconds) == 2 for r in res)
    with pytest.raises(ValueError, match="as many steps"):
        harness.round_robin({"a": steps["a"], "b": steps["b"][:1]}, rounds=1, by_step=True)


def test_schedule_and_clock():
    calls: list[str] = []
    harness.round_robin(_recorder(calls, ("a", "b")), rounds=2, warmup=0, schedule=lambda r: ["b", "a"],
                        clock="cpu")
    assert calls == ["b", "a", "b", "a"]
    with pytest.raises(ValueError, match="clock"):
        harness.round_robin(_recorder([]), rounds=1, clock="sundial")


def test_clock_times_each_turn(monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setitem(harness.CLOCKS, "fake", lambda: float(next(ticks)))
    res = harness.round_robin(_recorder([], ("a", "b")), rounds=2, warmup=0, clock="fake")
    assert [r.round_seconds for r in res] == [[1.0, 1.0], [1.0, 1.0]]


def test_medians_percentiles_and_ratios():
    base = BenchResult("base", [0.4, 0.1, 0.2, 0.3], items_per_round=8)
    fast = BenchResult("fast", [0.1, 0.05, 0.2], items_per_round=8)
    assert base.p50 == pytest.approx(0.25) and fast.p50 == pytest.approx(0.1)
    assert base.p90 == pytest.approx(0.37) and base.best == 0.1 and base.worst == 0.4
    assert base.throughput == pytest.approx(32.0)
    assert harness.speedups([base, fast]) == {"base": 1.0, "fast": pytest.approx(2.5)}
    assert harness.speedups([base, fast], base="fast")["base"] == pytest.approx(0.4)
    assert harness.paired_ratios(base, fast) == pytest.approx([4.0, 2.0, 1.0])
    assert harness.median([3, 1, 2]) == 2.0 and harness.percentile([1, 2, 3, 4, 5], 50) == 3.0


def test_json_has_the_documented_keys(tmp_path):
    res = [BenchResult("base", [0.2, 0.2], 4), BenchResult("opt", [0.1, 0.1], 4)]
    doc = harness.results_doc(res, clock="cpu", feeds="2 feeds")
    assert set(doc) == {"baseline", "clock", "results", "feeds"} and doc["baseline"] == "base"
    assert [set(r) for r in doc["results"]] == [{"model", "p50_ms", "p90_ms", "items_per_s", "rounds",
                                                 "speedup_vs_first"}] * 2
    assert doc["results"][1]["speedup_vs_first"] == pytest.approx(2.0)
    assert doc["results"][1]["p50_ms"] == pytest.approx(100.0) and doc["results"][1]["items_per_s"] == 40.0
    harness.write_json(tmp_path / "out.json", doc)
    assert json.loads((tmp_path / "out.json").read_text()) == doc


def test_markdown_table(capsys):
    harness.print_table(["model", "ms"], [["a", "1.00"], ["b", 2]], align="lr")
    assert capsys.readouterr().out == "| model | ms |\n|---|---:|\n| a | 1.00 |\n| b | 2 |\n"
    assert harness.Table(["x", "y"]).lines([[1, 2]]) == ["| x | y |", "|---|---|", "| 1 | 2 |"]


def test_repeats_for_and_time_call():
    assert harness.repeats_for(lambda: None, 0.0) == 1
    assert harness.repeats_for(lambda: None, 1.0, probe_seconds=0.001) > 10
    seconds, out = harness.time_call(lambda: 42)
    assert out == 42 and seconds >= 0


def test_a_tool_interleaves_through_the_harness():
    """tools/bench_padding.py times batch by batch across variants (the harness's ``by_step``)."""
    from conftest import load_tools_module

    calls: list[tuple[str, int]] = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def run(self, outputs, batch):
            calls.append((self.name, batch["i"]))

    times = load_tools_module("bench_padding").timed_rounds({"a": Fake("a"), "b": Fake("b")},
                                                            [{"i": 0}, {"i": 1}], rounds=1)
    assert calls == [("a", 0), ("a", 1), ("b", 0), ("b", 1),  # the warm-up round
                     ("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert set(times) == {"a", "b"} and all(len(t.round_seconds) == 1 for t in times.values())

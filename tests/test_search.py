"""``optimize --search``: the chosen model within budget, its recipe reproduces it, the report, the Pareto
front, exit 3 when nothing fits, time limit and Ctrl-C, worker processes and Ray."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tomllib

import numpy as np
import pytest
from testmodels import make_mlp, tiny_bert_feeds

from graphopt import io, search
from graphopt.data import feeds as feeds_mod
from graphopt.data.metrics import compare, parse_budget
from graphopt.engine.verify import run_model
from graphopt.errors import UsageError, VerificationError
from graphopt.search.trials import _from_bytes


def _mlp_feeds(n: int = 6, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, 8)).astype(np.float32)} for _ in range(n)]


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.onnx"
    make_mlp(path)
    calib = feeds_mod.save_dir(_mlp_feeds(), tmp_path / "calib")
    return path, calib


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    pytest.importorskip("torch", reason="torch is needed to export the tiny BERT")
    from conftest import load_models_module

    path = load_models_module("tiny").build("bert", "feature-extraction", exporter="dynamo")
    calib = feeds_mod.save_dir(tiny_bert_feeds(path), tmp_path_factory.mktemp("tiny-calib"))
    return path, calib


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_cli_search_writes_the_chosen_model_and_a_recipe_that_reproduces_it(run_cli, tiny_bert, tmp_path):
    path, calib = tiny_bert
    out = tmp_path / "fast.onnx"
    budget = ["--budget", "cosine>=0.99", "--budget", "cosine_min>=0.97"]
    code, _, err = run_cli("optimize", path, "-o", out, "--calib", calib, *budget, "--search",
                           "--search-passes", "quantize,sparsify,early-exit", "--time-limit", "5m", "-q",
                           "--workers", "0")  # trials in this process (worker processes: test_worker_processes)
    assert code == 0, err
    paths = search.paths_for(out)
    assert all(p.exists() for p in paths.values())
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(paths["report"].read_text())
    names = [c["name"] for c in rep["candidates"]]
    assert names[0] == "lossless" and {"int8", "int8-dynamic", "int8-static-all", "sparsify-neurons"} <= set(names)
    assert any("early-exit: not tried" in n for n in rep["notes"])  # not a classifier
    chosen = next(c for c in rep["candidates"] if c["name"] == rep["chosen"])
    assert chosen["meets_budget"] and chosen["steps"] and chosen["name"] != "lossless"
    assert chosen["held"]["cosine"] >= 0.99 and chosen["held"]["cosine_min"] >= 0.97
    measured = [c for c in rep["candidates"] if c["status"] == "ok"]
    assert all(c["speedup"] > 0 and "cosine" in c["held"] and "cosine" in c["calib"] for c in measured)
    # the Pareto front: no measured candidate is at least as fast and as good as a front member, and better in one
    front = {p["name"] for p in rep["pareto"]}
    assert front
    for p in rep["pareto"]:
        for c in measured:
            assert not (c["speedup"] >= p["speedup"] and c["held"]["cosine"] >= p["cosine"]
                        and (c["speedup"] > p["speedup"] or c["held"]["cosine"] > p["cosine"])), (p, c["name"])
    # the recipe: the lossless recipe's steps, then the chosen lossy steps; it reruns without searching
    recipe = tomllib.loads(paths["recipe"].read_text())
    assert [s["pass"] for s in recipe["step"]][:3] == ["cleanup", "cut-positions", "fuse"]
    assert recipe["step"][-len(chosen["steps"]):] == [
        {"pass": s["pass"], **({"options": s["options"]} if s["options"] else {})} for s in chosen["steps"]]
    again = tmp_path / "again.onnx"
    code, _, err = run_cli("optimize", path, "-o", again, "--recipe", paths["recipe"], "--calib", calib, *budget, "-q")
    assert code == 0, err
    a, b = io.load(out), io.load(again)
    assert [(n.domain, n.op_type) for n in a.graph] == [(n.domain, n.op_type) for n in b.graph]
    feeds = feeds_mod.load_dir(calib)
    for x, y in zip(run_model(a, feeds), run_model(b, feeds)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_a_budget_nothing_meets_exits_3_and_writes_nothing(run_cli, tiny_bert, tmp_path):
    """Not even the lossless model (fusions reorder float sums) is within max_abs<=0."""
    path, calib = tiny_bert
    before = _digest(path)
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", path, "-o", out, "--calib", calib, "--budget", "max_abs<=0",
                           "--search", "--search-passes", "quantize", "--time-limit", "2m", "--workers", "0")
    assert code == 3
    assert "no candidate meets the budget max_abs<=0, not even the lossless" in err and "nothing written" in err
    assert list(tmp_path.glob("out*")) == []
    assert _digest(path) == before


def test_api_search_declines_and_reasons(mlp):
    """An MLP has no attention and no FFN block: prune-heads and sparsify decline, saying why; quantize fits."""
    path, calib = mlp
    res = search.search(path, calib=calib, budget="cosine>=0.99", families=["quantize", "prune-heads", "sparsify"],
                        time_limit=120)
    by = {t.name: t for t in res.trials}
    assert by["prune-heads"].status == "declined" and "prune-heads" in by["prune-heads"].reason
    assert by["sparsify-neurons"].status == "declined"
    assert by["prune-heads-50+int8"].status == "skipped" and "'prune-heads' alone" in by["prune-heads-50+int8"].reason
    # int8-static-all builds the int8 model again: timed once, never chosen as itself
    assert by["int8-static-all"].same_as == "int8" and by["int8-static-all"].model is None
    assert by["int8-static-all"].duel_speedup is None
    assert res.chosen is not None and res.chosen.meets_budget and res.chosen.name != "int8-static-all"
    duel = {row["name"]: row["speedup"] for row in res.duel}
    assert "lossless" in duel and res.chosen.name == max(duel, key=duel.get)
    if res.chosen.name == "lossless":  # on this tiny MLP int8 kernels may lose to float
        assert [s.pass_name for s in res.recipe.steps] == ["cleanup", "cut-positions", "fuse", "group-query-attention", "remove-padding"]
        assert any("faster than the lossless recipe" in n for n in res.notes)
        return
    assert res.recipe.steps[-1].pass_name == "quantize"
    # the budget is checked against the input model's outputs on the held-back feeds
    model = _from_bytes(res.chosen.model)
    feeds = feeds_mod.load_dir(calib)
    held = feeds[len(feeds) // 2:]
    c = compare(list(run_model(model, held)), list(run_model(str(path), held)), held)
    assert not parse_budget("cosine>=0.99").failures(c)
    assert abs(c.worst("cosine") - res.chosen.held["cosine"]) < 1e-9


def test_time_limit_stops_and_ctrl_c_keeps_the_best_so_far(mlp):
    path, calib = mlp
    res = search.search(path, calib=calib, budget="cosine>=0.99", families=["quantize"], time_limit=0.01)
    assert res.timed_out and {t.status for t in res.trials[1:]} == {"stopped"}
    # nothing lossy measured: the lossless model (it meets the budget) is the best there is
    assert res.chosen is res.trials[0] and res.chosen.name == "lossless"
    assert any("no lossy candidate met the budget" in n for n in res.notes)
    paths = search.write(res, path.parent / "lossless.onnx")
    assert paths["model"].exists()

    def interrupt(kind, info):
        if kind == "trial" and info["best"] is not None:
            raise KeyboardInterrupt

    res = search.search(path, calib=calib, budget="cosine>=0.99", families=["quantize"], time_limit=120,
                        on_event=interrupt)
    assert res.interrupted and any("interrupted" in n for n in res.notes)
    assert res.trials[1].name == "int8" and res.trials[1].status == "ok"
    assert [t.status for t in res.trials[2:]] == ["stopped"] * (len(res.trials) - 2)
    # no final duel after Ctrl-C: the trial's own ratio to the lossless model decides
    assert not res.duel and res.chosen.name == ("int8" if res.trials[1].speedup > 1.0 else "lossless")
    paths = search.write(res, path.parent / "best.onnx")
    assert paths["model"].exists() and json.loads(paths["report"].read_text())["interrupted"] is True


def test_worker_processes(mlp):
    """--workers 2: trials run in spawned processes, each timed there against the base (and the best)."""
    path, calib = mlp
    res = search.search(path, calib=calib, budget="cosine>=0.99", families=["quantize"], time_limit=300, workers=2)
    measured = [t for t in res.trials if t.status == "ok"]
    assert len(measured) >= 3 and res.workers == "2 processes"
    assert all(not t.worker.endswith(f":{os.getpid()}") for t in measured)
    assert res.chosen is not None
    assert any(t.vs_best is not None and t.best_at_submit for t in measured)


def test_ray_local_cluster(mlp):
    ray = pytest.importorskip("ray", reason="ray is not installed (the graphopt[ray] extra)")
    path, calib = mlp
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        res = search.search(path, calib=calib, budget="cosine>=0.99", families=["quantize"], time_limit=300,
                            ray_address="local")
    finally:
        ray.shutdown()
    assert res.workers.startswith("ray")
    measured = [t for t in res.trials if t.status == "ok"]
    assert measured and all(not t.worker.endswith(f":{os.getpid()}") for t in measured)
    assert res.chosen is not None and res.chosen.model


def test_parse_duration_and_usage_errors(run_cli, mlp, monkeypatch):
    assert search.parse_duration("10m") == 600 and search.parse_duration("1h30m") == 5400
    assert search.parse_duration("90s") == 90 and search.parse_duration("45") == 45
    with pytest.raises(UsageError):
        search.parse_duration("ten minutes")
    path, calib = mlp
    with pytest.raises(UsageError, match="not a lossy pass"):
        search.search(path, calib=calib, families=["fuse"])
    code, _, err = run_cli("optimize", path, "-o", path.parent / "o.onnx", "--workers", "2")
    assert code == 2 and "--search" in err
    code, _, err = run_cli("optimize", path, "-o", path.parent / "o.onnx", "--search", "--passes", "cleanup")
    assert code == 2
    monkeypatch.setitem(sys.modules, "ray", None)  # not installed: one line, before any work
    with pytest.raises(UsageError, match="--ray needs Ray") as e:
        search.search(path, calib=calib, ray_address="auto")
    assert "graphopt[ray]" in e.value.hint
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run_cli("optimize", path, "-o", path.parent / "o.onnx", "--calib", calib, "--search")
    assert code == 2 and "graphopt[plot]" in err


def test_pareto_front():
    T = search.Trial
    trials = [T("a", "d", [], speedup=1.0, held={"cosine": 1.0}), T("b", "d", [], speedup=2.0, held={"cosine": 0.99}),
              T("c", "d", [], speedup=1.5, held={"cosine": 0.98}), T("d", "d", [], speedup=2.0, held={"cosine": 0.995})]
    assert search.pareto_front(trials, "cosine") == ["a", "d"]
    trials = [T("a", "d", [], speedup=1.0, held={"max_abs": 0.1}), T("b", "d", [], speedup=2.0, held={"max_abs": 0.2}),
              T("c", "d", [], speedup=1.0, held={"max_abs": 0.3})]
    assert search.pareto_front(trials, "max_abs") == ["a", "b"]


def test_write_without_a_chosen_model_writes_nothing(tmp_path):
    res = search.SearchResult(input="m.onnx", budget="cosine>=0.99", provider="cpu", trials=[], chosen=None,
                              recipe=None, pareto=[], metric="cosine", seconds=1.0, time_limit=60, workers="1 process")
    with pytest.raises(VerificationError, match="not even the lossless"):
        search.write(res, tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(VerificationError):
        search.write(res, tmp_path / "out.onnx", report=tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["chosen"] is None  # asked for: the report only


def test_table_keeps_brackets_in_notes_and_reasons():
    from rich.console import Console

    from graphopt.cli.search import render

    t = search.Trial("x", "default", [], status="declined", reason="shape [batch, classes] expected")
    res = search.SearchResult(input="m.onnx", budget="cosine>=0.99", provider="cpu", trials=[t], chosen=None,
                              recipe=None, pareto=[], metric="cosine", seconds=1.0, time_limit=60, workers="1 process",
                              notes=["early-exit: not class logits [batch, classes]"])
    console = Console(record=True, width=200)
    render(res, console)
    text = console.export_text()
    assert "shape [batch, classes] expected" in text and "not class logits [batch, classes]" in text

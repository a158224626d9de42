"""The ORT session settings a model records (``graphopt.session`` metadata): written by the pipeline,
used by ``graphopt bench`` and ``graphopt deploy``."""

from __future__ import annotations

import json

import onnx
import onnxruntime as ort
import pytest

from graphopt import deploy, io
from graphopt.bench import bench_thread_counts
from graphopt.data.feeds import runnable
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.errors import RuntimeSetupError
from graphopt.runtime import session as runtime
from graphopt.runtime import session_hints


def _meta(path) -> dict:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def test_pipeline_records_the_measured_settings(mlp_path, tmp_path):
    res = optimize(str(mlp_path), OptimizeOptions(passes="cleanup"))
    out = tmp_path / "o.onnx"
    io.save(res.model, out)
    assert json.loads(_meta(out)[session_hints.KEY]) == session_hints.MEASURED
    assert session_hints.read(out) == session_hints.read(res.model) == session_hints.MEASURED
    assert session_hints.read(mlp_path) == {}  # not optimized by graphopt: nothing recorded


def test_bad_entries_are_ignored_with_a_warning(mlp_path, caplog):
    model = io.load(mlp_path)
    for bad in ("not json", '["a"]', '{"execution_mode": "fast"}', '{"inter_op_threads": 0}',
                '{"graph_optimization_level": "disable"}'):
        model.metadata_props[session_hints.KEY] = bad
        assert session_hints.read(model) == {}
    assert "ignoring the recorded session settings" in caplog.text
    model.metadata_props[session_hints.KEY] = '{"execution_mode": "parallel", "inter_op_threads": 2, "other": 1}'
    assert session_hints.read(model) == {"execution_mode": "parallel", "inter_op_threads": 2}


def test_session_options_execution_mode_and_inter_op_threads():
    so = runtime.session_options(threads=2, execution_mode="parallel", inter_op_threads=3)
    assert so.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert so.inter_op_num_threads == 3 and so.intra_op_num_threads == 2
    so = runtime.session_options(threads=2)
    assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL and so.inter_op_num_threads == 1
    with pytest.raises(RuntimeSetupError, match="execution mode"):
        runtime.session_options(execution_mode="fast")


def test_bench_opens_sessions_with_the_recorded_settings(mlp_path, tmp_path, monkeypatch):
    model = io.load(mlp_path)
    model.metadata_props[session_hints.KEY] = json.dumps(
        {"graph_optimization_level": "basic", "execution_mode": "parallel", "inter_op_threads": 2})
    hinted = tmp_path / "hinted.onnx"
    io.save(model, hinted)
    made = {}
    real = runtime.make_session

    def spy(m, **kw):
        made[str(m)] = kw
        return real(m, **kw)

    feeds, _ = runnable(io.load(mlp_path), count=1, batch=2, seq=8, padded=False)
    monkeypatch.setattr(runtime, "make_session", spy)
    bench_thread_counts({"plain": str(mlp_path), "hinted": str(hinted)}, feeds, [1], rounds=1, warmup=0)
    assert made[str(hinted)]["level"] == "basic" and made[str(hinted)]["execution_mode"] == "parallel"
    assert made[str(hinted)]["inter_op_threads"] == 2 and made[str(hinted)]["threads"] == 1
    assert "execution_mode" not in made[str(mlp_path)] and "level" not in made[str(mlp_path)]
    made.clear()
    bench_thread_counts({"hinted": str(hinted)}, feeds, [1], rounds=1, warmup=0, hints=False)
    assert "execution_mode" not in made[str(hinted)]


def test_deploy_states_the_recorded_settings(mlp_path, tmp_path):
    entry = deploy.deploy(mlp_path, tmp_path / "repo", name="plain", max_batch=0)
    text = (entry / "config.pbtxt").read_text()
    assert "execution_mode" not in text and "inter_op_thread_count" not in text and "level: 0" in text
    man = json.loads((entry / "graphopt.json").read_text())["session"]
    assert (man["graph_optimization_level"], man["execution_mode"], man["inter_op_threads"]) == ("all", "sequential", 1)

    model = io.load(mlp_path)
    model.metadata_props[session_hints.KEY] = json.dumps(
        {"graph_optimization_level": "extended", "execution_mode": "parallel", "inter_op_threads": 2})
    hinted = tmp_path / "hinted.onnx"
    io.save(model, hinted)
    entry = deploy.deploy(hinted, tmp_path / "repo", name="hinted", max_batch=0)
    text = (entry / "config.pbtxt").read_text()
    assert "level: 1" in text  # ORT_ENABLE_EXTENDED in the onnxruntime backend
    assert 'key: "execution_mode" value: { string_value: "1" }' in text
    assert 'key: "inter_op_thread_count" value: { string_value: "2" }' in text
    man = json.loads((entry / "graphopt.json").read_text())["session"]
    assert (man["graph_optimization_level"], man["execution_mode"], man["inter_op_threads"]) == ("extended", "parallel", 2)

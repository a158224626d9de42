"""The CLI commands end to end: passes, inspect, verify, bench, optimize on real models."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from testmodels import make_mlp

from graphopt.data import feeds as feeds_mod


def test_help_is_fast_and_lists_commands():
    # heavy imports (torch, onnxruntime) stay inside command bodies
    code = ("import sys, graphopt.cli.main as m; "
            "print(sorted(k for k in ('torch', 'onnxruntime', 'transformers') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["optimize", "passes", "inspect", "verify", "bench", "export", "feeds", "deploy",
                                     "serve", "diff"])
def test_help_shows_no_python_reprs(run_cli, command):
    """Every option's value shows as a choice or type name, never as a Python object (``<typing.Annotated[...]>``)."""
    code, out, err = run_cli(command, "--help")
    assert code == 0, err
    assert "typing." not in out and " object at 0x" not in out and "<class " not in out, out


def test_passes_json(run_cli):
    code, out, _ = run_cli("passes", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["cleanup"]["exact"] is True and rows["cleanup"]["default"] is True
    assert "fold_constants" in rows["cleanup"]["options"]
    assert not any(n.startswith("test-") for n in rows)


def test_inspect_json(run_cli, mlp_path):
    code, out, _ = run_cli("inspect", mlp_path, "--json", "--batch", "4")
    assert code == 0
    info = json.loads(out)
    assert info["opsets"] == {"ai.onnx": 17}
    assert info["inputs"] == [{"name": "x", "dtype": "FLOAT", "shape": ["batch", 8]}]
    assert info["parameters"] == 8 * 16 + 16 + 16 * 4 + 1
    assert info["ops"]["MatMul"] == 2
    assert info["flops"]["total"] == 2 * 4 * (8 * 16 + 16 * 4)


def test_verify_same_and_different(run_cli, tmp_path, mlp_path):
    other = tmp_path / "other.onnx"
    make_mlp(other, seed=1)
    code, out, _ = run_cli("verify", mlp_path, mlp_path, "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    code, out, _ = run_cli("verify", mlp_path, other, "--json")
    assert code == 3
    d = json.loads(out)
    assert d["ok"] is False and d["summary"]["max_abs"] > 0.1
    code, out, _ = run_cli("verify", mlp_path, other, "--budget", "cosine>=-1")
    assert code == 0


def test_verify_and_bench_with_calib(run_cli, tmp_path, mlp_path):
    calib = tmp_path / "calib"
    rng = np.random.default_rng(0)
    feeds_mod.save_dir([{"x": rng.standard_normal((3, 8)).astype(np.float32)} for _ in range(3)], calib)
    code, out, _ = run_cli("optimize", mlp_path, "-o", tmp_path / "o.onnx", "--calib", calib, "-q")
    assert code == 0
    code, out, _ = run_cli("verify", mlp_path, tmp_path / "o.onnx", "--calib", calib, "--json")
    assert code == 0 and json.loads(out)["feeds"].startswith("3 feeds")
    code, out, _ = run_cli("bench", mlp_path, tmp_path / "o.onnx", "--calib", calib, "--rounds", "3", "--json")
    assert code == 0
    res = json.loads(out)["results"]
    assert [r["model"] for r in res] == [str(mlp_path), str(tmp_path / "o.onnx")]
    assert res[0]["speedup_vs_first"] == 1.0 and res[1]["rounds"] == 3
    assert all(r["items_per_s"] > 0 for r in res)


def test_calib_feed_missing_input(run_cli, tmp_path, mlp_path):
    calib = tmp_path / "calib"
    feeds_mod.save_dir([{"z": np.zeros((1, 8), np.float32)}], calib)
    code, _, err = run_cli("verify", mlp_path, mlp_path, "--calib", calib)
    assert code == 2 and "has no input 'x'" in err


@pytest.mark.slow
def test_convert_precision_after_fuse_on_the_torchscript_export(run_cli, minilm, tmp_path):
    # fuse leaves EmbedLayerNormalization's unused mask_index untyped; the fp16 check's CPU stand-in kept
    # it untyped (it once gave it an empty type the model could not be serialized with: exit 1)
    src = minilm("torchscript", "eager")
    out = tmp_path / "fp16.onnx"
    code, _, err = run_cli("optimize", src, "-o", out, "--passes", "cleanup,fuse,convert-precision",
                           "--report", tmp_path / "r.json")
    assert code == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [p["status"] for p in rep["passes"]] == ["ok", "ok", "ok"]
    assert rep["final"]["cosine_min"] >= 0.999


@pytest.mark.slow
def test_optimize_minilm_default_recipe(run_cli, minilm, tmp_path):
    src = minilm("torchscript", "eager")
    before = src.read_bytes()
    out = tmp_path / "minilm.opt.onnx"
    code, stdout, err = run_cli("optimize", src, "-o", out, "--report", tmp_path / "r.json")
    assert code == 0, err
    assert src.read_bytes() == before
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passes"] and all(p["status"] == "ok" for p in rep["passes"])
    assert rep["final"]["max_abs"] <= 1e-4
    assert "cleanup" in stdout
    # a stock ORT loads the result without graphopt
    code = (
        "import sys, numpy as np, onnxruntime as ort\n"
        f"s = ort.InferenceSession({str(out)!r}, providers=['CPUExecutionProvider'])\n"
        "ids = np.array([[101, 2023, 2003, 102]], dtype=np.int64)\n"
        "y = s.run(None, {'input_ids': ids, 'attention_mask': np.ones_like(ids), 'token_type_ids': np.zeros_like(ids)})[0]\n"
        "assert y.shape == (1, 4, 384), y.shape\n"
        "assert not any(m.startswith('graphopt') for m in sys.modules)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "ok", r.stderr
    m = onnx.load(str(out))
    tags = {p.value for n in m.graph.node for p in n.metadata_props if p.key == "graphopt.pass"}
    assert tags <= {p["name"] for p in rep["passes"]}
    # inspect explains remove-padding's grouped attention: 6 layers, each one kernel per length group
    code, info, _ = run_cli("inspect", out, "--json")
    fusion = json.loads(info)["fusion"]
    layers = fusion["attention_layers"]
    assert code == 0 and fusion["fully_fused"] and layers["layers"] == 6 and layers["groups_per_layer"] > 1
    assert fusion["attention"]["fused"] == 6 * layers["groups_per_layer"]
    code, text, _ = run_cli("inspect", out)
    assert f"6 layers x {layers['groups_per_layer']} length groups" in text and "{'attention'" not in text


def test_verify_cli_is_compare_models(run_cli, tmp_path, mlp_path, monkeypatch):
    """`graphopt verify` prints what graphopt.engine.verify.compare_models returns (no feed loading or
    comparison of its own)."""
    from graphopt.engine import verify

    other = tmp_path / "other.onnx"
    make_mlp(other, seed=1)
    res = verify.compare_models(mlp_path, other, budget=["cosine>=-1"])
    assert res.ok and res.failures == [] and str(res.budget) and res.feeds
    res = verify.compare_models(mlp_path, other)
    assert not res.ok and res.failures == ["outputs differ beyond atol 0.0001 + rtol 0.0001*|ref|"]
    code, out, _ = run_cli("verify", mlp_path, other, "--json")
    assert code == 3 and json.loads(out) == json.loads(json.dumps(res.as_dict(), default=str))

    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return res

    monkeypatch.setattr(verify, "compare_models", spy)
    code, _, _ = run_cli("verify", mlp_path, other, "--atol", "0.5", "--provider", "cpu", "--json")
    assert code == 3 and len(calls) == 1
    assert calls[0][0] == (mlp_path, other) and calls[0][1]["atol"] == 0.5 and calls[0][1]["provider"] == "cpu"


def test_compare_models_reports_missing_outputs(tmp_path, mlp_path):
    import onnx_ir as ir

    from graphopt import io
    from graphopt.engine import verify

    b = io.load(mlp_path)
    out = b.graph.outputs[0]
    extra = ir.node("Identity", [out], num_outputs=1)
    extra.outputs[0].name = "extra"
    b.graph.append(extra)
    b.graph.outputs[:] = [extra.outputs[0]]  # B renames its output: A's is missing from B
    res = verify.compare_models(io.load(mlp_path), b)
    assert not res.ok and res.failures == [f"outputs missing from B: {out.name}"]
    assert res.as_dict()["ok"] is False


def test_provider_is_a_choice_everywhere(run_cli, mlp_path, tmp_path):
    from graphopt.runtime.session import PROVIDERS, Provider

    assert Provider.CUDA == "cuda" and str(Provider.CPU) == "cpu"
    assert "cpu" in PROVIDERS and PROVIDERS["cuda"] == "CUDAExecutionProvider" and " or ".join(PROVIDERS) == "cpu or cuda"
    for cmd in (["optimize", mlp_path, "-o", tmp_path / "o.onnx"], ["verify", mlp_path, mlp_path],
                ["bench", mlp_path, "--rounds", "1"]):
        code, _, err = run_cli(*cmd, "--provider", "tpu")
        assert code == 2 and "'tpu' is not one of 'cpu', 'cuda'" in " ".join(err.split()), err
        code, out, _ = run_cli(cmd[0], "--help")
        assert code == 0 and "[cpu|cuda]" in out.replace("<", "[").replace(">", "]"), out
    code, out, _ = run_cli("verify", mlp_path, mlp_path, "--provider", "CPU", "--json")
    assert code == 0 and json.loads(out)["ok"] is True


def test_usage_errors_exit_2_not_internal_error(run_cli, mlp_path):
    """typer 0.2x raises its vendored click's usage errors; they are usage errors (exit 2), not crashes."""
    for args in (["verify", mlp_path], ["inspect", mlp_path, "--no-such-option"], ["bench", mlp_path, "--rounds", "x"]):
        code, _, err = run_cli(*args)
        assert code == 2 and err.startswith("error: ") and "internal error" not in err, err


def test_json_is_a_flag_in_every_command(run_cli):
    """--json means "print JSON on stdout" in every command that has it; files go through --report."""
    import typer.main

    from graphopt.cli.main import app

    group = typer.main.get_command(app)
    with_json = []
    for name, cmd in group.commands.items():
        for p in cmd.params:
            if "--json" in getattr(p, "opts", ()):
                assert p.is_flag, name
                with_json.append(name)
            if "--report" in getattr(p, "opts", ()):
                assert not p.is_flag and p.metavar == "FILE", name
    # serve runs a server (its answers are JSON already); every other command has --json
    assert set(group.commands) - {"serve"} == set(with_json)


def test_optimize_failure_goes_through_the_common_handler(run_cli, mlp_path, tmp_path, monkeypatch):
    from graphopt import io
    from graphopt.engine import pipeline
    from graphopt.engine.report import PassRecord, Report

    def failing(model, *args, **kwargs):
        rec = PassRecord(name="fuse", status="rolled-back", error="verification failed: max_abs 0.5")
        return pipeline.Result(io.load(model), Report(input=str(model), passes=[rec], ok=False))

    monkeypatch.setattr(pipeline, "optimize", failing)
    out = tmp_path / "o.onnx"
    code, _, err = run_cli("optimize", mlp_path, "-o", out, "-q")
    assert code == 3 and not out.exists()
    assert err.strip().splitlines() == [
        "error: pass 'fuse' rolled-back: verification failed: max_abs 0.5",
        "hint: no output written; without --strict the model is written without that pass, --debug-dir saves "
        "the before/after pair",
    ]
    code, _, err = run_cli("--debug", "optimize", mlp_path, "-o", out, "-q")
    assert code == 3 and "VerificationError" in err  # raised, not printed by the command

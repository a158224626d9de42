"""The CLI commands end to end: passes, inspect, verify, bench, optimize on real models."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from testmodels import make_mlp

from graphopt import feeds as feeds_mod


def test_help_is_fast_and_lists_commands():
    # heavy imports (torch, onnxruntime) stay inside command bodies
    code = ("import sys, graphopt.cli.main as m; "
            "print(sorted(k for k in ('torch', 'onnxruntime', 'transformers') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


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

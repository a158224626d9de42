"""Bad input: each a one-line error, the documented exit code, no output written, input untouched."""

from __future__ import annotations

import os

import onnx
import pytest
from onnx import TensorProto, helper
from testmodels import make_mlp

ERROR, USAGE = 1, 2


def _assert_clean(code, err, expected_code, out_path, inputs):
    assert code == expected_code, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error:"), err
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1
    assert all(ln.startswith(("error:", "hint:")) for ln in lines), err  # no traceback
    assert not os.path.exists(out_path)
    for p, data in inputs.items():
        assert p.read_bytes() == data


def _write(path, data: bytes):
    path.write_bytes(data)
    return {path: data}


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.onnx", b"", "file is empty"),
        ("random.onnx", os.urandom(4096), "not a valid ONNX model"),
        ("text.onnx", b"this is just a text file\nwith two lines\n", "not a valid ONNX model"),
    ],
)
def test_unreadable_files(run_cli, tmp_path, name, content, message):
    src = tmp_path / name
    inputs = _write(src, content)
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", src, "-o", out)
    _assert_clean(code, err, ERROR, out, inputs)
    assert message in err and name in err


def test_missing_file(run_cli, tmp_path):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", tmp_path / "nope.onnx", "-o", out)
    _assert_clean(code, err, USAGE, out, {})
    assert "no such file" in err


def test_truncated_protobuf(run_cli, tmp_path):
    full = make_mlp().SerializeToString()
    src = tmp_path / "trunc.onnx"
    inputs = _write(src, full[: len(full) // 2])
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", src, "-o", out)
    _assert_clean(code, err, ERROR, out, inputs)
    assert "trunc.onnx" in err


def test_dangling_node_input(run_cli, tmp_path):
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "ghost"], ["y"], name="add_ghost")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    src = tmp_path / "dangling.onnx"
    inputs = _write(src, m.SerializeToString())
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", src, "-o", out)
    _assert_clean(code, err, 3, out, inputs)
    assert "ghost" in err


def test_missing_external_data(run_cli, tmp_path):
    m = make_mlp()
    src = tmp_path / "ext.onnx"
    onnx.save(m, str(src), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    (tmp_path / "ext.onnx.data").unlink()
    inputs = {src: src.read_bytes()}
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", src, "-o", out)
    _assert_clean(code, err, ERROR, out, inputs)
    assert "external data file 'ext.onnx.data'" in err


def test_output_equals_input(run_cli, mlp_path):
    inputs = {mlp_path: mlp_path.read_bytes()}
    code, _, err = run_cli("optimize", mlp_path, "-o", mlp_path)
    assert code == 2  # a usage error, as the README's exit codes say
    assert "output path is the input path" in err and "--in-place" in err
    assert mlp_path.read_bytes() == inputs[mlp_path]
    assert sorted(p.name for p in mlp_path.parent.iterdir()) == ["mlp.onnx"]


def test_in_place_allowed_when_asked(run_cli, mlp_path):
    code, _, err = run_cli("optimize", mlp_path, "--in-place", "-q")
    assert code == 0, err
    assert len(onnx.load(str(mlp_path)).graph.node) == 4
    assert sorted(p.name for p in mlp_path.parent.iterdir()) == ["mlp.onnx"]


def test_output_parent_is_a_file(run_cli, mlp_path, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    inputs = {mlp_path: mlp_path.read_bytes(), blocker: b"x"}
    out = blocker / "out.onnx"
    code, _, err = run_cli("optimize", mlp_path, "-o", out)
    _assert_clean(code, err, ERROR, out, inputs)
    assert "is a file, not a folder" in err


def test_unknown_pass_name(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", mlp_path, "-o", out, "--passes", "cleanup,clenaup")
    _assert_clean(code, err, USAGE, out, {mlp_path: mlp_path.read_bytes()})
    assert "unknown pass 'clenaup'" in err and "did you mean 'cleanup'" in err


def test_unknown_option(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", mlp_path, "-o", out, "--set", "cleanup.speed=11")
    _assert_clean(code, err, USAGE, out, {mlp_path: mlp_path.read_bytes()})
    assert "no option 'speed'" in err and "fold_constants" in err


@pytest.mark.parametrize("budget", ["cosine>>0.9", "cosine", "speed>=2", "cosine>=abc"])
def test_malformed_budget(run_cli, mlp_path, tmp_path, budget):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", mlp_path, "-o", out, "--budget", budget)
    _assert_clean(code, err, USAGE, out, {mlp_path: mlp_path.read_bytes()})
    assert "budget" in err


def test_malformed_set(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("optimize", mlp_path, "-o", out, "--set", "cleanup")
    _assert_clean(code, err, USAGE, out, {mlp_path: mlp_path.read_bytes()})


def test_bad_calib_folder(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    (tmp_path / "calib").mkdir()
    code, _, err = run_cli("optimize", mlp_path, "-o", out, "--calib", tmp_path / "calib")
    _assert_clean(code, err, USAGE, out, {mlp_path: mlp_path.read_bytes()})
    assert "no .npz feeds" in err


def test_debug_shows_traceback(run_cli, tmp_path):
    code, _, err = run_cli("--debug", "optimize", tmp_path / "nope.onnx", "-o", tmp_path / "o.onnx")
    assert code == USAGE and "Traceback" in err


def test_unknown_provider(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    before = mlp_path.read_bytes()
    code, _, err = run_cli("optimize", mlp_path, "-o", out, "--provider", "tpu")
    # --provider is a choice: click's usage error, exit 2, nothing written
    assert code == USAGE and "'tpu' is not one of 'cpu', 'cuda'" in err and "Traceback" not in err, err
    assert not out.exists() and mlp_path.read_bytes() == before


def test_cuda_only_model_on_cpu_says_so(run_cli, tmp_path):
    """A model optimized for --provider cuda (PackedMultiHeadAttention, no CPU kernel) benched on a
    CPU-only machine: one error line and a hint naming the cause, exit 1."""
    pytest.importorskip("torch", reason="torch is needed to export the tiny models")
    from conftest import load_models_module
    from graphopt.runtime.session import cuda_available

    if cuda_available()[0]:
        pytest.skip("CUDA is present here: the model loads on the CUDA provider")
    src = load_models_module("tiny").build("bert", "feature-extraction", exporter="dynamo")
    out = tmp_path / "cuda.onnx"
    code, _, err = run_cli("optimize", src, "-o", out, "--provider", "cuda")
    assert code == 0, err
    code, _, err = run_cli("bench", out)
    assert code == ERROR, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[0].startswith("error:") and "PackedMultiHeadAttention" in lines[0], err
    assert any(ln.startswith("hint:") and "--provider cuda" in ln for ln in lines), err

"""`graphopt export` through the CLI: success output, and every bad input -> one-line error,
the documented exit code (1 error, 2 usage, 3 parity) and no output file."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="exporting needs torch")
pytest.importorskip("transformers", reason="exporting needs transformers")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_bert():
    """HF folder of the seeded tiny BERT with a masked-lm head (models cache)."""
    if str(REPO / "models") not in sys.path:
        sys.path.insert(0, str(REPO / "models"))
    return importlib.import_module("tiny").build_folder("bert", "masked-lm")


def _cli(capsys, *args):
    from graphopt.cli.main import main

    code = main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_clean_failure(err: str, out_dir: Path, needle: str):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error:"), err
    assert needle in lines[0], lines[0]
    assert all(ln.startswith(("error:", "hint:")) for ln in lines), err  # one line + a hint, no dump
    assert not list(out_dir.iterdir()), "a failed export left files behind"


def test_export_cli_table_and_metadata(capsys, tiny_bert, tmp_path):
    import onnx

    out = tmp_path / "out" / "m.onnx"
    code, stdout, _ = _cli(capsys, tiny_bert, "-o", out, "--task", "feature-extraction", "--attn", "eager")
    assert code == 0
    assert "last_hidden_state" in stdout and "max_abs" in stdout and "wrote" in stdout
    meta = {p.key: p.value for p in onnx.load(out).metadata_props}
    assert meta["graphopt.exporter"] == "dynamo"
    assert meta["graphopt.attn_implementation"] == "eager"
    assert meta["graphopt.task"] == "feature-extraction"


def test_export_cli_json(capsys, tiny_bert, tmp_path):
    out = tmp_path / "m.onnx"
    code, stdout, _ = _cli(capsys, tiny_bert, "-o", out, "--task", "masked-lm", "--exporter", "torchscript", "--json")
    assert code == 0
    info = json.loads(stdout)
    assert info["exporter"] == "torchscript" and info["opset"] == 17
    assert info["parity"]["passed"] and info["parity"]["outputs"][0]["name"] == "logits"


def test_folder_without_config(capsys, tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    (tmp_path / "out").mkdir()
    code, _, err = _cli(capsys, src, "-o", tmp_path / "out" / "m.onnx")
    assert code == 1
    _assert_clean_failure(err, tmp_path / "out", "no config.json")


def test_unknown_task_for_model(capsys, tiny_bert, tmp_path):  # tiny_bert puts models/ on sys.path
    gpt2 = importlib.import_module("tiny").build_folder("gpt2", "causal-lm")
    (tmp_path / "out").mkdir()
    code, _, err = _cli(capsys, gpt2, "-o", tmp_path / "out" / "m.onnx", "--task", "masked-lm")
    assert code == 2
    _assert_clean_failure(err, tmp_path / "out", "not available for model type 'gpt2'")


def test_unknown_task_name(capsys, tiny_bert, tmp_path):  # tiny_bert: also puts models/ on sys.path
    (tmp_path / "out").mkdir()
    code, _, err = _cli(capsys, tiny_bert, "-o", tmp_path / "out" / "m.onnx", "--task", "masked-llm")
    assert code == 2
    _assert_clean_failure(err, tmp_path / "out", "unknown task 'masked-llm'")
    assert "did you mean 'masked-lm'" in err


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda c: c.update(hidden_size=32), "tensor sizes differ"),
    (lambda c: c.update(num_hidden_layers=3), "tensors missing"),
], ids=["sizes", "layers"])
def test_weights_do_not_match_config(capsys, tiny_bert, tmp_path, edit, needle):
    src = tmp_path / "bad"
    shutil.copytree(tiny_bert, src)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "out").mkdir()
    code, _, err = _cli(capsys, src, "-o", tmp_path / "out" / "m.onnx", "--task", "masked-lm")
    assert code == 1
    _assert_clean_failure(err, tmp_path / "out", needle)


@pytest.mark.parametrize("src", ["graphopt_no_such_module:make", "json:no_such_function"])
def test_module_function_that_does_not_exist(capsys, tmp_path, src):
    (tmp_path / "out").mkdir()
    code, _, err = _cli(capsys, src, "-o", tmp_path / "out" / "m.onnx")
    assert code == 2
    _assert_clean_failure(err, tmp_path / "out", src)


def test_parity_failure_leaves_no_file(capsys, tiny_bert, tmp_path):
    (tmp_path / "out").mkdir()
    code, _, err = _cli(capsys, tiny_bert, "-o", tmp_path / "out" / "m.onnx", "--task", "masked-lm",
                        "--exporter", "torchscript", "--atol", "1e-12")
    assert code == 3
    _assert_clean_failure(err, tmp_path / "out", "output 'logits' differs from PyTorch: max_abs")
    assert "> atol 1e-12" in err


def test_parity_error_carries_numbers(tiny_bert, tmp_path):
    from graphopt.errors import ParityError
    from graphopt.exporters import export

    with pytest.raises(ParityError) as ei:
        export(tiny_bert, tmp_path / "m.onnx", task="masked-lm", exporter="torchscript", atol=1e-12)
    assert ei.value.exit_code == 3
    assert ei.value.result.outputs[0].name == "logits" and ei.value.result.max_abs > 1e-12
    assert not (tmp_path / "m.onnx").exists()


def test_decoder_export_puts_its_generation_files_beside_the_model(capsys, tiny_bert, tmp_path):
    """A causal LM exported from a folder gets the folder's tokenizer and generation files beside the .onnx (what
    `graphopt generate MODEL` reads), never over a file already there."""
    src = importlib.import_module("tiny").build_folder("llama", "causal-lm-with-past")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the user's own file stays
    code, _, err = _cli(capsys, src, "-o", out / "m.onnx", "--task", "causal-lm-with-past")
    assert code == 0, err
    expected = [n for n in ("generation_config.json", "tokenizer.json", "tokenizer_config.json") if (src / n).is_file()]
    assert expected and all((out / n).read_bytes() == (src / n).read_bytes() for n in expected)
    assert (out / "config.json").read_text() == "{}"

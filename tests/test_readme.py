"""The README's documented commands print what the README says they print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import load_models_module

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()

pytestmark = pytest.mark.slow


def _documented(command: str) -> tuple[str, str]:
    """The README's shell line that starts with ``command`` and the ``# ...`` comment line after it."""
    m = re.search(rf"^({re.escape(command)}[^\n]*)\n# ([^\n]*)$", README, re.M)
    assert m, f"README shows no `{command}` line with its output"
    return m.group(1), m.group(2)


def test_deploy_example_prints_what_the_readme_says(tmp_path, run_cli):
    """`optimize --recipe int8` then `deploy ... --name minilm`: the line deploy prints is the README's."""
    pytest.importorskip("transformers")
    src = load_models_module("tiny").build("bert", "feature-extraction")
    line, said = _documented("graphopt deploy minilm.int8.onnx")
    assert "--name minilm" in line and "--report report.json" in line
    q, report = tmp_path / "minilm.int8.onnx", tmp_path / "report.json"
    code, _, err = run_cli("optimize", src, "-o", q, "--recipe", "int8", "--report", report)
    assert code == 0, err
    code, out, err = run_cli("deploy", q, "-o", tmp_path / "repo", "--name", "minilm", "--max-batch", "32",
                             "--report", report)
    assert code == 0, err
    printed = out.strip().replace(str(tmp_path / "repo"), "repo")
    assert printed == said, (printed, said)


def test_error_lines_are_as_documented(run_cli, tmp_path):
    """"An error is one `error:` line on stderr, followed by one `hint:` line where there is a hint"."""
    assert "one `error:` line on\nstderr, followed by one `hint:` line" in README
    code, out, err = run_cli("optimize", tmp_path / "missing.onnx", "-o", tmp_path / "o.onnx")
    lines = err.splitlines()
    assert code == 2 and out == "" and lines[0].startswith("error:") and len(lines) <= 2
    assert len(lines) == 1 or lines[1].startswith("hint:")

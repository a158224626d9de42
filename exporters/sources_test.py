"""exporters.sources: loading a ``file.py:function`` source, and one-line export errors."""

from __future__ import annotations

import sys

import pytest

from graphopt.errors import UsageError
from graphopt.exporters import sources


def test_file_source_is_loaded_without_entering_sys_modules(tmp_path):
    src = tmp_path / "graphopt_probe_source.py"
    src.write_text("def make():\n    return 42\n")
    fn = sources._load_callable(f"{src}:make")
    assert fn() == 42
    assert "graphopt_probe_source" not in sys.modules


def test_file_source_errors(tmp_path):
    src = tmp_path / "probe_missing_fn.py"
    src.write_text("x = 1\n")
    with pytest.raises(UsageError, match="has no function 'make'"):
        sources._load_callable(f"{src}:make")
    with pytest.raises(UsageError, match="no such file"):
        sources._load_callable(f"{tmp_path / 'absent.py'}:make")


def test_first_line_keeps_the_cause_of_a_torch_onnx_report():
    report = "Failed to export\n\n## Exception summary\n\n\x1b[96mTypeError: bad arg\x1b[0m\nmore"
    assert sources._first_line(RuntimeError(report)) == "TypeError: bad arg"
    assert sources._first_line(RuntimeError("## Exception summary\n  ")) == "RuntimeError"
    assert sources._first_line(RuntimeError("")) == "RuntimeError"
    assert len(sources._first_line(RuntimeError("y" * 1000))) == 300

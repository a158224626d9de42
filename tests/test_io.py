"""graphopt.io.write_atomic: the one atomic writer of reports (diff JSON/HTML/mapping, optimize --report)."""

from __future__ import annotations

import os
import stat

import pytest

from graphopt import io
from graphopt.errors import ModelSaveError


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_write_atomic_mode_follows_umask_without_touching_it(tmp_path, monkeypatch, umask_027):
    def no_umask(*_):
        raise AssertionError("write_atomic must not read or change the process umask")

    monkeypatch.setattr(os, "umask", no_umask)
    p = io.write_atomic(tmp_path / "sub" / "r.json", "{\"é\": 1}\n")
    monkeypatch.undo()
    assert p.read_text(encoding="utf-8") == "{\"é\": 1}\n"
    assert stat.S_IMODE(p.stat().st_mode) == 0o640  # 0o666 less the umask, like open()
    assert os.listdir(tmp_path / "sub") == ["r.json"]  # no temp file left


def test_write_atomic_replaces_and_writes_bytes(tmp_path):
    p = tmp_path / "x.bin"
    p.write_text("old")
    io.write_atomic(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01" and os.listdir(tmp_path) == ["x.bin"]


def test_write_atomic_errors_name_the_path(tmp_path):
    with pytest.raises(ModelSaveError, match="is a folder"):
        io.write_atomic(tmp_path, "x")
    (tmp_path / "f").write_text("")
    with pytest.raises(ModelSaveError, match=r"f/r\.json: cannot write"):
        io.write_atomic(tmp_path / "f" / "r.json", "x")


def test_write_atomic_leaves_no_temp_file_on_failure(tmp_path, monkeypatch):
    def boom(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(ModelSaveError, match="No space left"):
        io.write_atomic(tmp_path / "r.json", "x")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_report_save_uses_it(tmp_path, umask_027):
    from graphopt.engine.report import Report

    Report(input="m.onnx").save(tmp_path / "r.json")
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o640
    with pytest.raises(ModelSaveError, match="is a folder"):
        Report(input="m.onnx").save(tmp_path)

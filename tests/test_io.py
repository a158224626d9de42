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


def _unsorted_model(path, *, in_branch: bool = False):
    """Relu(Mul(Add(x, 1), x)) with its nodes listed backwards (ORT runs it; the checker refuses it)."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Add", ["x", "one"], ["a0"]),
             helper.make_node("Mul", ["a0", "x"], ["a"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = 9
    onnx.save(proto, path)
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(proto)


def test_unsorted_graph_is_sorted_on_load(tmp_path):
    import numpy as np
    import onnxruntime as ort

    src = tmp_path / "unsorted.onnx"
    _unsorted_model(src)
    model = io.load(src)
    assert [n.op_type for n in model.graph] == ["Add", "Mul", "Relu"]
    assert model.meta[io.NORMALIZED] == ["nodes sorted into topological order"]
    out = tmp_path / "sorted.onnx"
    io.save(model, out)
    import onnx

    onnx.checker.check_model(onnx.load(out))
    x = {"x": np.arange(8, dtype=np.float32).reshape(2, 4) - 4}
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, x)[0]  # noqa: E731
    np.testing.assert_array_equal(run(out), run(src))


def test_sorted_graph_is_left_alone(tmp_path):
    src = tmp_path / "unsorted.onnx"
    _unsorted_model(src)
    model = io.load(src)
    assert io.normalize(model) == []  # already in form now: nothing to do, nothing recorded again


def test_optimize_accepts_an_unsorted_graph(tmp_path):
    from graphopt.cli.main import main

    src = tmp_path / "unsorted.onnx"
    _unsorted_model(src)
    assert main(["optimize", str(src), "-o", str(tmp_path / "out.onnx")]) == 0

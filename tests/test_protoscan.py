"""A large self-contained model read with its weights left in its file (graphopt.protoscan): the same model,
the same optimized output, written inline again, and nothing held in memory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import load_models_module
from graphopt import io, protoscan
from graphopt.engine import pipeline
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model
from graphopt.errors import ModelLoadError

big = load_models_module("big_decoder")
TINY = big.Size(hidden=64, intermediate=128, layers=2, heads=4, vocab=1000)


@pytest.fixture(autouse=True)
def _small_weights_in_place(monkeypatch):
    monkeypatch.setattr(protoscan, "IN_PLACE_BYTES", 2**16)  # the tiny models' 64-256 KiB weights


def _mlp(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 256)).astype(np.float32), "w1")  # 64 KiB: in place
    w2 = numpy_helper.from_array(rng.standard_normal((256, 8)).astype(np.float16), "w2")  # 4 KiB: inline
    w3 = helper.make_tensor("w3", TensorProto.FLOAT, [64, 256], rng.standard_normal(64 * 256).tolist())  # float_data
    w1.doc_string = "the first weight"
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h1"]), helper.make_node("MatMul", ["x", "w3"], ["h3"]),
         helper.make_node("Add", ["h1", "h3"], ["h"]), helper.make_node("Cast", ["h"], ["hh"], to=TensorProto.FLOAT16),
         helper.make_node("MatMul", ["hh", "w2"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 8])], [w1, w2, w3])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.metadata_props.add(key="k", value="v")
    onnx.save(m, path)
    return path


def _inline_again(proto: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            with open(folder / info["location"], "rb") as f:
                f.seek(int(info["offset"]))
                t.raw_data = f.read(int(info["length"]))
            t.ClearField("data_location")
            del t.external_data[:]
    return proto


def test_read_in_place_is_the_file_with_its_weights_referenced(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    proto, left = protoscan.read_in_place(src)
    assert left == ["w1"]  # raw_data of at least IN_PLACE_BYTES; w2 is small, w3 has no raw_data
    assert proto.ByteSize() < 80_000  # w3 (float_data) is still inline, w1's 64 KiB are not
    w1 = proto.graph.initializer[0]
    assert w1.data_location == TensorProto.EXTERNAL and w1.doc_string == "the first weight"
    assert _inline_again(proto, tmp_path) == onnx.load(src)  # field for field the same message


def test_load_in_place_marks_only_what_it_left_in_the_file(tmp_path, monkeypatch):
    src = _mlp(tmp_path / "m.onnx")
    monkeypatch.setattr(io, "STREAM_BYTES", 1)
    model = io.load(src, in_place=True)
    w1 = model.graph.initializers["w1"].const_value
    assert isinstance(w1, ir.ExternalTensor) and protoscan.is_in_place(w1)
    assert not any(protoscan.is_in_place(model.graph.initializers[n].const_value) for n in ("w2", "w3"))
    whole = io.load(src)
    for n, v in whole.graph.initializers.items():
        np.testing.assert_array_equal(model.graph.initializers[n].const_value.numpy(), v.const_value.numpy())
    assert io.streams(model)  # ORT and the checker get a file pointing at the weights in place
    with io.materialize(model) as target:
        assert isinstance(target, str) and Path(target).parent == tmp_path and Path(target).stat().st_size < 80_000
        x = {"x": np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)}
        np.testing.assert_array_equal(run_model(target, [x])[0]["y"], run_model(str(src), [x])[0]["y"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # nothing left behind
    monkeypatch.setattr(io, "STREAM_BYTES", 2**40)
    assert not any(protoscan.is_in_place(v.const_value) for v in io.load(src, in_place=True).graph.initializers.values())


def test_saved_inline_byte_for_byte(tmp_path, monkeypatch):
    src = _mlp(tmp_path / "m.onnx")
    monkeypatch.setattr(io, "STREAM_BYTES", 1)
    a = io.save(io.load(src, in_place=True), tmp_path / "a" / "out.onnx")
    b = io.save(io.load(src), tmp_path / "b" / "out.onnx")
    assert not Path(str(a) + ".data").exists()  # still one self-contained file
    assert a.read_bytes() == b.read_bytes()
    # a tensor a pass moved where protostream does not stream it (a Constant) is inlined too
    model = io.load(src, in_place=True)
    w1 = model.graph.initializers.pop("w1")
    const = ir.node("Constant", [], attributes={"value": w1.const_value}, outputs=[ir.Value(name="w1")])
    model.graph.insert_before(model.graph.node(0), const)
    model.graph.node(1).replace_input_with(1, const.outputs[0])
    out = io.save(model, tmp_path / "c" / "out.onnx")
    proto = onnx.load(out, load_external_data=False)
    assert proto.graph.node[0].attribute[0].t.data_location == TensorProto.DEFAULT
    x = {"x": np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)}
    np.testing.assert_array_equal(run_model(str(out), [x])[0]["y"], run_model(str(src), [x])[0]["y"])


def test_links_and_broken_files_read_whole(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    os.symlink(src, tmp_path / "link.onnx")
    assert protoscan.read_in_place(tmp_path / "link.onnx")[1] == []
    os.link(src, tmp_path / "hard.onnx")
    assert protoscan.read_in_place(src)[1] == []  # onnx-ir refuses external data in a file of two names
    os.unlink(tmp_path / "hard.onnx")
    data = src.read_bytes()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        io.load(tmp_path / "cut.onnx", in_place=True)


def test_optimize_in_place_gives_the_in_memory_output(tmp_path, monkeypatch):
    dec = big.build(TINY, tmp_path / "dec" / "dec.onnx")
    inline = io.save(io.load(dec), tmp_path / "inline.onnx", external_data=False)
    feeds = [{"input_ids": np.array([[5, 6, 7]])}]
    in_memory = pipeline.optimize(str(inline), OptimizeOptions(feeds=feeds))
    monkeypatch.setattr(io, "STREAM_BYTES", 1)  # read in place, verified through files pointing into it
    in_place = pipeline.optimize(str(inline), OptimizeOptions(feeds=feeds))
    assert any(protoscan.is_in_place(v.const_value) for v in in_place.model.graph.initializers.values())
    assert in_memory.ok and in_place.ok
    assert [p.status for p in in_place.report.passes] == [p.status for p in in_memory.report.passes]
    assert [p.verification.get("max_abs") for p in in_place.report.passes] == \
        [p.verification.get("max_abs") for p in in_memory.report.passes]
    a = io.save(in_memory.model, tmp_path / "a" / "out.onnx")  # both written as a large model is
    b = io.save(in_place.model, tmp_path / "b" / "out.onnx")
    assert a.read_bytes() == b.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "dec", "inline.onnx"]


def test_output_replacing_its_input(tmp_path, monkeypatch):
    """``--in-place``: the weights are read from the input while the output that replaces it is written."""
    dec = big.build(TINY, tmp_path / "dec" / "dec.onnx")
    inline = io.save(io.load(dec), tmp_path / "inline.onnx", external_data=False)
    feeds = [{"input_ids": np.array([[5, 6, 7, 8]])}]
    before = run_model(str(inline), feeds)[0]["logits"]
    monkeypatch.setattr(io, "STREAM_BYTES", 1)
    res = pipeline.optimize_file(inline, inline, OptimizeOptions(feeds=feeds), in_place=True)
    assert res.ok and any(p.status == "ok" and p.modified for p in res.report.passes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dec", "inline.onnx"]
    after = io.load(inline)
    assert not any(isinstance(v.const_value, ir.ExternalTensor) for v in after.graph.initializers.values())
    np.testing.assert_allclose(run_model(str(inline), feeds)[0]["logits"], before, atol=1e-4, rtol=1e-4)

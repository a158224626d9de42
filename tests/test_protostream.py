"""Large weights written one tensor at a time, and shape-only protos: the same model, no second copy."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from graphopt import io, protostream
from graphopt.analysis.shapes import proto_without_big_data


def _model(path):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 128)).astype(np.float32)  # 32 KiB: streamed at a 1 KiB threshold
    w2 = rng.standard_normal((128, 8)).astype(np.float16)
    small = np.array([1.5], np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Cast", ["h"], ["hh"], to=TensorProto.FLOAT16),
         helper.make_node("MatMul", ["hh", "w2"], ["y16"]), helper.make_node("Cast", ["y16"], ["y32"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["y32", "s"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(small, "s"),
         helper.make_tensor("names", TensorProto.STRING, [2], [b"a", b"b"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.metadata_props.add(key="k", value="v")
    onnx.save(m, path)
    return path


def test_streamed_save_is_the_same_model(tmp_path, monkeypatch):
    src = _model(tmp_path / "m.onnx")
    model = io.load(src)
    monkeypatch.setattr(io, "STREAM_BYTES", 1)
    monkeypatch.setattr(protostream, "STREAM_TENSOR_BYTES", 1024)
    out = io.save(model, tmp_path / "out.onnx")
    a, b = onnx.load(out), io.to_proto(model)
    ta = {t.name: t for t in a.graph.initializer}
    tb = {t.name: t for t in b.graph.initializer}
    assert sorted(ta) == sorted(tb) == ["names", "s", "w1", "w2"]
    assert all(ta[k] == tb[k] for k in tb)  # bytes, dims, dtypes, the string tensor (written whole)
    assert [t.name for t in a.graph.initializer][-2:] == ["w1", "w2"]  # the streamed ones come last
    a.graph.ClearField("initializer")
    b.graph.ClearField("initializer")
    assert a == b  # everything else, value_info and metadata included
    onnx.checker.check_model(str(out))
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    ya = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    yb = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(ya, yb)
    assert [n for n in model.graph.initializers] == ["w1", "w2", "s", "names"]  # the model is left as it was


def test_shape_only_proto_declares_big_weights_as_inputs(tmp_path):
    model = io.load(_model(tmp_path / "m.onnx"))
    proto = proto_without_big_data(model, min_elements=1000)
    assert sorted(t.name for t in proto.graph.initializer) == ["names", "s"]
    inputs = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in proto.graph.input}
    assert inputs["w1"] == [64, 128] and inputs["w2"] == [128, 8]
    assert proto.ByteSize() < 2000  # no weight bytes
    assert sorted(model.graph.initializers) == ["names", "s", "w1", "w2"]
    assert model.graph.initializers["w1"].const_value.numpy().shape == (64, 128)
    assert isinstance(model.graph.initializers["w1"].const_value, ir.TensorProtocol)

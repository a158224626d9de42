"""tools/bench_int8_efficiency.py: the int8 GEMMs a model runs, read from ORT's profile, and the
GEMMs-alone model built from them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from conftest import load_tools_module


def _int8_model(path) -> None:
    """x[B, S, 8] -> QuantizeLinear -> MatMulIntegerToFloat(W[8, 16], bias) -> MatMulInteger(W2[16, 4]) path."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
             numpy_helper.from_array(np.array(128, np.uint8), "xz"),
             numpy_helper.from_array(rng.integers(-127, 128, (8, 16)).astype(np.int8), "w"),
             numpy_helper.from_array(np.full(16, 0.01, np.float32), "ws"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b"),
             numpy_helper.from_array(rng.integers(-127, 128, (8, 4)).astype(np.int8), "w2")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
             helper.make_node("MatMulIntegerToFloat", ["xq", "w", "xs", "ws", "xz", "", "b"], ["y"],
                              domain="com.microsoft", name="mm"),
             helper.make_node("MatMulInteger", ["xq", "w2", "xz"], ["y2"], name="mmi")]
    g = helper.make_graph(nodes, "int8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("y2", TensorProto.INT32, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    path.write_bytes(m.SerializeToString())


def test_profile_reads_every_gemm_per_batch_and_gemms_alone_repeats_them(tmp_path):
    tool = load_tools_module("bench_int8_efficiency")
    path = tmp_path / "m.onnx"
    _int8_model(path)
    feeds = [{"x": np.ones((2, 3, 8), np.float32)}, {"x": np.ones((4, 5, 8), np.float32)}]
    prof = tool.profile(str(path), feeds, runs=1)
    # (node, M, K, N) in execution order, one list per feed
    assert [sorted(batch) for batch in prof["gemms"]] == [[("mm", 6, 8, 16), ("mmi", 6, 8, 4)],
                                                          [("mm", 20, 8, 16), ("mmi", 20, 8, 4)]]
    assert prof["calls"]["MatMulIntegerToFloat"] == 2 and prof["calls"]["MatMulInteger"] == 2  # one round
    bias = tool.gemm_bias(str(path))
    assert bias == {"mm": True, "mmi": False}
    for op in ("MatMulIntegerToFloat", "MatMulInteger"):
        data, gfeeds = tool.gemms_alone(prof["gemms"], bias, op, "t")
        sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        order = [g[0] for g in prof["gemms"][0]]
        if op == "MatMulIntegerToFloat":  # the GEMM that had a bias keeps one
            nodes = onnx.load_from_string(data).graph.node
            assert [bool(nodes[order.index(k)].input[6]) for k in ("mm", "mmi")] == [True, False]
        widths = {"mm": 16, "mmi": 4}
        for f, m in zip(gfeeds, (6, 20)):
            assert [o.shape for o in sess.run(None, f)] == [(m, widths[k]) for k in order]

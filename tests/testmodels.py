"""Small hand-built ONNX models for tests (onnx.helper is fine here: tests are not rewrites)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def make_mlp(path: Path | None = None, *, opset: int = 17, seed: int = 0) -> onnx.ModelProto:
    """x[batch,8] -> MatMul -> Add -> Relu -> MatMul -> y[batch,4], with a foldable constant chain
    and an Identity, so cleanup has work to do."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Mul", ["b1", "two"], ["b1x2"], name="fold_me"),
        helper.make_node("Add", ["h0", "b1x2"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("Identity", ["h2"], ["h3"], name="ident"),
        helper.make_node("MatMul", ["h3", "w2"], ["y"], name="mm2"),
    ]
    g = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [w1, b1, w2, two],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="graphopt-tests")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    if path is not None:
        onnx.save(m, str(path))
    return m

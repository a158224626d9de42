"""The ai.graphopt custom ops: function bodies equal the dense computation on the pruned weights, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from graphopt.runtime import custom_ops
from graphopt.runtime import session as runtime


def _model(op: str, x_shape, inputs: dict[str, np.ndarray], attrs: dict, n: int) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape(x_shape), type=ir.TensorType(ir.DataType.FLOAT))
    consts = [ir.Value(name=k, const_value=ir.tensor(v, name=k)) for k, v in inputs.items()]
    y = ir.Value(name="y", shape=ir.Shape([*x_shape[:-1], n]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.Node(custom_ops.DOMAIN, op, [x, *consts], attributes=[ir.AttrInt64(k, v) for k, v in attrs.items()],
                   outputs=[y])
    graph = ir.Graph([x], [y], nodes=[node], initializers=consts, opset_imports={"": 17}, name="g")
    model = ir.Model(graph, ir_version=10)
    assert custom_ops.attach(model) == [op]
    return model


def _ints(rng, shape, lo=-3, hi=4):
    # small integers: every product and sum is exact in float32, so "equal" means bit for bit
    return rng.integers(lo, hi, size=shape).astype(np.float32)


@pytest.mark.parametrize("x_shape", [(5, 64), (2, 3, 64)])
@pytest.mark.parametrize(("block", "cols"), [(8, 8), (16, 16), (8, 24), (16, 48)])
def test_block_sparse_matmul_equals_dense_on_pruned_weights(x_shape, block, cols):
    rng = np.random.default_rng(0)
    k, n = 64, 48
    w = _ints(rng, (k, n))
    kb, nb = k // block, n // cols
    keep = np.zeros((kb, nb), bool)
    for j in range(nb):
        keep[rng.choice(kb, size=kb // 2, replace=False), j] = True
    pruned = w * np.kron(keep, np.ones((block, cols), bool))
    wb, idx = custom_ops.pack_blocks(pruned, keep, block, cols)
    assert wb.shape == (nb, kb // 2 * block, cols)
    model = _model("BlockSparseMatMul", x_shape, {"wb": wb, "idx": idx}, {"block_size": block}, n)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    x = _ints(rng, x_shape)
    got = runtime.make_session(model, optimize=False).run(None, {"x": x})[0]
    assert got.shape == (*x_shape[:-1], n)
    np.testing.assert_array_equal(got, x @ pruned)
    # and with ORT's optimizations on (the function inlined and fused as ORT likes)
    np.testing.assert_array_equal(runtime.make_session(model).run(None, {"x": x})[0], x @ pruned)


def test_nm_sparse_matmul_equals_dense_on_pruned_weights():
    rng = np.random.default_rng(1)
    k, n = 32, 24
    w = rng.standard_normal((k, n)).astype(np.float32)
    keep = np.zeros((k // 4, 4, n), bool)
    for g in range(k // 4):
        for c in range(n):
            keep[g, rng.choice(4, size=2, replace=False), c] = True
    keep = keep.reshape(k, n)
    pruned = np.where(keep, w, 0).astype(np.float32)
    vals, pos = custom_ops.pack_nm(pruned, keep)
    assert vals.shape == (k // 4, 2, n) and pos.dtype == np.uint8
    model = _model("NMSparseMatMul", (3, 7, k), {"vals": vals, "pos": pos}, {"n": 2, "m": 4}, n)
    x = rng.standard_normal((3, 7, k)).astype(np.float32)
    # the body rebuilds the pruned weight exactly and runs one MatMul: same bits as a MatMul on it
    dense = runtime.make_session(_dense(pruned, (3, 7, k)), optimize=False).run(None, {"x": x})[0]
    got = runtime.make_session(model, optimize=False).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, dense)


def _dense(w: np.ndarray, x_shape) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape(x_shape), type=ir.TensorType(ir.DataType.FLOAT))
    wv = ir.Value(name="w", const_value=ir.tensor(w, name="w"))
    y = ir.Value(name="y", shape=ir.Shape([*x_shape[:-1], w.shape[1]]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [y], nodes=[ir.Node("", "MatMul", [x, wv], outputs=[y])], initializers=[wv],
                     opset_imports={"": 17}, name="g")
    return ir.Model(graph, ir_version=10)


def test_pack_refuses_unbalanced_and_non_nm_masks():
    w = np.ones((8, 8), np.float32)
    keep = np.array([[1, 0], [1, 1]], bool)
    with pytest.raises(ValueError, match="not balanced"):
        custom_ops.pack_blocks(w, keep, 4)
    with pytest.raises(ValueError, match="2:4"):
        custom_ops.pack_nm(w, np.ones((8, 8), bool))

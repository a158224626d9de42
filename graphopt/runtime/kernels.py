"""What the installed ONNX Runtime's CPU kernels compute on this machine, measured at run time.

ORT's x86 int8 GEMM (MLAS) for u8 activations x s8 weights on AVX2 / AVX-512 without VNNI multiplies
with ``vpmaddubsw``, which adds two u8·s8 products into a *saturating* int16: with activations near 255
and weights near ±127 the sum (up to 2·255·127 = 64770) is clipped to 32767 and the int32 result is
wrong (measured on an AMD EPYC with AVX2 only, ORT 1.32: relative error 0.48 on a one-node
``MatMulInteger``). With VNNI / AMX the products are accumulated in int32 and the kernel is exact; the
u8 x u8 and s8 x s8 kernels widen to int16 first and are exact either way. Which kernel ORT dispatches
depends on the CPU and the ORT build, so it is not assumed: :func:`int8_gemm_exact` runs a one-node
``MatMulInteger`` with saturating operands once per process and compares it with the exact result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphopt.runtime.session import make_session

#: the integer types of the probe, by their short names
_TYPES = {"u8": np.uint8, "s8": np.int8}


def probe_operands(a_type: str, b_type: str) -> tuple[np.ndarray, np.ndarray]:
    """Operands whose adjacent products overflow int16: the extremes of each type, and a mixed column."""
    a_dt, b_dt = _TYPES[a_type], _TYPES[b_type]
    ai, bi = np.iinfo(a_dt), np.iinfo(b_dt)
    m, k = 8, 64
    rng = np.random.default_rng(0)
    a = np.full((m, k), ai.max, a_dt)
    a[1] = ai.min  # s8: -128 · -128 pairs; u8: zeros (an exact row)
    a[2:] = rng.integers(int(ai.max) - 15, int(ai.max) + 1, (m - 2, k))
    cols = [np.full(k, bi.max), np.full(k, bi.min), np.full(k, bi.max - 1), np.full(k, bi.min + 1),
            rng.integers(int(bi.max) - 15, int(bi.max) + 1, k), rng.integers(int(bi.min), int(bi.min) + 16, k),
            rng.integers(int(bi.min), int(bi.max) + 1, k), np.zeros(k)]
    b = np.stack(cols, axis=1).astype(b_dt)
    return a, b


def _ort_matmul_integer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``MatMulInteger(a, b)`` on ORT's CPU provider (b a constant weight, as in a quantized model)."""

    types = {np.dtype(np.uint8): onnx.TensorProto.UINT8, np.dtype(np.int8): onnx.TensorProto.INT8}
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "int8_probe",
        [helper.make_tensor_value_info("a", types[a.dtype], list(a.shape))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [a.shape[0], b.shape[1]])],
        [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = make_session(model.SerializeToString(), threads=1)
    return sess.run(None, {"a": a})[0]


def gemm_is_exact(a_type: str, b_type: str, run: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> bool:
    """Whether ``run(a, b)`` (an int8 GEMM) equals the exact integer product on saturating operands."""
    a, b = probe_operands(a_type, b_type)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    got = np.asarray(run(a, b))
    return got.shape == exact.shape and bool(np.array_equal(got.astype(np.int64), exact))


@functools.cache
def int8_gemm_exact(a_type: str, b_type: str) -> bool:
    """Whether the installed ORT's CPU int8 GEMM of ``a_type`` activations x ``b_type`` weights (``u8`` /
    ``s8``) is exact on this CPU; measured once per process."""
    return gemm_is_exact(a_type, b_type, _ort_matmul_integer)

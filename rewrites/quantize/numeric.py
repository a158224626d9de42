"""The arithmetic of int8 quantization: per-channel symmetric weights, activation scale and zero point,
fake-quantized activations (what the integer ops compute, in numpy), and how the int8 weights are stored
for the CPU's int8 kernel (:func:`int8_weights`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from graphopt.runtime import kernels

#: weights with more elements are quantized in blocks of columns (the same numbers, bounded temporaries)
BLOCK_ELEMENTS = 1 << 22


#: how int8 weights are stored: ``s8`` int8 in [-127, 127]; ``u8`` the same values plus 128 as uint8 with
#: zero point 128 (ORT then runs its u8 x u8 kernel); ``s7`` int8 in [-64, 64] (ORT's ``reduce_range``)
WEIGHT_QMAX = {"s8": 127, "u8": 127, "s7": 64}


def quantize_weight(w: np.ndarray, axis: int = 1, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel symmetric int8 in [-qmax, qmax] along ``axis`` (the output columns of a [K, N] weight)."""
    if w.ndim == 2 and axis == 1 and w.size > BLOCK_ELEMENTS:
        step = max(1, BLOCK_ELEMENTS // w.shape[0])
        q, scale = np.empty(w.shape, np.int8), np.empty(w.shape[1], np.float32)
        for c in range(0, w.shape[1], step):
            q[:, c:c + step], scale[c:c + step] = quantize_weight(w[:, c:c + step], axis, qmax)
        return q, scale
    red = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.max(np.abs(w), axis=red)
    scale = np.maximum(amax / float(qmax), 1e-12).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(shape)), -qmax, qmax).astype(np.int8)
    return q, scale


def store_weight(q: np.ndarray, weights: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``q`` (int8, per column) as stored for ``weights``: (values, per-column zero point or None for 0).
    ``u8``: q + 128 as uint8 with zero point 128 (the same integers after the zero point)."""
    if weights != "u8":
        return q, None
    return (q.astype(np.int16) + 128).astype(np.uint8), np.full(q.shape[-1], 128, np.uint8)


def int8_weights(act_type: str, exact: Callable[[str, str], bool] = kernels.int8_gemm_exact) -> tuple[str, str]:
    """How to store int8 weights read with ``act_type`` activations on this CPU, and why (empty: as always).

    ``s8`` where ORT's act x s8 kernel is exact (``exact``: measured, :mod:`graphopt.runtime.kernels`).
    Where it saturates (u8 x s8 without VNNI): ``u8`` weights when the u8 x u8 kernel is exact: the same
    integers, so the same results as an exact u8 x s8 kernel, at full 8-bit precision (7-bit weights or
    7-bit activations would lose a bit; s8 activations lose the asymmetric range of e.g. GELU outputs,
    and ORT's s8 x s8 MatMulIntegerToFloat measured ~3x slower than u8 x u8 on AVX2); else ``s7``
    (``reduce_range``): two u8 · s7 products sum to at most 2·255·64 = 32640, which int16 holds.
    """
    if exact(act_type, "s8"):
        return "s8", ""
    if act_type == "u8" and exact("u8", "u8"):
        return "u8", ("ORT's u8 x s8 int8 kernel saturates on this CPU (no VNNI), its u8 x u8 kernel is exact: "
                      "int8 weights stored as u8 with zero point 128 (the same values, exact)")
    return "s7", (f"ORT's {act_type} x s8 int8 kernel saturates on this CPU (no VNNI): 7-bit int8 weights "
                  "(reduce_range, [-64, 64]), which cannot saturate")


def act_qparams(lo: float, hi: float, act_type: str) -> tuple[np.float32, np.ndarray]:
    """(scale, zero point) for an activation range; u8 asymmetric or s8 symmetric."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if act_type == "s8":
        scale = max(max(-lo, hi) / 127.0, 1e-8)
        return np.float32(scale), np.array(0, dtype=np.int8)
    scale = max((hi - lo) / 255.0, 1e-8)
    zp = int(np.clip(np.rint(-lo / scale), 0, 255))
    return np.float32(scale), np.array(zp, dtype=np.uint8)


def fake_quant_act(x: np.ndarray, lo: float | None, hi: float | None, act_type: str = "u8") -> np.ndarray:
    """Quantize-dequantize an activation (dynamic range when ``lo``/``hi`` are None)."""
    if lo is None or hi is None:
        lo, hi = float(x.min()), float(x.max())
    s, zp = act_qparams(lo, hi, act_type)
    z = float(zp)
    qmin, qmax = (-127, 127) if act_type == "s8" else (0, 255)
    return ((np.clip(np.rint(x / s) + z, qmin, qmax) - z) * s).astype(np.float32)

"""The arithmetic of int8 quantization: per-channel symmetric weights, activation scale and zero point,
and fake-quantized activations (what the integer ops compute, in numpy)."""

from __future__ import annotations

import numpy as np

#: weights with more elements are quantized in blocks of columns (the same numbers, bounded temporaries)
BLOCK_ELEMENTS = 1 << 22


def quantize_weight(w: np.ndarray, axis: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel symmetric int8 along ``axis`` (the output columns of a [K, N] weight)."""
    if w.ndim == 2 and axis == 1 and w.size > BLOCK_ELEMENTS:
        step = max(1, BLOCK_ELEMENTS // w.shape[0])
        q, scale = np.empty(w.shape, np.int8), np.empty(w.shape[1], np.float32)
        for c in range(0, w.shape[1], step):
            q[:, c:c + step], scale[c:c + step] = quantize_weight(w[:, c:c + step], axis)
        return q, scale
    red = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.max(np.abs(w), axis=red)
    scale = np.maximum(amax / 127.0, 1e-12).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


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

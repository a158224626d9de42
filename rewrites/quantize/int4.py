"""4-bit weight-only quantization for ``MatMulNBits``: RTN and GPTQ, and the packing ORT expects.

Blocks of ``block_size`` consecutive K elements of one output column share a scale; values are
symmetric 4-bit ``q in [0, 15]`` with the implied zero point 8 (``w ~ (q - 8) * scale``).
Packed layout (ORT ``MatMulNBits``): ``B[n, block, j]`` holds elements ``2j`` (low nibble) and
``2j+1`` (high nibble) of that block; scales are ``[N, n_blocks]`` flattened. K is zero-padded to a
multiple of the block size.

GPTQ (Frantar et al. 2022) quantizes the columns of K in order and spreads each rounding error over
the not-yet-quantized rows with the inverse Hessian ``H = 2 XᵀX`` of the layer's calibration inputs.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

#: weights with more elements go through GPTQ a block of output columns at a time (the same numbers)
BLOCK_ELEMENTS = 1 << 22


def _pad_k(w: np.ndarray, block: int) -> np.ndarray:
    k = w.shape[0]
    kp = -(-k // block) * block
    if kp == k:
        return w
    return np.concatenate([w, np.zeros((kp - k, w.shape[1]), w.dtype)], axis=0)


def block_scales(w: np.ndarray, block: int) -> np.ndarray:
    """Scales [n_blocks, N] of a [K, N] weight (K padded)."""
    wp = _pad_k(w, block)
    nb = wp.shape[0] // block
    amax = np.abs(wp.reshape(nb, block, -1)).max(axis=1)
    return np.maximum(amax / 7.0, 1e-12).astype(np.float32)


def rtn_int4(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest: (q uint8 [Kp, N] in 0..15, scales [n_blocks, N])."""
    scales = block_scales(w, block)
    wp = _pad_k(w, block)
    s = np.repeat(scales, block, axis=0)
    q = np.clip(np.rint(wp / s), -8, 7) + 8
    return q.astype(np.uint8), scales


def dequant_int4(q: np.ndarray, scales: np.ndarray, block: int, k: int) -> np.ndarray:
    s = np.repeat(scales, block, axis=0)
    return ((q.astype(np.float32) - 8.0) * s)[:k]


def gptq_int4(w: np.ndarray, xtx: np.ndarray, block: int, damp: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ with fixed per-block scales (from RTN of the original weight); ``xtx`` is XᵀX [K, K]."""
    k, n = w.shape
    scales = block_scales(w, block)
    h = xtx.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    try:
        hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky of H^-1
    except np.linalg.LinAlgError:
        logger.info("GPTQ: Hessian not positive definite; falling back to RTN")
        return rtn_int4(w, block)
    q = np.zeros((k, n), np.uint8)
    # output columns are independent: a block of them at a time bounds the float64 working copies
    step = n if w.size <= BLOCK_ELEMENTS else max(1, BLOCK_ELEMENTS // k)
    for c in range(0, n, step):
        cols = slice(c, c + step)
        wk = w[:, cols].astype(np.float64)
        wk[dead, :] = 0.0
        for i in range(k):
            s = scales[i // block, cols].astype(np.float64)
            qi = np.clip(np.rint(wk[i] / s), -8, 7)
            q[i, cols] = (qi + 8).astype(np.uint8)
            err = (wk[i] - qi * s) / hinv[i, i]
            if i + 1 < k:
                wk[i + 1:] -= np.outer(hinv[i, i + 1:], err)
    qp = _pad_k(q, block)
    if qp.shape[0] > k:
        qp[k:] = 8
    return qp, scales


def pack_int4(q: np.ndarray, block: int) -> np.ndarray:
    """[Kp, N] values 0..15 -> uint8 [N, n_blocks, block // 2]."""
    kp, n = q.shape
    nb = kp // block
    t = q.T.reshape(n, nb, block // 2, 2).astype(np.uint8)
    return (t[..., 0] | (t[..., 1] << 4)).astype(np.uint8)

"""4-bit weight blocks for ``MatMulNBits`` and ``GatherBlockQuantized``, and decode-step timing of candidates.

RTN quantization and packing are ONNX Runtime's own (``onnxruntime.quantization.matmul_nbits_quantizer``'s
``DefaultWeightOnlyQuantizer.qbits_block_quant``, its C++ kernel): ``packed [N, n_blocks, block/2]``,
``scales [N, n_blocks]``, ``zero_points [N, ceil(n_blocks/2)]`` (two 4-bit zero points a byte; symmetric:
none, the implied 8). GPTQ uses :func:`.int4.gptq_int4` (symmetric).

An embedding table ``[V, H]`` is blocked along H (``GatherBlockQuantized``, ``quantize_axis=1``): the same
quantizer on the transposed table gives one row's blocks per "column", which is the layout the op reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from graphopt.rewrites.quantize.blocks8 import rtn8
from graphopt.rewrites.quantize.int4 import gptq_int4, pack_int4


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One weight in 4-bit blocks (ORT's MatMulNBits layout)."""

    packed: np.ndarray  # uint8 [N, n_blocks, block // 2]
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray | None  # uint8 [N, ceil(n_blocks / 2)]; None: symmetric (implied 8)
    block_size: int
    #: exact affine blocks (``w = d·q + m``): the block minimums ``m`` [n_blocks, N], added back as
    #: ``ReduceSum(x per block) @ m`` beside ``MatMulNBits(x, q, d, zero points 0)``; None for RTN / GPTQ
    mins: np.ndarray | None = None
    #: exact blocks: the largest ``|d·q + m - w|`` over the weight
    max_error: float = 0.0
    #: 4, or 8: ``packed`` is uint8 [N, n_blocks, block] codes with the implied zero point 128
    bits: int = 4


def rtn_blocks(w: np.ndarray, block_size: int, symmetric: bool) -> Blocks:
    """Round-to-nearest 4-bit blocks of a [K, N] float32 weight (ONNX Runtime's quantizer)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                                                bits=4))
    packed, scales, zp = q.qbits_block_quant(np.ascontiguousarray(w, np.float32))
    return Blocks(packed, scales.astype(np.float32), None if symmetric else zp, block_size)


def exact_blocks(w: np.ndarray, block_size: int = 32, tol: float = 1e-3) -> Blocks | None:
    """The 4-bit affine blocks a [K, N] weight already is (``w = d·q + m``, ``q`` in 0..15 per block of
    ``block_size`` along K, e.g. a dequantized GGUF Q4_1 tensor), or None when it is not: every element must
    be within ``tol·d`` of its block's grid (the rounding of the dequantization, far below a 4-bit step)."""
    k, n = w.shape
    if k % block_size:
        return None
    wb = w.reshape(k // block_size, block_size, n).astype(np.float64)
    mn, mx = wb.min(axis=1), wb.max(axis=1)  # [nb, N]: Q4_1's m is the block minimum, m + 15 d its maximum
    d = (mx - mn) / 15.0
    safe = np.where(d > 0, d, 1.0)
    qf = (wb - mn[:, None, :]) / safe[:, None, :]
    q = np.rint(qf)
    err = np.abs(qf - q) * safe[:, None, :]
    if np.any(err > tol * safe[:, None, :]):
        return None
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(k, n)
    nb = k // block_size
    return Blocks(pack_int4(q, block_size), np.ascontiguousarray(d.T, np.float32),
                  np.zeros((n, (nb + 1) // 2), np.uint8), block_size, mins=np.ascontiguousarray(mn, np.float32),
                  max_error=float(err.max()))


def gptq_blocks(w: np.ndarray, xtx: np.ndarray, block_size: int) -> Blocks:
    """GPTQ 4-bit blocks (symmetric) of a [K, N] weight given its inputs' XᵀX."""
    q, scales = gptq_int4(w, xtx, block_size)
    return Blocks(pack_int4(q, block_size), np.ascontiguousarray(scales.T, np.float32), None, block_size)


def rtn8_blocks(w: np.ndarray, block_size: int) -> Blocks:
    """Symmetric 8-bit blocks of a [K, N] float32 weight (``d = max|w| / 127`` per block, implied zero point 128)."""
    codes, d, _ = rtn8(np.ascontiguousarray(w.T), block_size)
    return Blocks(codes, d, None, block_size, bits=8)


def dequant(b: Blocks, k: int) -> np.ndarray:
    """The [K, N] float32 weight that ``b`` holds."""
    if b.bits == 8:
        q = b.packed.astype(np.float32) - 128.0
    else:
        q = np.stack([b.packed & 0xF, b.packed >> 4], axis=-1).reshape(b.packed.shape[0], b.packed.shape[1], -1)
        q = q.astype(np.float32)
        nb = q.shape[1]
        if b.zero_points is None:
            q -= 8.0
        else:
            zp = np.stack([b.zero_points & 0xF, b.zero_points >> 4], axis=-1).reshape(q.shape[0], -1)[:, :nb]
            q -= zp[..., None].astype(np.float32)
    w = q * b.scales.reshape(q.shape[0], q.shape[1])[..., None]
    if b.mins is not None:
        w += b.mins.T[..., None]
    return np.ascontiguousarray(w.reshape(q.shape[0], -1).T[:k])

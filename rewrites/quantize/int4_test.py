"""Tests of _quant_int4: RTN and GPTQ 4-bit weights and the MatMulNBits packing."""

from __future__ import annotations

import numpy as np
import pytest

from graphopt.rewrites.quantize import int4

RNG = np.random.default_rng(2)


@pytest.mark.parametrize("k", [64, 40])  # 40: K padded to a multiple of the block
def test_rtn_values_scales_and_error(k):
    w = RNG.standard_normal((k, 6)).astype(np.float32)
    q, scales = int4.rtn_int4(w, 32)
    assert q.dtype == np.uint8 and q.shape == (64, 6) and q.min() >= 1 and q.max() <= 15  # symmetric: -7..7
    assert scales.shape == (2, 6)
    np.testing.assert_allclose(scales[0], np.abs(w[:32]).max(axis=0) / 7, rtol=1e-6)
    back = int4.dequant_int4(q, scales, 32, k)
    assert back.shape == w.shape
    assert np.all(np.abs(back - w) <= np.repeat(scales, 32, axis=0)[:k] / 2 + 1e-6)
    assert np.all(q[k:] == 8)  # padding rows hold zero


def test_gptq_without_correlations_is_rtn():
    """With XᵀX diagonal, no rounding error has anywhere to go: GPTQ gives RTN's values."""
    w = RNG.standard_normal((64, 5)).astype(np.float32)
    xtx = np.diag(RNG.uniform(1, 2, 64))
    q_gptq, s_gptq = int4.gptq_int4(w, xtx, 32)
    q_rtn, s_rtn = int4.rtn_int4(w, 32)
    np.testing.assert_array_equal(q_gptq, q_rtn)
    np.testing.assert_array_equal(s_gptq, s_rtn)


def test_gptq_dead_inputs_and_padding():
    """Input channels never active (zero diagonal) get weight 0; K=40 pads to 64 with zeros."""
    w = RNG.standard_normal((40, 4)).astype(np.float32)
    x = RNG.standard_normal((200, 40))
    x[:, 3] = 0.0
    q, scales = int4.gptq_int4(w, x.T @ x, 32)
    assert q.shape == (64, 4) and np.all(q[3] == 8) and np.all(q[40:] == 8)
    # a lower layer error than RTN on the inputs it was given
    def err(qq, ss):
        return np.linalg.norm(x @ int4.dequant_int4(qq, ss, 32, 40) - x @ w)

    assert err(q, scales) < err(*int4.rtn_int4(w, 32))


def test_pack_int4_layout():
    """``B[n, block, j]`` = element 2j (low nibble) | element 2j+1 (high nibble) of column n."""
    q = np.array([[1, 9], [2, 10], [3, 11], [4, 12]], np.uint8)  # K=4, N=2
    packed = int4.pack_int4(q, 4)
    assert packed.shape == (2, 1, 2) and packed.dtype == np.uint8
    assert packed[0, 0].tolist() == [0x21, 0x43] and packed[1, 0].tolist() == [0xA9, 0xCB]

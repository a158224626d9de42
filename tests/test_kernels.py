"""The run-time probe of ORT's int8 GEMM (graphopt.runtime.kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from graphopt.runtime import kernels


def _saturating(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A u8 x s8 kernel without VNNI: adjacent products summed in a saturating int16 (vpmaddubsw)."""
    p = a.astype(np.int64)[:, :, None] * b.astype(np.int64)[None, :, :]
    pairs = np.clip(p[:, 0::2] + p[:, 1::2], -32768, 32767)
    return pairs.sum(axis=1).astype(np.int32)


@pytest.mark.parametrize(("a_type", "b_type"), [("u8", "s8"), ("u8", "u8"), ("s8", "s8")])
def test_probe_tells_an_exact_kernel_from_a_saturating_one(a_type, b_type):
    exact = lambda a, b: (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)  # noqa: E731
    assert kernels.gemm_is_exact(a_type, b_type, exact)
    # the operands overflow an int16 sum of two products for every pair of types
    assert not kernels.gemm_is_exact(a_type, b_type, _saturating)
    assert not kernels.gemm_is_exact(a_type, b_type, lambda a, b: exact(a, b) + 1)  # off by one
    assert not kernels.gemm_is_exact(a_type, b_type, lambda a, b: exact(a, b)[:, :-1])  # wrong shape


def test_probe_of_the_installed_ort_is_cached_and_consistent():
    first = kernels.int8_gemm_exact("u8", "s8")
    assert isinstance(first, bool) and kernels.int8_gemm_exact("u8", "s8") is first
    assert kernels.int8_gemm_exact.cache_info().hits >= 1
    assert kernels.int8_gemm_exact("u8", "u8")  # u8 x u8 widens to int16 before multiplying: exact everywhere
    a, b = kernels.probe_operands("u8", "s8")
    got = kernels._ort_matmul_integer(a, b)
    assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64)) == first

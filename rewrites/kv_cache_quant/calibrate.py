"""Per-channel scales of a decoder's keys and values, from the cache its float graph writes on calibration text.

The keys in the cache are rotated (rotary inside GroupQueryAttention): the key of position ``p`` is ``R(p θ)``
applied to the projection, pair by pair. Calibration windows are short (tens of tokens), so a slowly rotating
pair is seen at a few angles only, and a scale fitted to them clips it at the long contexts the cache is for.
Rotating a cached key by the table row of a shift ``δ`` gives exactly that key at position ``p + δ``, so each
key sample is also taken at ``shifts`` random positions below the rotary table's length: the scales see every
angle a long context reaches. Values are not rotated and are taken as they are.

Each channel's scale is ``clip * amax / qmax``, ``clip`` the ratio in ``CLIPS`` with the least squared error
over the samples (``clip="mse"``), or 1 (``clip="max"``: nothing is clipped).
"""

from __future__ import annotations

import numpy as np

#: clip ratios of amax tried per channel (clip="mse")
CLIPS = tuple(np.round(np.arange(1.0, 0.49, -0.05), 2))
QMAX = {8: 127.0, 4: 7.0}


def rotate(keys: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """``keys`` [..., n, D] rotated by the rotary table rows ``cos`` / ``sin`` [n, D/2] (one row per sample)."""
    half = keys.shape[-1] // 2
    if interleaved:
        x, y = keys[..., 0::2], keys[..., 1::2]
    else:
        x, y = keys[..., :half], keys[..., half:]
    rx, ry = x * cos - y * sin, x * sin + y * cos
    if interleaved:
        out = np.empty_like(keys)
        out[..., 0::2], out[..., 1::2] = rx, ry
        return out
    return np.concatenate([rx, ry], axis=-1)


def key_samples(keys: np.ndarray, cos_table: np.ndarray, sin_table: np.ndarray, interleaved: bool,
                shifts: int, seed: int = 0) -> np.ndarray:
    """[kv_heads, n * (1 + shifts), D]: the cached keys [kv_heads, n, D] and each rotated to ``shifts`` random
    positions of the table."""
    rng = np.random.default_rng(seed)
    out = [keys]
    for _ in range(shifts):
        rows = rng.integers(0, cos_table.shape[0], keys.shape[1])
        out.append(rotate(keys, cos_table[rows], sin_table[rows], interleaved))
    return np.concatenate(out, axis=1)


def _fake_quant(x: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    q = QMAX[bits]
    return np.clip(np.rint(x / scale), -q - 1, q) * scale


def channel_scales(samples: np.ndarray, bits: int, clip: str = "mse") -> np.ndarray:
    """[1, kv_heads, 1, D] float32 scales of ``samples`` [kv_heads, n, D] at ``bits`` (see the module docstring)."""
    amax = np.abs(samples).max(axis=1)  # [h, D]
    amax = np.where(amax > 0, amax, 1e-6).astype(np.float32)
    best = amax / QMAX[bits]
    if clip == "mse":
        err = ((_fake_quant(samples, best[:, None, :], bits) - samples) ** 2).sum(axis=1)
        for r in CLIPS[1:]:
            scale = amax * r / QMAX[bits]
            e = ((_fake_quant(samples, scale[:, None, :], bits) - samples) ** 2).sum(axis=1)
            better = e < err
            best, err = np.where(better, scale, best), np.where(better, e, err)
    return best.astype(np.float32)[None, :, None, :]

"""A KV cache held quantized: what a graph of pass ``quantize-kv-cache`` stores, and how to read it as floats.

ONNX Runtime's ``GroupQueryAttention`` (CPU kernel, 1.32) quantizes the new keys and values itself and attends
over the quantized past: its ``past_key`` / ``past_value`` are ``int8`` (8 bits) or ``uint8`` holding two 4-bit
values per byte (4 bits), with static float ``k_scale`` / ``v_scale`` of shape ``[1, kv_heads, 1, head_dim]``
(one scale per channel, calibrated on text by the pass). Symmetric, no zero point::

    8 bits:  q = clip(round(x / scale), -128, 127)                    x ≈ q * scale
    4 bits:  q = clip(round(x / scale), -8, 7) + 8   two per byte:   byte = q[2i] | q[2i + 1] << 4

Such a graph says so in its metadata: ``graphopt.kv_cache_quant = int8 | int4`` beside
``graphopt.kv_cache = shared-buffer``. The runtime then holds the cache in that form: the buffers
(``cache.KVCache``) are ``int8`` / ``uint8`` of ``[batch, kv_heads, max_length, stored_width]`` where
``stored_width`` is ``head_dim`` (8 bits) or ``head_dim / 2`` (4 bits); the signature's ``head_dim`` is that
stored width (the past input's last axis) and ``kv_bits`` the bit width. Nothing is dequantized outside the graph.

The scales are initializers named after the past they scale (``past_key_values.N.key.scale``), so a caller
holding float past tensors (verification feeds) can quantize them, and read quantized presents back as floats
(:class:`FloatIO`).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper

KV_QUANT_KEY = "graphopt.kv_cache_quant"
#: metadata value -> (bits, the stored element type)
FORMATS = {"int8": (8, np.dtype(np.int8)), "int4": (4, np.dtype(np.uint8))}
_TYPES = {"tensor(int8)": np.dtype(np.int8), "tensor(uint8)": np.dtype(np.uint8)}


def scale_name(past: str) -> str:
    """The initializer that holds the per-channel scale of past input ``past``."""
    return f"{past}.scale"


def cache_format(metadata: dict[str, str], past_type: str) -> tuple[int, np.dtype] | None:
    """(bits, stored dtype) of a quantized cache whose past inputs are ``past_type``; None when the metadata
    says the cache is not quantized; ValueError when it says so but the inputs do not match."""
    fmt = metadata.get(KV_QUANT_KEY)
    if fmt is None:
        return None
    if fmt not in FORMATS:
        raise ValueError(f"metadata {KV_QUANT_KEY}={fmt!r} is not one of {', '.join(FORMATS)}")
    bits, dtype = FORMATS[fmt]
    if _TYPES.get(past_type) != dtype:
        raise ValueError(f"metadata {KV_QUANT_KEY}={fmt} but the past tensors are {past_type}, not tensor({dtype})")
    return bits, dtype


def stored_width(head_dim: int, bits: int) -> int:
    """The last axis of a cache tensor holding ``head_dim`` values per position at ``bits``."""
    return head_dim * bits // 8


def bytes_per_token(layers: int, kv_heads: int, width: int, itemsize: int) -> int:
    """Bytes the cache holds per position per row (keys and values of every layer)."""
    return layers * 2 * kv_heads * width * itemsize


def quantize(x: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """``x`` [..., head_dim] quantized as ONNX Runtime's GroupQueryAttention stores it (``scale`` broadcasts)."""
    r = np.rint(np.asarray(x, np.float32) / scale)
    if bits == 8:
        return np.clip(r, -128, 127).astype(np.int8)
    q = (np.clip(r, -8, 7) + 8).astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def dequantize(q: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """Float values [..., head_dim] of a quantized cache tensor."""
    if bits == 8:
        return q.astype(np.float32) * scale
    lo = (q & 0x0F).astype(np.int8) - 8
    hi = (q >> 4).astype(np.int8) - 8
    vals = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    return vals.astype(np.float32) * scale


class SessionView:
    """A session's inputs and outputs, seen through an adapter whose ``run`` translates the feeds."""

    def __init__(self, session):
        self._s = session

    def get_inputs(self):
        return self._s.get_inputs()

    def get_outputs(self):
        return self._s.get_outputs()

    def get_overridable_initializers(self):
        return self._s.get_overridable_initializers()


class FloatIO(SessionView):
    """A session of a quantized-cache graph seen with float past and present tensors: ``run`` quantizes the
    float past feeds with the graph's scales and dequantizes the presents (for verification feeds and
    references made for the float graph). ``scales``: past input name -> its scale array."""

    def __init__(self, session, bits: int, scales: dict[str, np.ndarray], presents: dict[str, str]):
        super().__init__(session)
        self.bits, self._scales, self._presents = bits, scales, presents

    def run(self, names, feed, *args):
        fed = {k: quantize(v, self._scales[k], self.bits) if k in self._scales and v.dtype.kind == "f" else v
               for k, v in feed.items()}
        outs = self._s.run(names, fed, *args)
        back = {p: self._scales[k] for k, p in self._presents.items()}
        return [dequantize(o, back[n], self.bits) if n in back else o for n, o in zip(names, outs)]


def graph_scales(model) -> tuple[int, dict[str, np.ndarray]] | None:
    """(bits, past input name -> scale) of ``model`` (an onnx_ir Model, an ONNX ModelProto or file) when it
    holds its KV cache quantized, else None."""
    if hasattr(model, "metadata_props") and isinstance(model.metadata_props, dict):  # an onnx_ir Model
        fmt = model.metadata_props.get(KV_QUANT_KEY)
        if fmt not in FORMATS:
            return None
        graph = model.graph
        return FORMATS[fmt][0], {v.name: graph.initializers[scale_name(v.name)].const_value.numpy()
                                 for v in graph.inputs if scale_name(v.name) in graph.initializers}
    base = ""
    if isinstance(model, (str, os.PathLike)):
        base = os.path.dirname(os.fspath(model))
        model = onnx.load(os.fspath(model), load_external_data=False)
    if not isinstance(model, onnx.ModelProto):
        return None
    fmt = {p.key: p.value for p in model.metadata_props}.get(KV_QUANT_KEY)
    if fmt not in FORMATS:
        return None
    inits = {t.name: t for t in model.graph.initializer}
    return FORMATS[fmt][0], {i.name: numpy_helper.to_array(inits[scale_name(i.name)], base_dir=base)
                             for i in model.graph.input if scale_name(i.name) in inits}


def float_io(session, model) -> object:
    """``session`` itself, or a :class:`FloatIO` over it when ``model`` holds its KV cache quantized."""
    found = graph_scales(model)
    if found is None:
        return session
    return FloatIO(session, found[0], found[1], _presents(found[1]))


def quantized_feeds(model, feeds):
    """``feeds`` made for the float graph, their float past quantized when ``model`` holds its cache quantized
    (once, e.g. before timing runs)."""
    found = graph_scales(model)
    if found is None:
        return feeds
    bits, scales = found
    return [{k: quantize(v, scales[k], bits) if k in scales and v.dtype.kind == "f" else v for k, v in f.items()}
            for f in feeds]


def _presents(scales: dict[str, np.ndarray]) -> dict[str, str]:
    """past input -> its present output (``past_key_values.N.key`` -> ``present.N.key``)."""
    return {p: "present." + p[len("past_key_values."):] for p in scales}

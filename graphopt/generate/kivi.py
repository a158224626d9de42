"""A KIVI-form KV cache: keys per channel over groups of tokens, values per token, in 2-4 bits with dynamic
scales; the first ``sink`` positions and the keys of an unfinished group in float16 (pass ``kivi-kv-cache``).

ONNX Runtime's quantized ``GroupQueryAttention`` cache has static scales only; at thousands of positions that
costs SmolLM2 a quarter of its perplexity at 4 bits. KIVI's form (Liu et al., 2024) needs scales that follow
the data, so a graph of this form attends in standard ops over a cache the runtime quantizes as it fills::

    position  0 .. sink-1 | sink .. sink + Qk - 1            | .. L - 1           | L .. L + n - 1
    keys      float16     | kb-bit codes, scale/min per       | float16 window     | new (float, the graph's
                          | (group of G tokens, channel)      | (< G positions)    |  present output)
    values    float16     | vb-bit codes, scale/min per (token, row) over every head's channels  | new

Buffers are position-major (``[positions, batch, kv_heads, ...]``; keys ``[groups, batch, kv_heads, D, G]``,
packed along the group's tokens, the layout the scores' MatMul reads), so the first ``Q`` positions are one
contiguous block the runtime binds without a copy. Codes are asymmetric: ``x ≈ code * scale + min``, scale and
min in float16. A width is stored as bit planes of 4, 2 or 1 bits (3 bits = a 2-bit plane of the low bits and a
1-bit plane of the high bit), each packing ``8 / width`` codes a byte, the earliest (channel, or token of a key group) in the lowest bits.

Graph inputs of layer N (``names(N)``) and their shapes::

    past_key_values.N.key            float16 [Fk, batch, kv_heads, D]   sink, then the window
    past_key_values.N.value          float16 [Fv, batch, kv_heads, D]   sink
    past_key_values.N.key.codes{w}   uint8   [Qk / G, batch, kv_heads, D, G * w / 8]   per plane width w
    past_key_values.N.key.scale/.min float16 [Qk / G, batch, kv_heads, D]
    past_key_values.N.value.codes{w} uint8   [Qv, batch, kv_heads, D * w / 8]
    past_key_values.N.value.scale/.min float16 [Qv, batch]
    ->  present.N.key / .value       float   [batch, kv_heads, n, D]   the new positions (keys rotated)

plus ``position_ids`` [batch, n]; ``attention_mask`` [batch, L + n] in position order (rows left-padded).
The metadata says ``graphopt.kv_cache = kivi`` and ``graphopt.kivi = {"sink", "group", "key_bits",
"value_bits"}``.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.quant_cache import SessionView

KIVI_KEY = "graphopt.kivi"
FORM = "kivi"
PLANES = {4: (4,), 3: (2, 1), 2: (2,)}


@dataclasses.dataclass(frozen=True)
class KiviFormat:
    sink: int = 4
    group: int = 128
    key_bits: int = 4
    value_bits: int = 3

    def __post_init__(self):
        if self.key_bits not in PLANES or self.value_bits not in PLANES:
            raise UsageError(f"KIVI cache widths must be 2, 3 or 4 bits (got keys {self.key_bits}, "
                             f"values {self.value_bits})")
        if self.sink < 0 or self.group < 1:
            raise UsageError(f"a KIVI cache needs sink >= 0 and group >= 1 (got {self.sink}, {self.group})")

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> KiviFormat:
        try:
            return cls(**{k: int(v) for k, v in json.loads(text).items()})
        except (ValueError, TypeError) as e:
            raise ValueError(f"metadata {KIVI_KEY}={text!r} is not a KIVI cache format: {e}") from None

    def bytes_per_token(self, length: int, layers: int, kv_heads: int, head_dim: int) -> float:
        """Bytes the cache holds per position at ``length`` positions, per row (codes, scales, float16 parts)."""
        s = min(length, self.sink)
        qk = (length - s) // self.group * self.group
        qv = length - s
        elems = kv_heads * head_dim
        key = s * elems * 2 + (length - s - qk) * elems * 2 + qk * elems * self.key_bits / 8 \
            + qk // self.group * elems * 4
        value = s * elems * 2 + qv * (elems * self.value_bits / 8 + 4)
        return layers * (key + value) / max(length, 1)


def names(layer: int, fmt: KiviFormat) -> dict[str, str]:
    """Input names of ``layer``'s cache by role."""
    k, v = f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"
    out = {"key": k, "value": v, "key.scale": f"{k}.scale", "key.min": f"{k}.min",
           "value.scale": f"{v}.scale", "value.min": f"{v}.min"}
    out.update({f"key.codes{w}": f"{k}.codes{w}" for w in PLANES[fmt.key_bits]})
    out.update({f"value.codes{w}": f"{v}.codes{w}" for w in PLANES[fmt.value_bits]})
    return out


def pack(codes: np.ndarray, bits: int) -> list[np.ndarray]:
    """uint8 codes [..., D] (< 2**bits) as the bit planes of ``bits`` ([..., D * w / 8] per plane width w)."""
    out, shift = [], 0
    for w in PLANES[bits]:
        part = (codes >> shift) & ((1 << w) - 1)
        per = 8 // w
        grouped = part.reshape(*part.shape[:-1], part.shape[-1] // per, per).astype(np.uint8)
        byte = np.zeros(grouped.shape[:-1], np.uint8)
        for i in range(per):
            byte |= grouped[..., i] << (w * i)
        out.append(byte)
        shift += w
    return out


def unpack(planes: list[np.ndarray], bits: int) -> np.ndarray:
    """The uint8 codes [..., D] of ``pack``'s planes."""
    codes, shift = None, 0
    for w, byte in zip(PLANES[bits], planes, strict=True):
        per = 8 // w
        parts = np.stack([(byte >> (w * i)) & ((1 << w) - 1) for i in range(per)], axis=-1)
        parts = parts.reshape(*byte.shape[:-1], byte.shape[-1] * per).astype(np.uint8)
        codes = parts << shift if codes is None else codes | (parts << shift)
        shift += w
    return codes


def quantize(x: np.ndarray, axis, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric codes of ``x`` with one scale and min over ``axis`` (float16, as stored): (codes, scale, min)."""
    lo = x.min(axis=axis, keepdims=True).astype(np.float16)
    hi = x.max(axis=axis, keepdims=True)
    scale = ((hi - lo.astype(np.float32)) / ((1 << bits) - 1)).astype(np.float16)
    scale = np.where(scale > 0, scale, np.float16(1.0))
    codes = np.rint((x - lo.astype(np.float32)) / scale.astype(np.float32))
    return np.clip(codes, 0, (1 << bits) - 1).astype(np.uint8), scale, lo


class KiviCache:
    """The KV cache of a KIVI-form graph for ``batch`` left-padded rows, up to ``max_length`` positions:
    what ``Decoder.step`` binds (``bind``) and fills from the graph's new keys and values (``advance``)."""

    def __init__(self, sig, batch: int, max_length: int):
        if batch < 1 or max_length < 1:
            raise UsageError(f"a KV cache needs batch >= 1 and max_length >= 1 (got {batch}, {max_length})")
        if sig.max_positions is not None and max_length > sig.max_positions:
            raise UsageError(f"the graph takes at most {sig.max_positions} positions; a KV cache of {max_length} "
                             "was asked for")
        self.sig, self.fmt, self.batch, self.max_length = sig, sig.kivi, batch, max_length
        f, h, d = self.fmt, sig.kv_heads, sig.head_dim
        groups = max_length // f.group + 1
        self.layers = []
        for _ in range(sig.layers):
            lay = {"key": np.zeros((f.sink + f.group, batch, h, d), np.float16),
                   "value": np.zeros((f.sink, batch, h, d), np.float16),
                   "key.scale": np.zeros((groups, batch, h, d), np.float16),
                   "key.min": np.zeros((groups, batch, h, d), np.float16),
                   "value.scale": np.zeros((max_length, batch), np.float16),
                   "value.min": np.zeros((max_length, batch), np.float16)}
            for w in PLANES[f.key_bits]:
                lay[f"key.codes{w}"] = np.zeros((groups, batch, h, d, f.group * w // 8), np.uint8)
            for w in PLANES[f.value_bits]:
                lay[f"value.codes{w}"] = np.zeros((max_length, batch, h, d * w // 8), np.uint8)
            self.layers.append(lay)
        self._names = [names(i, f) for i in range(sig.layers)]
        self._new: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.key_groups = 0  # quantized key groups (positions sink .. sink + key_groups * group - 1)

    @property
    def free(self) -> int:
        return self.max_length - self.length

    def _counts(self) -> tuple[int, int, int, int]:
        """(float16 key positions, float16 value positions, key groups, quantized value positions)."""
        s = min(self.length, self.fmt.sink)
        window = self.length - s - self.key_groups * self.fmt.group
        return s + window, s, self.key_groups, self.length - s

    def feeds(self) -> dict[str, np.ndarray]:
        """The cache inputs of every layer by name (views of the buffers' used leading positions)."""
        fk, fv, gk, qv = self._counts()
        counts = {"key": fk, "value": fv, "key.scale": gk, "key.min": gk, "value.scale": qv, "value.min": qv}
        return {nm[role]: arr[:counts.get(role, gk if role.startswith("key.codes") else qv)]
                for lay, nm in zip(self.layers, self._names, strict=True) for role, arr in lay.items()}

    def bind(self, binding, new_tokens: int) -> None:
        import onnxruntime as ort

        if new_tokens > self.free:
            raise UsageError(f"the KV cache holds {self.max_length} positions: {self.length} used, "
                             f"{new_tokens} more do not fit")
        if new_tokens not in self._new:
            s = self.sig
            self._new = {new_tokens: [(np.zeros((self.batch, s.kv_heads, new_tokens, s.head_dim), np.float32),
                                       np.zeros((self.batch, s.kv_heads, new_tokens, s.head_dim), np.float32))
                                      for _ in range(s.layers)]}
        for name, arr in self.feeds().items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        for (present_k, present_v), (pk, pv) in zip(self._new[new_tokens], self.sig.present_names, strict=True):
            binding.bind_ortvalue_output(pk, ort.OrtValue.ortvalue_from_numpy(present_k))
            binding.bind_ortvalue_output(pv, ort.OrtValue.ortvalue_from_numpy(present_v))

    def advance(self, new_tokens: int) -> None:
        """Take the graph's new keys and values (the outputs ``bind`` gave it) into the cache."""
        f = self.fmt
        start, self.length = self.length, self.length + new_tokens
        for lay, (k_new, v_new) in zip(self.layers, self._new[new_tokens], strict=True):
            k = k_new.transpose(2, 0, 1, 3)  # [n, batch, heads, D]
            v = v_new.transpose(2, 0, 1, 3)
            self._append(lay, k, v, start)
        done = (self.length - min(self.length, f.sink)) // f.group
        self.key_groups = done

    def _append(self, lay: dict, k: np.ndarray, v: np.ndarray, start: int) -> None:
        f = self.fmt
        n = k.shape[0]
        in_sink = max(0, min(n, f.sink - start))
        if in_sink:
            lay["key"][start:start + in_sink] = k[:in_sink]
            lay["value"][start:start + in_sink] = v[:in_sink]
        if in_sink == n:
            return
        # values: every position past the sink is quantized at once, per token over every head's channels
        vq = v[in_sink:]
        codes, scale, lo = quantize(vq, (2, 3), f.value_bits)
        a = start + in_sink - f.sink
        for w, plane in zip(PLANES[f.value_bits], pack(codes, f.value_bits), strict=True):
            lay[f"value.codes{w}"][a:a + vq.shape[0]] = plane
        lay["value.scale"][a:a + vq.shape[0]] = scale[:, :, 0, 0]
        lay["value.min"][a:a + vq.shape[0]] = lo[:, :, 0, 0]
        # keys: into the float16 window; each full group of the window is quantized per channel
        s = f.sink
        window = start + in_sink - s - self.key_groups * f.group
        pending = np.concatenate([lay["key"][s:s + window].astype(np.float32), k[in_sink:]], axis=0)
        g = self.key_groups
        full = pending.shape[0] // f.group
        if full:
            blocks = pending[:full * f.group].reshape(full, f.group, *pending.shape[1:])
            codes, scale, lo = quantize(blocks, 1, f.key_bits)
            codes = codes.transpose(0, 2, 3, 4, 1)  # [groups, batch, heads, D, G]: packed along the tokens
            for w, plane in zip(PLANES[f.key_bits], pack(codes, f.key_bits), strict=True):
                lay[f"key.codes{w}"][g:g + full] = plane
            lay["key.scale"][g:g + full] = scale[:, 0]
            lay["key.min"][g:g + full] = lo[:, 0]
        rest = pending[full * f.group:]
        if s + rest.shape[0] > lay["key"].shape[0]:
            grown = np.zeros((s + rest.shape[0], *lay["key"].shape[1:]), np.float16)
            grown[:s] = lay["key"][:s]
            lay["key"] = grown
        lay["key"][s:s + rest.shape[0]] = rest

    def held_bytes(self) -> int:
        """Bytes of the cache's used positions (codes, scales and float16 parts)."""
        return sum(a.nbytes for a in self.feeds().values())

    def fill_random(self, length: int, rng: np.random.Generator) -> None:
        """Hold ``length`` positions of random codes and small float16 values (benchmarks of the decode phase
        at a context, without a prefill)."""
        self.reset()
        self.length = length
        self.key_groups = (length - min(length, self.fmt.sink)) // self.fmt.group
        for name, arr in self.feeds().items():
            if arr.dtype == np.uint8:
                arr[...] = rng.integers(0, 256, arr.shape, np.uint8)
            else:
                arr[...] = (rng.standard_normal(arr.shape) * (0.05 if name.endswith(".scale") else 1)).astype(arr.dtype)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions (only while no key group past them was quantized)."""
        if not 0 <= length <= self.length:
            raise UsageError(f"cannot roll the KV cache back to {length} positions: it holds {self.length}")
        if length < min(self.length, self.fmt.sink) + self.key_groups * self.fmt.group:
            raise UsageError(f"cannot roll a KIVI cache back to {length} positions: its keys up to "
                             f"{self.fmt.sink + self.key_groups * self.fmt.group} are quantized in groups")
        self.length = length

    def dequantized(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values of ``layer`` as the graph reads them, float32 [batch, kv_heads, length, D]."""
        f, lay = self.fmt, self.layers[layer]
        fk, fv, gk, qv = self._counts()
        s = fv
        kq = unpack([lay[f"key.codes{w}"][:gk] for w in PLANES[f.key_bits]], f.key_bits).astype(np.float32)
        kq = kq.transpose(0, 4, 1, 2, 3)  # [groups, G, batch, heads, D]
        kq = kq * lay["key.scale"][:gk, None].astype(np.float32) + lay["key.min"][:gk, None].astype(np.float32)
        kq = kq.reshape(-1, *kq.shape[2:])
        keys = np.concatenate([lay["key"][:s].astype(np.float32), kq, lay["key"][s:fk].astype(np.float32)])
        vq = unpack([lay[f"value.codes{w}"][:qv] for w in PLANES[f.value_bits]], f.value_bits).astype(np.float32)
        vq = vq * lay["value.scale"][:qv, :, None, None].astype(np.float32) \
            + lay["value.min"][:qv, :, None, None].astype(np.float32)
        values = np.concatenate([lay["value"][:s].astype(np.float32), vq])
        return keys.transpose(1, 2, 0, 3), values.transpose(1, 2, 0, 3)

    def load(self, past: dict[str, np.ndarray]) -> None:
        """Fill the cache from float past tensors ``[batch, kv_heads, L, D]`` by input name (as if the graph
        had written them)."""
        first = self.sig.past_names[0][0]
        n = past[first].shape[2]
        self.reset()
        for lay, (pk, pv) in zip(self.layers, self.sig.past_names, strict=True):
            self._append(lay, past[pk].transpose(2, 0, 1, 3).astype(np.float32),
                         past[pv].transpose(2, 0, 1, 3).astype(np.float32), 0)
        self.length = n
        self.key_groups = (n - min(n, self.fmt.sink)) // self.fmt.group


class KiviIO(SessionView):
    """A session of a KIVI-form graph seen with the float contract it replaced: past ``[batch, kv_heads, P, D]``
    float feeds are quantized as the runtime would hold them, and each present comes back as the dequantized
    past followed by the new positions (for verification feeds and references made for the float graph)."""

    def __init__(self, session, sig):
        super().__init__(session)
        self.sig = sig

    def prepare(self, feed) -> tuple[dict[str, np.ndarray], KiviCache]:
        """The graph's own feed for a float-contract ``feed``, and the cache it was quantized into."""
        ids, mask = np.asarray(feed["input_ids"]), np.asarray(feed["attention_mask"], np.int64)
        n = ids.shape[1]
        past = {p: np.asarray(feed[p], np.float32) for pair in self.sig.past_names for p in pair}
        length = past[self.sig.past_names[0][0]].shape[2]
        cache = KiviCache(dataclasses.replace(self.sig, max_positions=None), ids.shape[0], max(length + n, 1))
        cache.load(past)
        fed = {k: v for k, v in feed.items() if k in ("input_ids", "attention_mask", "logits_to_keep")}
        fed["position_ids"] = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -n:].astype(np.int64)
        fed.update(cache.feeds())
        return fed, cache

    def run(self, names, feed, *args):
        fed, cache = self.prepare(feed)
        names = names or [o.name for o in self._s.get_outputs()]
        outs = self._s.run(names, fed, *args)
        presents = {q: (i, j) for i, pair in enumerate(self.sig.present_names) for j, q in enumerate(pair)}
        got = []
        for name, out in zip(names, outs, strict=True):
            if name in presents:
                layer, which = presents[name]
                out = np.concatenate([cache.dequantized(layer)[which], out], axis=2)
            got.append(out)
        return got

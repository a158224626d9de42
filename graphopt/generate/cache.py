"""The KV cache the runtime owns: preallocated buffers for a maximum length, bound with ORT IO binding.

The graph reads ``past`` as a contiguous ``[batch, kv_heads, past, head_dim]`` tensor and writes ``present`` as a
contiguous ``[batch, kv_heads, past + new, head_dim]`` tensor, past and new together. A contiguous tensor of
length L is a different layout from one of length L + 1, so one buffer cannot grow in place; each cache tensor
has two flat buffers of ``batch * kv_heads * max_length * head_dim`` elements, allocated once::

    step t:   past  = buffer A viewed as [b, h, L, d]   ──graph──▶  present = buffer B viewed as [b, h, L+n, d]
    step t+1: past  = buffer B viewed as [b, h, L+n, d] ──graph──▶  present = buffer A viewed as [b, h, L+n+m, d]

ORT writes each present straight into the other buffer (``bind_ortvalue_output`` on an OrtValue over a numpy
view: no allocation and no copy per step); appending a step is swapping the roles of the two buffers.
``rollback(length)`` (speculative decoding rejects drafted tokens) keeps the first ``length`` positions: one
strided copy into the other buffer, as the shorter tensor's layout differs.

A graph with ``GroupQueryAttention`` (``sig.shared_buffer``) reads and writes one buffer per cache tensor,
``[batch, kv_heads, max_length, head_dim]``, bound as both past and present (ONNX Runtime GenAI's
``past_present_share_buffer``): the kernel sees the same memory and writes only the new positions of each row,
at that row's length (``sum(mask) - 1``). Nothing is copied per step, and ``rollback`` only moves the length
(positions past it are overwritten before any row reads them). ``length`` is then the mask's width: a
right-padded row holds fewer real positions than that.

``rows(first, count)`` views the shared buffers' rows ``first .. first + count - 1`` (leading rows of a
contiguous array are themselves contiguous) as a cache of ``count`` rows over the same memory: the continuous
batching scheduler keeps one request per row and binds the running ones, or a newcomer's, without a copy.
"""

from __future__ import annotations

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.kivi import KiviCache
from graphopt.generate.signature import DecoderSignature


def new_cache(sig: DecoderSignature, batch: int, max_length: int):
    """The cache a graph of signature ``sig`` takes: a ``KVCache``, or a ``kivi.KiviCache`` for a KIVI-form
    graph (pass ``kivi-kv-cache``)."""
    if sig.kivi is not None:
        return KiviCache(sig, batch, max_length)
    return KVCache(sig, batch, max_length)


class KVCache:
    """Past keys and values of ``batch`` rows, up to ``max_length`` positions."""

    def __init__(self, sig: DecoderSignature, batch: int, max_length: int):
        if batch < 1 or max_length < 1:
            raise UsageError(f"a KV cache needs batch >= 1 and max_length >= 1 (got {batch}, {max_length})")
        self.sig, self.batch, self.max_length = sig, batch, max_length
        if sig.shared_buffer and sig.max_positions is not None and max_length > sig.max_positions:
            raise UsageError(f"the graph takes at most {sig.max_positions} positions; a KV cache of {max_length} "
                             "was asked for", hint="generate fewer tokens, or rebuild it with "
                             "--set group-query-attention.max_positions=N")
        self.length = 0
        size = batch * sig.kv_heads * max_length * sig.head_dim
        if sig.shared_buffer:
            shape = (batch, sig.kv_heads, max_length, sig.head_dim)
            self._shared = [np.zeros(shape, sig.dtype) for _ in sig.cache_names]
            self._row_values: dict[tuple[int, int], list] = {}  # OrtValues over row ranges, made once each
            self._buffers = []
        else:
            self._shared = []
            self._buffers = [(np.zeros(size, sig.dtype), np.zeros(size, sig.dtype)) for _ in sig.cache_names]
        self._current = 0  # which buffer of each pair holds the past

    @property
    def free(self) -> int:
        """Positions left before the cache is full."""
        return self.max_length - self.length

    def _view(self, i: int, which: int, length: int) -> np.ndarray:
        s = self.sig
        n = self.batch * s.kv_heads * length * s.head_dim
        return self._buffers[i][which][:n].reshape(self.batch, s.kv_heads, length, s.head_dim)

    def past(self) -> dict[str, np.ndarray]:
        """The current past tensors by input name (views into the cache: copy to keep them)."""
        if self._shared:
            return {p: self._shared[i][:, :, :self.length] for i, (p, _) in enumerate(self.sig.cache_names)}
        return {p: self._view(i, self._current, self.length) for i, (p, _) in enumerate(self.sig.cache_names)}

    def bind(self, binding, new_tokens: int) -> None:
        """Bind every past input to the current buffers and every present output to the others, sized for
        ``new_tokens`` more positions; call ``advance(new_tokens)`` after the run."""
        import onnxruntime as ort

        if new_tokens > self.free:
            raise UsageError(f"the KV cache holds {self.max_length} positions: {self.length} used, "
                             f"{new_tokens} more do not fit")
        if self._shared:
            self.rows(0, self.batch).bind(binding, new_tokens)
            return
        nxt = 1 - self._current
        for i, (past, present) in enumerate(self.sig.cache_names):
            binding.bind_ortvalue_input(past, ort.OrtValue.ortvalue_from_numpy(self._view(i, self._current, self.length)))
            binding.bind_ortvalue_output(
                present, ort.OrtValue.ortvalue_from_numpy(self._view(i, nxt, self.length + new_tokens)))

    def rows(self, first: int, count: int) -> CacheRows:
        """Rows ``first .. first + count - 1`` of a shared-buffer cache, bound as a cache of ``count`` rows."""
        import onnxruntime as ort

        if not self._shared:
            raise UsageError("a row view needs a shared-buffer cache (GroupQueryAttention graphs)")
        if count < 1 or first < 0 or first + count > self.batch:
            raise UsageError(f"rows {first}..{first + count - 1} are outside the cache's {self.batch} rows")
        key = (first, count)
        if key not in self._row_values:
            self._row_values[key] = [ort.OrtValue.ortvalue_from_numpy(b[first:first + count]) for b in self._shared]
        return CacheRows(self.sig, self._row_values[key])

    def copy_row(self, src: KVCache, src_row: int, row: int, length: int) -> None:
        """Positions ``0 .. length - 1`` of ``src``'s row ``src_row`` into this cache's row ``row`` (shared
        buffers of the same graph)."""
        if not (self._shared and src._shared):
            raise UsageError("copying a row needs shared-buffer caches (GroupQueryAttention graphs)")
        for dst, b in zip(self._shared, src._shared):
            dst[row, :, :length] = b[src_row, :, :length]

    def advance(self, new_tokens: int) -> None:
        """The presents of the last run (``new_tokens`` more positions) become the past."""
        self.length += new_tokens
        if not self._shared:
            self._current = 1 - self._current

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions of every row (drop the rest)."""
        if not 0 <= length <= self.length:
            raise UsageError(f"cannot roll the KV cache back to {length} positions: it holds {self.length}")
        if length == self.length or self._shared:
            self.length = length
            return
        nxt = 1 - self._current
        for i in range(len(self._buffers)):
            self._view(i, nxt, length)[...] = self._view(i, self._current, self.length)[:, :, :length, :]
        self.length = length
        self._current = nxt

    def reset(self) -> None:
        """Empty the cache (the buffers stay allocated)."""
        self.length = 0


class SharedLayers:
    """The first layers of a shared-buffer ``KVCache``, as the cache of a draft graph made of those layers
    (``layer_skip``): it binds the target's own buffers, so the draft reads the K/V the target wrote and writes
    its drafted positions where the target's verifying forward overwrites them. ``sync`` sets its length to the
    target's before each draft."""

    def __init__(self, target: KVCache, sig: DecoderSignature):
        if not self.fits(target, sig):
            raise UsageError("a draft shares the KV cache only of a shared-buffer graph whose first layers it is")
        self.target, self.sig, self.max_length = target, sig, target.max_length
        self.length = target.length

    @staticmethod
    def fits(target: KVCache, sig: DecoderSignature) -> bool:
        """Whether a graph of ``sig`` can run on ``target``'s buffers: both share past and present in buffers of
        the same heads, width, dtype and quantization (bits), its cache names are the target's first ones, and it takes
        as many positions as the buffers hold (a draft model of the same architecture: the target's own layers
        in another form, e.g. its int4 build)."""
        t = target.sig
        names = t.cache_names
        same_form = (sig.kv_heads, sig.head_dim, np.dtype(sig.dtype), sig.kv_bits) == (
            t.kv_heads, t.head_dim, np.dtype(t.dtype), t.kv_bits)
        return (bool(target._shared) and sig.shared_buffer and sig.kivi is None and same_form
                and sig.cache_names == names[:len(sig.cache_names)]
                and (sig.max_positions is None or sig.max_positions >= target.max_length))

    @property
    def free(self) -> int:
        return self.max_length - self.length

    def sync(self) -> int:
        self.length = self.target.length
        return self.length

    def bind(self, binding, new_tokens: int) -> None:
        if new_tokens > self.free:
            raise UsageError(f"the KV cache holds {self.max_length} positions: {self.length} used, "
                             f"{new_tokens} more do not fit")
        t = self.target
        for value, (past, present) in zip(t.rows(0, t.batch).values, self.sig.cache_names):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    def rollback(self, length: int) -> None:
        self.length = length

    def reset(self) -> None:
        self.length = 0


class CacheRows:
    """Rows of a shared-buffer ``KVCache`` as ``Decoder.step`` binds them: one OrtValue per cache tensor, past
    and present (GroupQueryAttention writes each row's new positions at its own length, from the mask)."""

    def __init__(self, sig: DecoderSignature, values: list):
        self.sig, self.values = sig, values

    def bind(self, binding, new_tokens: int) -> None:
        for value, (past, present) in zip(self.values, self.sig.cache_names):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)

    def advance(self, new_tokens: int) -> None:
        """Nothing to move: each row's length is its mask's (the scheduler keeps them)."""

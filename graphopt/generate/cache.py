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
"""

from __future__ import annotations

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.signature import DecoderSignature


class KVCache:
    """Past keys and values of ``batch`` rows, up to ``max_length`` positions."""

    def __init__(self, sig: DecoderSignature, batch: int, max_length: int):
        if batch < 1 or max_length < 1:
            raise UsageError(f"a KV cache needs batch >= 1 and max_length >= 1 (got {batch}, {max_length})")
        self.sig, self.batch, self.max_length = sig, batch, max_length
        self.length = 0
        size = batch * sig.kv_heads * max_length * sig.head_dim
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
        return {p: self._view(i, self._current, self.length) for i, (p, _) in enumerate(self.sig.cache_names)}

    def bind(self, binding, new_tokens: int) -> None:
        """Bind every past input to the current buffers and every present output to the others, sized for
        ``new_tokens`` more positions; call ``advance(new_tokens)`` after the run."""
        import onnxruntime as ort

        if new_tokens > self.free:
            raise UsageError(f"the KV cache holds {self.max_length} positions: {self.length} used, "
                             f"{new_tokens} more do not fit")
        nxt = 1 - self._current
        for i, (past, present) in enumerate(self.sig.cache_names):
            binding.bind_ortvalue_input(past, ort.OrtValue.ortvalue_from_numpy(self._view(i, self._current, self.length)))
            binding.bind_ortvalue_output(
                present, ort.OrtValue.ortvalue_from_numpy(self._view(i, nxt, self.length + new_tokens)))

    def advance(self, new_tokens: int) -> None:
        """The presents of the last run (``new_tokens`` more positions) become the past."""
        self.length += new_tokens
        self._current = 1 - self._current

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions of every row (drop the rest)."""
        if not 0 <= length <= self.length:
            raise UsageError(f"cannot roll the KV cache back to {length} positions: it holds {self.length}")
        if length == self.length:
            return
        nxt = 1 - self._current
        for i in range(len(self._buffers)):
            self._view(i, nxt, length)[...] = self._view(i, self._current, self.length)[:, :, :length, :]
        self.length = length
        self._current = nxt

    def reset(self) -> None:
        """Empty the cache (the buffers stay allocated)."""
        self.length = 0

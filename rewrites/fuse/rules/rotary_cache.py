"""Rotary embedding with positions ``start + 0..S-1`` to ONNX Runtime's contrib ``RotaryEmbedding``.

onnxscript's rotary rule leaves a placeholder ``RotaryEmbedding(x, cos, sin)`` (domain
``ai.onnxruntime._fusion``, run as an inlined function) whose cos/sin its cache rule only recognises
when computed by ``MatMul(inv_freq, positions)``. Transformers 5 exports of Llama-style models with a
KV cache compute them elementwise from the cache position::

    p = Range(0, S, 1) + past_len                     (int, [S])
    f = Cast(Unsqueeze(p, [0, 2]), float) * inv_freq  ([1, S, 1] * [E] -> [1, S, E])
    cos = Unsqueeze(Cos(Concat(f, f, -1)), [1])       sin likewise
    y = RotaryEmbedding[placeholder](x [B, N, S, 2E], cos, sin, interleaved=0)

Rewritten to ``RotaryEmbedding(x, [past_len], cos_cache, sin_cache, interleaved=0, num_heads=N)``
(com.microsoft, positions given by their start; ``num_heads`` when ``N`` is a known int) with caches
computed at run time for positions ``0..past_len+S-1``::

    cos_cache = Cos(Cast(Range(0, past_len + S, 1), float)[:, None] * inv_freq)   ([P, E])

Each cache entry is ``cos(float(p) * inv_freq[e])``, the same float operations as the export, so
the result is identical; there is no fixed maximum position. One cache is shared by all layers.

Refuses (graph unchanged) when: the placeholder is interleaved; ``x`` is not 4-D ``[B, N, S, 2E]``;
``inv_freq`` is not a constant 1-D ``[E]``; the positions are not ``Range(0, n, 1) + k`` (or
``Range(0, n, 1)``) with scalar ``k`` of an integer type; the Unsqueeze axes are not ``[0, 2]`` or
the cos/sin Unsqueeze axis is not 1; the Concat is not ``(f, f)`` on the last axis.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphopt.onnxscript_compat import get_numpy_value, get_singleton_value
from graphopt.opsets import FUSION_PLACEHOLDER_DOMAIN, MS_DOMAIN


def _positions(p: ir.Value) -> tuple[ir.Value, ir.Value | None] | str:
    """(n, k) when ``p = Range(0, n, 1) [+ k]``, else a reason."""
    node = p.producer()
    k = None
    if node is not None and node.op_type == "Add" and node.domain == "":
        a, b = node.inputs
        if a.producer() is not None and a.producer().op_type == "Range":
            node, k = a.producer(), b
        elif b.producer() is not None and b.producer().op_type == "Range":
            node, k = b.producer(), a
        else:
            return "positions are an Add without a Range"
        if k.shape is None or k.shape.rank() != 0:
            return "position offset is not a scalar"
    if node is None or node.op_type != "Range" or node.domain != "":
        return "positions are not a Range"
    start, limit, delta = node.inputs
    if get_singleton_value(start) != 0 or get_singleton_value(delta) != 1:
        return "positions Range does not start at 0 with step 1"
    if p.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return f"positions are {p.dtype}, not int32/int64"
    return limit, k


class RotaryFromPositions(pattern.RewriteRuleClassBase):
    """Placeholder RotaryEmbedding with elementwise cos/sin of ``start + 0..S-1`` -> contrib op."""

    def __init__(self, name: str):
        # cos/sin are shared by every layer's rotary: leave them; unused nodes are removed afterwards
        super().__init__(name, remove_nodes=False)
        self._caches: dict[tuple[int, int], tuple[ir.Value, ir.Value, ir.Value]] = {}

    def pattern(self, op, x, p, axes, inv_freq, ax_c, ax_s):
        f = op.Mul(op.Cast(op.Unsqueeze(p, axes), _allow_other_attributes=True), inv_freq)
        emb = op.Concat(f, f, _allow_other_attributes=True, _outputs=["emb"])
        cos = op.Unsqueeze(op.Cos(emb), ax_c)
        sin = op.Unsqueeze(op.Sin(emb), ax_s)
        return op.RotaryEmbedding(x, cos, sin, _allow_other_attributes=True, _domain=FUSION_PLACEHOLDER_DOMAIN, _outputs=["y"])

    def check(self, context, x, p, axes, inv_freq, ax_c, ax_s, emb, y, **_):
        result = pattern.MatchResult()
        node = y.producer()
        if node.attributes.get_int("interleaved", 0) != 0:
            return result.fail("interleaved rotary", y)
        c = inv_freq.const_value
        if c is None or len(c.shape) != 1:
            return result.fail("inv_freq is not a constant 1-D tensor", inv_freq)
        e = c.shape[0]
        if x.shape is None or x.shape.rank() != 4 or x.shape[3] != 2 * e:
            return result.fail(f"input is not [B, N, S, {2 * e}]", x)
        if emb.producer().attributes.get_int("axis", 0) not in (-1, 2):
            return result.fail("Concat is not on the last axis", emb)
        a = get_numpy_value(axes)
        if a is None or a.reshape(-1).tolist() != [0, 2] or p.shape is None or p.shape.rank() != 1:
            return result.fail("positions are not a 1-D [S] tensor unsqueezed to [1, S, 1]", p)
        for v in (ax_c, ax_s):
            av = get_numpy_value(v)
            if av is None or av.reshape(-1).tolist() != [1]:
                return result.fail("cos/sin are not unsqueezed on axis 1", v)
        if x.dtype != ir.DataType.FLOAT or c.dtype != ir.DataType.FLOAT:
            return result.fail("rotary is not float32", x)
        pos = _positions(p)
        if isinstance(pos, str):
            return result.fail(pos, p)
        return result

    def rewrite(self, op, x, p, inv_freq, y, **_):
        limit, k = _positions(p)
        key = (id(p), id(inv_freq))
        if key not in self._caches:
            i64 = ir.DataType.INT64
            start = op.Constant(value=ir.tensor(0, dtype=i64)) if k is None else op.Cast(k, to=i64)
            total = op.Add(start, op.Cast(limit, to=i64))
            rng = op.Range(op.Constant(value=ir.tensor(0, dtype=i64)), total, op.Constant(value=ir.tensor(1, dtype=i64)))
            angles = op.Mul(op.Unsqueeze(op.Cast(rng, to=ir.DataType.FLOAT), op.Constant(value_ints=[1])), inv_freq)
            start_1 = op.Reshape(start, op.Constant(value_ints=[1]))
            self._caches[key] = (start_1, op.Cos(angles), op.Sin(angles))
        start_1, cos_cache, sin_cache = self._caches[key]
        # num_heads kept (ORT requires it once a partial-rotary fusion adds rotary_embedding_dim)
        heads = {"num_heads": x.shape[1]} if isinstance(x.shape[1], int) else {}
        return op.RotaryEmbedding(x, start_1, cos_cache, sin_cache, interleaved=0, **heads, _domain=MS_DOMAIN)

    def cleanup(self):
        self._caches.clear()


rotary_cache_rules = pattern.RewriteRuleSet([RotaryFromPositions.rule("rotary_from_positions")])

"""Partial rotary (Phi, GPT-NeoX, StableLM): rotate the first ``d`` of each head's ``H`` dims, pass the rest.

The export writes the split around the rotary the other fusions already made::

    x [B, N, S, H] ─┬─ Slice(0:d, axis 3) ── RotaryEmbedding(…, cache [P, d/2]) ─┐
                    └─ Slice(d:end, axis 3) ───────────────────────────────────── Concat(axis -1) ──▶ y

Rewritten to one ``RotaryEmbedding(x, …, rotary_embedding_dim=d, num_heads=N)`` (com.microsoft).
onnxscript's rule (``ort_fusions.rotary_embedding.partial_embedding_rules``) writes the same node
without ``num_heads``, which ORT's kernel requires whenever ``rotary_embedding_dim`` is set
("num_heads must be provided if rotary_embedding_dim is specified"): the model does not load. This
rule is that rule with ``num_heads`` taken from ``x``'s head axis.

Refuses (graph unchanged) when, besides the upstream reasons (slices not meeting at ``d``, rotary
already partial or interleaved): ``x`` is not 4-D with a known head count ``N`` and head size ``H``;
``d`` is not even or not below ``H``; the rotary node carries a ``num_heads`` other than ``N``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import rotary_embedding

from graphopt.onnxscript_compat import get_singleton_value


class PartialRotaryWithHeads(rotary_embedding.PartialRotaryEmbeddingFusion):
    """onnxscript's partial-rotary fusion, emitting the ``num_heads`` ORT needs with ``rotary_embedding_dim``."""

    def check(self, op, x, end1, start2, x_part_1_rope, **kw) -> pattern.MatchResult:
        result = super().check(op, x=x, end1=end1, start2=start2, x_part_1_rope=x_part_1_rope, **kw)
        if not result:
            return result
        if x.shape is None or x.shape.rank() != 4 or not isinstance(x.shape[1], int) or not isinstance(x.shape[3], int):
            return result.fail("input is not [B, N, S, H] with known N and H", x)
        d = get_singleton_value(end1)
        if d <= 0 or d % 2 or d >= x.shape[3]:
            return result.fail(f"rotary dim {d} is not even and below the head size {x.shape[3]}", end1)
        heads = x_part_1_rope.producer().attributes.get_int("num_heads", 0)
        if heads not in (0, x.shape[1]):
            return result.fail(f"rotary num_heads {heads} is not the input's {x.shape[1]}", x_part_1_rope)
        return result

    def rewrite(self, op, x, end1, x_part_1_rope, **kw):
        out = super().rewrite(op, x=x, end1=end1, x_part_1_rope=x_part_1_rope, **kw)
        out.producer().attributes["num_heads"] = ir.AttrInt64("num_heads", x.shape[1])
        return out


partial_rotary_rules = pattern.RewriteRuleSet([PartialRotaryWithHeads.rule("partial_rotary_embedding")])

"""GroupQueryAttention (option ``gqa``): onnxscript's rule, refused where its rewrite would not load or not be exact.

onnxscript's rule (``ort_fusions.gqa``) matches Llama-style attention with rotary on ``[B, H, S, Dh]``
query and ``[B, Hkv, S, Dh]`` key, past concatenation, head expansion and the causal + padding mask, and
writes ``GroupQueryAttention(…, seqlens_k, total_sequence_length, cos, sin, do_rotary=1)`` with
``seqlens_k = ReduceMax(position_ids, axis 1)``. Two graphs it matches it cannot rewrite correctly:

- positions given by their start (``RotaryEmbedding(x, [past_len], cache)``, what ``fuse_rotary_cache``
  writes): ``ReduceMax`` over axis 1 of a 1-D tensor is ill-formed, so the model fails the checker;
- a partial rotary (``rotary_embedding_dim`` set): the rule drops the attribute.

Refuses (graph unchanged, MultiHeadAttention tried next) when, besides the upstream reasons: the
position ids are not ``[B, S]``; the rotary has ``rotary_embedding_dim`` or is interleaved differently for
query and key.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import gqa


class CheckedGroupQueryAttention(gqa.GroupQueryAttention):
    """onnxscript's GQA rule with the refusals above."""

    def check(self, context, **kw) -> pattern.MatchResult:
        result = super().check(context, **kw)
        if not result:
            return result if isinstance(result, pattern.MatchResult) else pattern.MatchResult().fail("upstream check")
        result = pattern.MatchResult()
        pos = kw.get("position_ids")
        if pos is None or pos.shape is None or pos.shape.rank() != 2:
            return result.fail("position ids are not [B, S] (GroupQueryAttention derives row lengths from them)", pos)
        q, k = kw["query_BHSDh_rope"].producer(), kw["key_BHkvSDh_rope"].producer()
        for node in (q, k):
            if node.attributes.get_int("rotary_embedding_dim", 0):
                return result.fail("partial rotary (rotary_embedding_dim) is not carried by the rule", node.outputs[0])
        if q.attributes.get_int("interleaved", 0) != k.attributes.get_int("interleaved", 0):
            return result.fail("query and key rotaries differ in interleaving", q.outputs[0])
        return result


gqa_rules = pattern.RewriteRuleSet([CheckedGroupQueryAttention.rule()])

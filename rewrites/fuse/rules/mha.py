"""MultiHeadAttention fusion that keeps the export's final reshape when it is not ``[B, S, D]``.

onnxscript's MHA rule (``ort_fusions.mha``) matches::

    q,k,v ─Reshape─Transpose─[Concat(past)]─SDPA─Transpose(0,2,1,3)─Reshape(t) ──▶ y

and replaces ``y`` with the MultiHeadAttention output ``[B, S, D]`` without looking at ``t``
("TODO: verify Reshapes" upstream). GPT-2's Conv1D reshapes to ``[B*S, D]`` for a ``Gemm``, so the
fused graph fails at run time. Here the rule is the same, but when ``y``'s shape is not known to be
``[B, S, *]`` (rank 3, batch and sequence of the query) the rewrite ends with ``Reshape(mha, t)``:
the transposed SDPA output ``[B, S, H, Dh]`` and MultiHeadAttention's ``[B, S, H*Dh]`` hold the same
elements in the same order, so reshaping either to ``t`` is the same tensor.

The upstream rotary variant moves each ``RotaryEmbedding`` from the ``[B, N, S, Dh]`` form to the
``[B, S, D]`` input of MultiHeadAttention but writes the new node without the old one's attributes
(``interleaved``, ``rotary_embedding_dim``, ``scale``): for partial rotary (Phi, StableLM) ORT then
rotates whole heads of the size its cache implies, and the result is wrong. Here the attributes are
carried over, with ``num_heads`` (query heads, or key heads for the key), which ORT requires on a 3-D
input with ``rotary_embedding_dim``.

Refusals are those of the upstream rule (shapes of q/k/v/past, mask shapes), and, for the rotary
variant, query and key rotaries with different attributes, or a partial rotary whose head counts
are not known integers.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import mha


def _is_bsd(y: ir.Value, query: ir.Value) -> bool:
    if y.shape is None or query.shape is None or y.shape.rank() != 3 or query.shape.rank() != 3:
        return False
    for a, b in zip(list(y.shape)[:2], list(query.shape)[:2]):
        if isinstance(a, int) and isinstance(b, int):
            if a != b:
                return False
        elif not (isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim) and a.value and a.value == b.value):
            return False
    return True


_ROTARY_KEEP = ("interleaved", "rotary_embedding_dim", "scale", "is_packed_batching")


def _rotaries(sdpa_output: ir.Value, has_past: bool, cross: bool) -> tuple[ir.Node, ir.Node | None]:
    """The matched query and key ``RotaryEmbedding`` nodes feeding the SDPA placeholder."""
    sdpa = sdpa_output.producer()
    q = sdpa.inputs[0].producer()
    k = sdpa.inputs[1].producer()
    if has_past:
        k = k.inputs[1].producer()
    return q, (None if cross else k)


def _rotary_attrs(node: ir.Node) -> dict[str, ir.Attr]:
    return {k: v for k, v in node.attributes.items() if k in _ROTARY_KEEP}


class ReshapeKeepingMHA(mha.MultiHeadAttention):
    """The upstream MHA rule; keeps rotary attributes, re-applies the final reshape when not ``[B, S, D]``."""

    def check(self, context, **kw) -> pattern.MatchResult:
        result = super().check(context, **kw)
        if not result or not self._is_rotary:
            return result
        q, k = _rotaries(kw["sdpa_output"], self._has_past_present, self._is_cross_attention)
        qa = {n: a.value for n, a in _rotary_attrs(q).items()}
        if k is not None and qa != {n: a.value for n, a in _rotary_attrs(k).items()}:
            return result.fail("query and key rotaries have different attributes", kw["sdpa_output"])
        if qa.get("rotary_embedding_dim", 0):
            heads = [kw["query_BSHDh"]] + ([kw.get("key_BSHDh")] if k is not None else [])
            if any(v is None or v.shape is None or v.shape.rank() != 4 or not isinstance(v.shape[2], int) for v in heads):
                return result.fail("partial rotary: query or key head count unknown", kw["query_BSHDh"])
        return result

    def rewrite(self, op, query_BSD, attention_reshaped, **kwargs):
        out = super().rewrite(op, query_BSD=query_BSD, attention_reshaped=attention_reshaped, **kwargs)
        if out is not None and self._is_rotary:
            self._keep_rotary_attributes(out[0] if isinstance(out, tuple) else out, kwargs)
        if out is None or _is_bsd(attention_reshaped, query_BSD):
            return out
        target = attention_reshaped.producer().inputs[1]
        if isinstance(out, tuple):
            return (op.Reshape(out[0], target), *out[1:])
        return op.Reshape(out, target)

    def _keep_rotary_attributes(self, mha_out: ir.Value, bound: dict) -> None:
        """Copy the matched rotaries' attributes onto the ``[B, S, D]`` rotaries the rewrite made."""
        old_q, old_k = _rotaries(bound["sdpa_output"], self._has_past_present, self._is_cross_attention)
        new = mha_out.producer()
        pairs = [(old_q, new.inputs[0].producer(), bound["query_BSHDh"])]
        if old_k is not None:
            pairs.append((old_k, new.inputs[1].producer(), bound.get("key_BSHDh")))
        for old, node, heads in pairs:
            if node is None or node.op_type != "RotaryEmbedding":
                continue
            for name, attr in _rotary_attrs(old).items():
                node.attributes[name] = attr
            if heads is not None and heads.shape is not None and isinstance(heads.shape[2], int):
                node.attributes["num_heads"] = ir.AttrInt64("num_heads", heads.shape[2])


def _rules(has_past_present: bool) -> pattern.RewriteRuleSet:
    rules = []
    for is_rotary in (False, True):
        for is_cross in ([False] if has_past_present else [False, True]):
            name = "MHA" + ("_Rotary" if is_rotary else "") + ("_Past" if has_past_present else "")
            name += "_CrossAttention" if is_cross else ""
            rules.append(ReshapeKeepingMHA.rule(name, is_rotary=is_rotary, has_past_present=has_past_present,
                                                is_cross_attention=is_cross))
    return pattern.RewriteRuleSet(rules)


mha_rules_with_past = _rules(True)
mha_rules_no_past = _rules(False)

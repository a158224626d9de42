"""MultiHeadAttention fusion that keeps the export's final reshape when it is not ``[B, S, D]``.

onnxscript's MHA rule (``ort_fusions.mha``) matches::

    q,k,v ─Reshape─Transpose─[Concat(past)]─SDPA─Transpose(0,2,1,3)─Reshape(t) ──▶ y

and replaces ``y`` with the MultiHeadAttention output ``[B, S, D]`` without looking at ``t``
("TODO: verify Reshapes" upstream). GPT-2's Conv1D reshapes to ``[B*S, D]`` for a ``Gemm``, so the
fused graph fails at run time. Here the rule is the same, but when ``y``'s shape is not known to be
``[B, S, *]`` (rank 3, batch and sequence of the query) the rewrite ends with ``Reshape(mha, t)``:
the transposed SDPA output ``[B, S, H, Dh]`` and MultiHeadAttention's ``[B, S, H*Dh]`` hold the same
elements in the same order, so reshaping either to ``t`` is the same tensor.

Refusals are those of the upstream rule (shapes of q/k/v/past, mask shapes).
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


class ReshapeKeepingMHA(mha.MultiHeadAttention):
    """The upstream MHA rule; re-applies the final reshape when its target is not ``[B, S, D]``."""

    def rewrite(self, op, query_BSD, attention_reshaped, **kwargs):
        out = super().rewrite(op, query_BSD=query_BSD, attention_reshaped=attention_reshaped, **kwargs)
        if out is None or _is_bsd(attention_reshaped, query_BSD):
            return out
        target = attention_reshaped.producer().inputs[1]
        if isinstance(out, tuple):
            return (op.Reshape(out[0], target), *out[1:])
        return op.Reshape(out, target)


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

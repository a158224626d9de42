"""remove-padding on flattened token rows (GPT-2's Conv1D: ``Reshape [B, S, H] -> [B*S, H]``, ``Gemm``,
``Reshape`` back) and on first-token pooling (a classifier's ``Gather``/``Slice`` of position 0), hand-built.

The refusals that stay (a reduction over the flattened rows, pooling another position) are in
``remove_padding_test.py::test_refusals``; the Hugging Face exports are in ``hf_models_test.py``.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from graphopt.rewrites.remove_padding.encoders_test import FEEDS, apply, check_exact, encoder, padded_feed
from graphopt.runtime.session import make_session, run

#: feeds whose position 0 is a real token in every row (right padding, no padding, holes after it,
#: rows of length 1)
FIRST_REAL = ["right", "no_padding", "batch1", "holes"]


def _producers(model) -> dict[str, str]:
    return {o.name: n.op_type for n in model.graph for o in n.outputs if o.name}


@pytest.mark.parametrize("attention", ["", "bias"])
def test_gemm_over_flattened_rows_runs_packed(attention):
    """The Gemm over [B*S, H] rows runs on the packed [N+1, H] rows; exact for every padding pattern."""
    feeds = [FEEDS[k] for k in FEEDS]
    got, _, cmp, model = check_exact(lambda: encoder(flat="gemm", mha=attention), feeds)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    for f, g in zip(feeds, got):
        out = g["last_hidden_state"]
        assert not np.isnan(out).any() and np.all(out[~f["attention_mask"].astype(bool)] == 0)
    made = _producers(model)
    # Reshape to rows, Gemm, Reshape back: all three on packed values
    assert made["x1_rows_packed"] == "Reshape" and made["f1_rows_packed"] == "Gemm" and made["f1_packed"] == "Reshape"
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Gemm"] == 1 and ops["NonZero"] == 1, ops


def test_flattened_rows_pack_the_same_tokens_as_the_matmul_form():
    """The Gemm form and the MatMul form of the FFN pack the same ops (plus the two Reshapes)."""
    gemm = apply(encoder(flat="gemm"))
    matmul = apply(encoder())
    assert gemm.rule_counts["packed_ops"] == matmul.rule_counts["packed_ops"] + 2  # the Reshapes (Gemm for MatMul)
    assert gemm.notes == matmul.notes == []


@pytest.mark.parametrize("pool", ["cls", "classifier", "slice"])
def test_first_token_pooling_reads_the_packed_rows(pool):
    """Everything up to the pooling runs packed; the pooled rows are each sequence's first packed token,
    so the pooled output (and a classifier's logits) match the model before."""
    feeds = [FEEDS[k] for k in FIRST_REAL] + [padded_feed([1, 1, 1]), padded_feed([1, 6, 2], seed=3)]
    got, ref, cmp, model = check_exact(lambda: encoder(pool=pool), feeds)
    name = "logits" if pool != "cls" else "last_hidden_state"
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g[name], r[name], atol=1e-5)
        assert g[name].shape == r[name].shape
    result = apply(encoder(pool=pool))
    assert result.rule_counts["first_token_pooling"] == 1
    assert result.rule_counts["packed_ops"] == apply(encoder()).rule_counts["packed_ops"] - 1  # no output Identity
    assert any("first-token pooling" in n and "left padding" in n for n in result.notes), result.notes
    assert [o.name for o in model.graph.outputs] == [name]
    # nothing reads position 0 of an unpacked value: the pooling is a Gather of the packed rows
    assert not any(n.op_type in ("Gather", "Slice") and n.attributes.get_int("axis", 0) == 1 for n in model.graph)


def test_first_token_pooling_under_left_padding_pools_the_first_real_token():
    """Left padding puts a padding token at position 0: the packed graph pools the row's first real
    token (what a left-padded [CLS] is), as the note says, not the padding position the model read."""
    f = padded_feed([5, 3, 1, 7], left=True, seed=1)
    hidden = run(make_session(encoder(), optimize=False), [f])[0]["last_hidden_state"]
    first = f["attention_mask"].argmax(axis=1)
    pooled = run(make_session(apply(encoder(pool="cls")).model, optimize=False), [f])[0]["last_hidden_state"]
    np.testing.assert_allclose(pooled, hidden[np.arange(len(first)), first], atol=1e-5)

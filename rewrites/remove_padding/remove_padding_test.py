"""Tests of remove-padding on a hand-built one-layer encoder (no torch): exactness, fused attention, refusals.

The CUDA variant is in ``cuda_variant_test.py``, flattened token rows and first-token pooling in
``rows_and_pooling_test.py``, the real models in ``minilm_test.py`` and ``hf_models_test.py``.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from graphopt.engine import registry
from graphopt.errors import UsageError
from graphopt.rewrites.remove_padding.encoders_test import (
    FEEDS,
    H,
    apply,
    check_exact,
    encoder,
    fused_encoder,
    padded_feed,
)
from graphopt.runtime.session import make_session, run


@pytest.mark.parametrize("case", list(FEEDS))
def test_exact_on_real_tokens(case):
    feeds = [FEEDS[case]]
    got, ref, cmp, model = check_exact(encoder, feeds)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    out = got[0]["last_hidden_state"]
    m = feeds[0]["attention_mask"].astype(bool)
    assert not np.isnan(out).any()
    assert np.all(out[~m] == 0), "padded positions of the output are zero"
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["NonZero"] == 1 and ops["Softmax"] == 1


@pytest.mark.parametrize("mha", ["bias", "kpm"])
@pytest.mark.parametrize("groups", [0, 1, 3])
@pytest.mark.parametrize("attention_op", ["mha", "onnx"])
def test_fused_attention_groups(mha, groups, attention_op):
    feeds = [FEEDS[k] for k in ("right", "left", "no_padding", "batch1", "all_padding_row", "holes")]

    def factory():
        return encoder(mha=mha)

    got, _, cmp, model = check_exact(factory, feeds, attention_groups=groups, attention_op=attention_op)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    for f, g in zip(feeds, got):
        out = g["last_hidden_state"]
        assert not np.isnan(out).any() and np.all(out[~f["attention_mask"].astype(bool)] == 0)
    ops = collections.Counter((n.domain, n.op_type) for n in model.graph)
    # attention_op=onnx: ONNX Attention (opset 23) for the groups of a key-padding-mask attention only
    onnx_groups = attention_op == "onnx" and mha == "kpm" and groups > 0
    assert ops[("com.microsoft", "MultiHeadAttention")] == (0 if onnx_groups else max(groups, 1))
    assert ops[("", "Attention")] == (groups if onnx_groups else 0)
    assert model.opset_imports[""] == (23 if onnx_groups else 17)
    assert ops[("", "TopK")] == (1 if groups else 0)


def test_attention_op_is_checked():
    with pytest.raises(UsageError, match="attention_op"):
        registry.create("remove-padding", {"attention_op": "flash"})


def test_attention_op_auto_follows_the_onnx_runtime_version():
    from rewrites.remove_padding import resolve_attention_op

    assert [resolve_attention_op("auto", v) for v in ("1.20.1", "1.22.2", "1.23.0", "1.32.0", "1.23.0+cu130")] == [
        "mha", "mha", "onnx", "onnx", "onnx"]
    assert resolve_attention_op("mha", "1.32.0") == "mha" and resolve_attention_op("onnx", "1.20.0") == "onnx"


def test_attention_op_auto_runs_onnx_attention_on_this_onnx_runtime():
    """``auto`` on the installed ORT (>= 1.23 in the test set-up) emits ONNX Attention for the groups, exactly."""
    import onnxruntime

    from graphopt.runtime.ort_compat import version_key

    assert version_key(onnxruntime.__version__) >= (1, 23), "the test set-up installs ORT >= 1.23"
    got, _, cmp, model = check_exact(lambda: encoder(mha="kpm"), [FEEDS["right"], FEEDS["holes"]],
                                      attention_groups=3, attention_op="auto")
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    ops = collections.Counter((n.domain, n.op_type) for n in model.graph)
    assert ops[("", "Attention")] == 3 and ops[("com.microsoft", "MultiHeadAttention")] == 0


@pytest.mark.parametrize("mask_layout", ["eln", "raw"])
def test_fused_embed_and_attention(mask_layout):
    """EmbedLayerNormalization runs as packed Gathers + LayerNorm; Attention becomes grouped MHA.

    With the 1-D mask_index (right padding by definition) the attention is not grouped: it is split
    into packed projections + MultiHeadAttention on the unpacked batch.
    """
    right = [FEEDS[k] for k in ("right", "no_padding", "batch1", "all_padding_row")]
    feeds = right if mask_layout == "eln" else right + [FEEDS["left"], FEEDS["holes"]]

    def factory():
        return fused_encoder(mask_layout)

    got, _, cmp, model = check_exact(factory, feeds)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["EmbedLayerNormalization"] == 0 and ops["Attention"] == 0, ops
    assert ops["MultiHeadAttention"] == (1 if mask_layout == "eln" else 8), ops
    # the layer's two; the packed embeddings' norm (EmbedLayerNormalization split) is Sum + LayerNormalization
    # on CPU, where that is the faster form (SkipLayerNormalization with --provider cuda)
    assert ops["SkipLayerNormalization"] == 2 and ops["BiasGelu"] == 1
    assert ops["LayerNormalization"] == 1 and ops["Sum"] == 1, ops


def test_token_wise_ops_run_packed():
    model = encoder()
    result = apply(model)
    packed = collections.Counter(n.op_type for n in result.model.graph if n.outputs[0].name.endswith("_packed"))
    assert {"Gather", "Add", "LayerNormalization", "MatMul", "Erf"} <= set(packed)
    assert packed["MatMul"] == 6, packed  # Q, K, V, output projection (after attention), FFN x2
    assert packed["LayerNormalization"] == 3, packed
    # the attention core is untouched: still Reshape/Transpose on the padded layout
    assert not any(n.op_type in ("Softmax", "Reshape") and n.outputs[0].name.endswith("_packed")
                   for n in result.model.graph)


def test_position_ids_input_and_opset20_gelu():
    feeds = [padded_feed([5, 2, 7], position_ids=True), padded_feed([3, 6], left=True, position_ids=True, seed=4)]

    def factory():
        return encoder(position_ids=True, opset=20)

    _, _, cmp, _ = check_exact(factory, feeds)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()


def test_packed_output():
    feed = padded_feed([5, 0, 2, 7], left=True)
    ref = run(make_session(encoder(), optimize=False), [feed])[0]["last_hidden_state"]
    result = apply(encoder(), packed_output=True)
    assert result.modified, result.notes
    out = run(make_session(result.model, optimize=False), [feed])[0]["last_hidden_state"]
    m = feed["attention_mask"].astype(bool)
    assert out.shape == (int(m.sum()), H)
    np.testing.assert_allclose(out, ref[m], atol=1e-5)


@pytest.mark.parametrize("kind,reason", [
    ("no_mask", "no rank-2 attention mask"),
    ("pool", "mixes positions outside attention"),
    ("unmasked_softmax", "does not depend on the attention mask"),
    ("second", "selects or shifts positions"),
    ("flat_mixing", "ReduceMean '' mixes positions outside attention"),
])
def test_refusals(kind, reason):
    model = {"no_mask": lambda: encoder(mask=False), "pool": lambda: encoder(pool=True),
             "second": lambda: encoder(pool="second"), "flat_mixing": lambda: encoder(flat="mixing"),
             "unmasked_softmax": lambda: encoder(mask_in_softmax=False)}[kind]()
    before = ir.serde.serialize_model(model).SerializeToString()
    result = apply(model)
    assert not result.modified
    assert any(reason in n for n in result.notes), result.notes
    assert ir.serde.serialize_model(result.model).SerializeToString() == before, "refusal leaves the graph as it was"


def test_second_run_refuses():
    model = encoder()
    assert apply(model).modified
    result = apply(model)
    assert not result.modified and any("packed already" in n for n in result.notes), result.notes


def test_registered_with_options():
    cls = registry.get("remove-padding")
    assert cls.exact and cls.options() == {"packed_output": False, "attention_groups": 8, "packed_attention": True,
                                           "attention_op": "mha"}

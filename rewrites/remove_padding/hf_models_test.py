"""remove-padding on what users bring: a Hugging Face GPT-2 and a BERT sequence classifier, built here.

Tiny random models (transformers config classes, every weight, bias and norm drawn at random so no
term is a zero the exporter could drop), exported through ``graphopt.exporters.export`` (its parity
gate included) with dynamo and TorchScript. GPT-2's Conv1D is a ``Gemm`` over flattened token rows
(``[B*S, H]``); the classifier pools position 0 (``Gather``/``Slice``), then pooler Dense + Tanh and
the classifier. Each: the pass applies, its op counts show what runs packed, and on right-padded
batches of mixed lengths (rows of length 1, all rows the same length, a batch of one) the outputs
match the model before on real tokens within 1e-4 through ONNX Runtime (the classifier's logits,
every row).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from graphopt.data.metrics import compare
from graphopt.engine import registry
from graphopt.rewrites.remove_padding.encoders_test import apply
from graphopt.runtime.session import make_session, run

pytest.importorskip("torch", reason="exporting needs torch")
pytest.importorskip("transformers", reason="exporting needs transformers")

pytestmark = pytest.mark.slow

VOCAB, LAYERS = 120, 2
TASKS = {"gpt2": "causal-lm", "bert": "sequence-classification"}


def _hf_folder(dst, family: str):
    """A tiny random GPT-2 LM or BERT sequence classifier saved as an HF folder at ``dst``."""
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64,
                                         n_inner=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                         type_vocab_size=2, num_labels=3)
        model = transformers.BertForSequenceClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(family, exporter) -> Path`` of the ONNX export (made once per module)."""
    from graphopt.exporters import export

    made = {}

    def get(family: str, exporter: str):
        if (family, exporter) not in made:
            root = tmp_path_factory.mktemp(f"{family}-{exporter}")
            folder = _hf_folder(root / "hf", family)
            made[family, exporter] = export(folder, root / "model.onnx", task=TASKS[family], exporter=exporter).path
        return made[family, exporter]

    return get


def _feeds(family: str) -> list[dict[str, np.ndarray]]:
    """Right-padded batches: mixed lengths with a row of length 1, all rows the same length, one row of one token."""
    rng = np.random.default_rng(0)
    feeds = []
    for lengths in ([7, 3, 1, 5], [4, 4, 4], [1], [2, 1]):
        b, s = len(lengths), max(lengths)
        mask = (np.arange(s)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
        f = {"input_ids": rng.integers(3, VOCAB, (b, s)).astype(np.int64) * mask, "attention_mask": mask}
        if family == "bert":
            f["token_type_ids"] = (rng.random((b, s)) < 0.3).astype(np.int64) * mask
        feeds.append(f)
    return feeds


def _exact(path, model: ir.Model, family: str, **options) -> registry.PassResult:
    """The pass on ``model`` (loaded from ``path``) applies and keeps the outputs on real tokens within 1e-4."""
    feeds = _feeds(family)
    ref = run(make_session(path, optimize=False), feeds)
    result = apply(model, **options)
    assert result.modified, result.notes
    got = run(make_session(result.model, optimize=False), feeds)
    for lengths, f, g, r in zip(("mixed", "same", "one", "short"), feeds, got, ref):
        cmp = compare([g], [r], [f], atol=1e-4, rtol=1e-4)
        assert cmp.worst("max_abs") <= 1e-4, (lengths, cmp.summary())
        assert g["logits"].shape == r["logits"].shape
        if family == "bert":  # [B, labels]: every row is compared
            np.testing.assert_allclose(g["logits"], r["logits"], atol=1e-4, err_msg=lengths)
        else:  # [B, S, vocab]: real positions as before, padded positions zero
            m = f["attention_mask"].astype(bool)
            np.testing.assert_allclose(g["logits"][m], r["logits"][m], atol=1e-4, err_msg=lengths)
            assert np.all(g["logits"][~m] == 0)
    return result


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_gpt2_conv1d_gemms_run_packed(exported, exporter):
    """Every Conv1D Gemm (QKV, output projection, FFN in and out: 4 a layer) runs on the packed rows."""
    path = exported("gpt2", exporter)
    before = _ops(ir.load(path))
    assert before["Gemm"] == 4 * LAYERS, before
    result = _exact(path, ir.load(path), "gpt2")
    packed = collections.Counter(n.op_type for n in result.model.graph if n.outputs[0].name.endswith("_packed"))
    assert packed["Gemm"] == 4 * LAYERS and packed["LayerNormalization"] == 2 * LAYERS + 1, packed
    after = _ops(result.model)
    assert after["Gemm"] == 4 * LAYERS and after["NonZero"] == 1 and after["Softmax"] == LAYERS, after


def test_gpt2_fused_attention_runs_in_length_groups(exported):
    """After fuse, GPT-2's attention (the causal and padding masks in its bias) runs in 8 length groups a layer."""
    path = exported("gpt2", "dynamo")
    model = ir.load(path)
    registry.create("fuse")(model)
    result = _exact(path, model, "gpt2")
    assert result.rule_counts["grouped_attention"] == LAYERS, result.rule_counts
    assert _ops(result.model)["MultiHeadAttention"] == 8 * LAYERS


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_bert_classifier_pools_from_the_packed_rows(exported, exporter):
    """Everything up to the first-token pooling runs packed; the pooler and classifier run on [B, H] rows."""
    path = exported("bert", exporter)
    result = _exact(path, ir.load(path), "bert")
    assert result.rule_counts["first_token_pooling"] == 1 and result.rule_counts["packed_ops"] > 10 * LAYERS
    assert any("first-token pooling" in n for n in result.notes), result.notes
    packed = collections.Counter(n.op_type for n in result.model.graph if n.outputs[0].name.endswith("_packed"))
    assert packed["LayerNormalization"] == 2 * LAYERS + 1, packed
    assert _ops(result.model)["Gemm"] == _ops(ir.load(path))["Gemm"], "pooler and classifier stay as they are"


def test_bert_classifier_fused_runs_in_length_groups(exported):
    """fuse, then remove-padding: the fused attention in length groups, the pooling from the packed rows."""
    path = exported("bert", "dynamo")
    model = ir.load(path)
    registry.create("fuse")(model)
    result = _exact(path, model, "bert")
    assert result.rule_counts["grouped_attention"] == LAYERS and result.rule_counts["first_token_pooling"] == 1
    ops = _ops(result.model)
    assert ops["MultiHeadAttention"] == 8 * LAYERS and ops["Attention"] == 0, ops


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_pipeline_verifies_the_rewrite(exported, family):
    """Through the pipeline (generated feeds, a right-padded batch among them) the pass is kept, verified."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    res = pipeline.optimize(exported(family, "dynamo"), OptimizeOptions(passes="remove-padding"))
    assert res.ok, [p.error for p in res.report.failed()]
    rec = res.report.passes[0]
    assert rec.modified and rec.verification["max_abs"] <= 1e-4, rec.verification

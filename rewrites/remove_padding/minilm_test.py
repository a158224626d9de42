"""remove-padding on the real MiniLM exports (TorchScript and dynamo, eager and sdpa; unfused and fused)."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from graphopt.data.metrics import compare
from graphopt.engine import registry
from graphopt.rewrites.remove_padding.encoders_test import apply, apply_cuda, padded_feed
from graphopt.runtime.session import make_session, run


def _minilm_feeds():
    rng = np.random.default_rng(0)
    feeds = []
    for left in (False, True):
        lengths = [23, 5, 1, 17, 9]
        f = padded_feed(lengths, left=left, seed=int(left))
        f["input_ids"] = np.where(f["attention_mask"] == 1, rng.integers(1000, 20000, f["input_ids"].shape), 0)
        feeds.append(f)
    return feeds


MINILM_EXPORTS = [("torchscript", "eager"), ("torchscript", "sdpa"), ("dynamo", "eager"), ("dynamo", "sdpa")]


def _minilm_exact(path, model: ir.Model, **options) -> ir.Model:
    """remove-padding on ``model`` (from the export at ``path``) is exact on real tokens; the result."""
    feeds = _minilm_feeds()
    ref = run(make_session(path, optimize=False), feeds)
    result = apply(model, **options)
    assert result.modified, result.notes
    got = run(make_session(result.model), feeds)
    cmp = compare(got, ref, feeds)
    assert cmp.worst("max_abs") <= 1e-4, cmp.summary()
    return result.model


@pytest.mark.slow
@pytest.mark.parametrize("exporter,attn", MINILM_EXPORTS)
def test_minilm_unfused(minilm, exporter, attn):
    path = minilm(exporter, attn)
    _minilm_exact(path, ir.load(path))


@pytest.mark.slow
@pytest.mark.parametrize("exporter,attn", MINILM_EXPORTS)
def test_minilm_fused(minilm, exporter, attn):
    path = minilm(exporter, attn)
    model = ir.load(path)
    registry.create("fuse")(model)
    ops = collections.Counter(n.op_type for n in _minilm_exact(path, model).graph)
    assert ops["EmbedLayerNormalization"] == 0 and ops["Attention"] == 0, ops
    assert ops["MultiHeadAttention"] == 6 * 8, ops  # 6 layers x 8 length groups


@pytest.mark.slow
def test_minilm_fused_onnx_attention(minilm):
    """attention_op=onnx on MiniLM: 48 ONNX Attention (6 layers x 8 groups), opset 23, exact."""
    path = minilm("dynamo", "sdpa")
    model = ir.load(path)
    registry.create("fuse")(model)
    out = _minilm_exact(path, model, attention_op="onnx")
    ops = collections.Counter((n.domain, n.op_type) for n in out.graph)
    assert ops[("", "Attention")] == 48 and ops[("com.microsoft", "MultiHeadAttention")] == 0, ops
    assert out.opset_imports[""] == 23


@pytest.mark.slow
def test_packed_output_verified_by_pipeline(minilm):
    """With packed_output the pipeline compares the [tokens, hidden] output with the real tokens."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    res = pipeline.optimize(minilm("dynamo", "sdpa"), OptimizeOptions(
        passes="remove-padding", overrides=["remove-padding.packed_output=true"]))
    assert res.ok, [p.error for p in res.report.failed()]
    out = res.model.graph.outputs[0]
    assert out.shape is not None and len(out.shape) == 2
    assert res.report.passes[0].verification["max_abs"] <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("exporter,attn", [("dynamo", "sdpa"), ("torchscript", "eager")])
def test_minilm_fused_cuda_variant(minilm, exporter, attn):
    """fuse + remove-padding for CUDA on MiniLM: 6 PackedMultiHeadAttention, no MultiHeadAttention; real
    tokens match the unpacked export within 1e-4 through the CPU stand-in, for right/left padding,
    batch 1 and no padding."""
    from graphopt.runtime.standins import cpu_runnable

    path = minilm(exporter, attn)
    feeds = _minilm_feeds()
    rng = np.random.default_rng(2)
    for lengths in ([11], [9, 9, 9]):  # batch 1, no padding
        f = padded_feed(lengths)
        f["input_ids"] = rng.integers(1000, 20000, f["input_ids"].shape).astype(np.int64)
        feeds.append(f)
    ref = run(make_session(path, optimize=False), feeds)
    model = ir.load(path)
    registry.create("fuse")(model, registry.PassContext(provider="cuda"))  # what `optimize --provider cuda` runs
    result = apply_cuda(model)
    assert result.modified, result.notes
    ops = collections.Counter(n.op_type for n in result.model.graph)
    assert ops["PackedMultiHeadAttention"] == 6 and ops["MultiHeadAttention"] == 0, ops
    assert ops["Attention"] == 0 and ops["EmbedLayerNormalization"] == 0, ops
    got = run(make_session(cpu_runnable(result.model)[0]), feeds)
    for f, g, r in zip(feeds, got, ref):
        cmp = compare([g], [r], [f])
        assert cmp.worst("max_abs") <= 1e-4, cmp.summary()

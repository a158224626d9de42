"""The default recipe on eighteen tiny transformers families: every pass ok, the expected fusions, and a
model that loads in a plain ONNX Runtime session and matches the export.

Families: models/tiny.py (bert, gpt2, llama) and models/tiny_zoo.py (the rest; see its table), all
random-initialised, exported once with the dynamo exporter at opset 20 and cached; plus Qwen2 converted
to opset 23 (onnxscript's version converter), where RMSNorm has an ONNX op. For each family:

(a) ``graphopt.engine.pipeline.optimize`` with the default recipe: every pass status ``ok`` (none rolled back);
(b) the fused ops counted exactly (``EXPECTED``; domain-qualified, ``Sum`` is the CPU residual-norm form),
    no op left in the default domain that the model's ONNX opset lacks, no onnxscript placeholder;
(c) the saved model loads in ``onnxruntime.InferenceSession`` (default session options, CPU) and its
    outputs are within 1e-4 of the export's on generated feeds (two full batches and a right-padded one,
    compared on real tokens only, as the pipeline does).

What the counts record (opset 20 unless said; CPU provider): residual LayerNorms are ``Sum`` +
``LayerNormalization``; residual RMSNorms stay ``SkipSimplifiedLayerNormalization`` and the other RMSNorms
(the first one; Qwen3's per-head q/k norms) stay standard ops, as no ONNX op computes an RMSNorm below
opset 23; at opset 23 all five are ``RMSNormalization`` (the residual ones after a ``Sum``). Decoders get
MultiHeadAttention (GroupQueryAttention is an opt-in option) and com.microsoft RotaryEmbedding, partial
rotary included (phi, phi3, gpt_neox, stablelm: ``rotary_embedding_dim`` with ``num_heads``). Known
misses, each a missed pattern and not an error: BLOOM's ALiBi attention (two Softmax left) and its
GELU; DistilBERT's embedding LayerNorm; GPT-2's first LayerNorm (its embedding sum is also the first
residual); OPT's LayerNorms after the first (each reads a Reshape of its residual sum).
"""

from __future__ import annotations

import collections

import onnx
import onnx_ir as ir
import pytest

pytest.importorskip("torch", reason="the tiny families are exported with torch")
pytest.importorskip("transformers", reason="the tiny families are built with transformers")

MS = "com.microsoft"
SKIP_LN, SKIP_RMS = f"{MS}::SkipLayerNormalization", f"{MS}::SkipSimplifiedLayerNormalization"
MHA, ATT, ROPE = f"{MS}::MultiHeadAttention", f"{MS}::Attention", f"{MS}::RotaryEmbedding"
BIAS_GELU, FAST_GELU = f"{MS}::BiasGelu", f"{MS}::FastGelu"
EMBED_LN = f"{MS}::EmbedLayerNormalization"
LN, RMS, SUM, SOFTMAX = "LayerNormalization", "RMSNormalization", "Sum", "Softmax"

#: (family, op counts after the default recipe); ops not named here must be absent among FUSION_OPS
EXPECTED: dict[str, dict[str, int]] = {
    # encoders (Attention with the 2-D mask index; roberta's padding-offset positions keep its embedding
    # sum out of EmbedLayerNormalization, so it is a residual-style Sum + LayerNormalization)
    "bert": {ATT: 2, EMBED_LN: 1, SUM: 4, LN: 4, BIAS_GELU: 2},
    "roberta": {ATT: 2, SUM: 5, LN: 5, BIAS_GELU: 2},
    "distilbert": {ATT: 2, SUM: 4, LN: 5, BIAS_GELU: 2},
    "albert": {ATT: 2, EMBED_LN: 1, SUM: 4, LN: 4, FAST_GELU: 2},
    "electra": {ATT: 2, EMBED_LN: 1, SUM: 4, LN: 4, BIAS_GELU: 2},
    # decoders with past
    "gpt2": {MHA: 2, SUM: 4, LN: 5, FAST_GELU: 2},
    "llama": {MHA: 2, ROPE: 4, SKIP_RMS: 4},
    "qwen2": {MHA: 2, ROPE: 4, SKIP_RMS: 4},
    "qwen2-opset23": {MHA: 2, ROPE: 4, SUM: 4, RMS: 5},
    "qwen3": {MHA: 2, ROPE: 4, SKIP_RMS: 4},
    "mistral": {MHA: 2, ROPE: 4, SKIP_RMS: 4},
    "gemma": {MHA: 2, ROPE: 4, SKIP_RMS: 4},
    "phi": {MHA: 2, ROPE: 4, SUM: 2, LN: 3, FAST_GELU: 2},
    "phi3": {MHA: 2, ROPE: 4, SKIP_RMS: 4},
    "gpt_neox": {MHA: 2, ROPE: 4, SUM: 2, LN: 3, BIAS_GELU: 2},
    "stablelm": {MHA: 2, ROPE: 4, SUM: 4, LN: 5},
    "falcon": {MHA: 2, ROPE: 4, SUM: 2, LN: 3},
    "opt": {MHA: 2, SUM: 1, LN: 5},
    "bloom": {SOFTMAX: 2, SUM: 4, LN: 6},
}
#: the ops whose counts EXPECTED pins (absent from a family's entry: must be 0)
FUSION_OPS = sorted({SKIP_LN, SKIP_RMS, MHA, ATT, ROPE, BIAS_GELU, FAST_GELU, EMBED_LN, RMS, f"{MS}::GroupQueryAttention",
                     f"{MS}::Gelu", LN, SUM, SOFTMAX})
#: partial rotary: rotary_embedding_dim (< head size 16) and the num_heads ORT requires with it
PARTIAL_ROTARY = {"phi": 8, "phi3": 8, "gpt_neox": 4, "stablelm": 4}


def _tiny_py(family: str, task: str):
    from conftest import load_models_module

    return lambda: load_models_module("tiny").build(family, task)


def _zoo(family: str):
    from conftest import load_models_module

    return lambda: load_models_module("tiny_zoo").build(family)


SOURCES = {
    "bert": _tiny_py("bert", "feature-extraction"),
    "gpt2": _tiny_py("gpt2", "causal-lm-with-past"),
    "llama": _tiny_py("llama", "causal-lm-with-past"),
    **{f: _zoo(f) for f in EXPECTED if f not in ("bert", "gpt2", "llama", "qwen2-opset23")},
}


def _load(family: str) -> ir.Model:
    if family == "qwen2-opset23":
        from onnxscript import version_converter

        model = ir.load(SOURCES["qwen2"]())
        version_converter.convert_version(model, 23)
        assert model.opset_imports[""] == 23
        return model
    return ir.load(SOURCES[family]())


def _counts(model: ir.Model) -> collections.Counter:
    return collections.Counter(
        f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph)
    )


@pytest.mark.parametrize("family", list(EXPECTED))
def test_default_recipe_fuses_loads_and_matches(family, tmp_path):
    from graphopt import io
    from graphopt.data.feeds import generate
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.pipeline import optimize

    model = _load(family)
    opset = model.opset_imports[""]
    src = tmp_path / "export.onnx"
    io.save(model, src)
    feeds = generate(model)

    # (a) every pass ok, nothing rolled back
    result = optimize(src, OptimizeOptions(explain=True))
    statuses = {p.name: p.status for p in result.report.passes}
    assert result.ok and set(statuses.values()) == {"ok"}, [(p.name, p.status, p.error) for p in result.report.passes]
    assert statuses["fuse"] == "ok" and "fuse" in statuses

    # (b) the expected fusions (counted on fuse's output: remove-padding may repack encoders after it),
    # and in the final model only ops the model's opset (or ORT's contrib domain) defines
    fused = collections.Counter(result.report.ops_before)
    for rec in result.report.passes[: [p.name for p in result.report.passes].index("fuse") + 1]:
        fused.update(rec.op_delta)
    want = {op: EXPECTED[family].get(op, 0) for op in FUSION_OPS}
    assert {op: fused[op] for op in FUSION_OPS} == want, {k: v for k, v in fused.items() if v and ("::" in k or k in want)}
    ops = _counts(result.model)
    for key in ops:
        domain, _, op = key.rpartition("::")
        assert domain in ("", MS), key  # no onnxscript placeholder (ai.onnxruntime._fusion) left
        if not domain:
            assert onnx.defs.has(op) and onnx.defs.get_schema(op, opset).since_version <= opset, key
    for node in result.model.graph:
        if node.op_type == "RotaryEmbedding" and node.attributes.get_int("rotary_embedding_dim", 0):
            assert node.attributes.get_int("rotary_embedding_dim") == PARTIAL_ROTARY[family]
            assert node.attributes.get_int("num_heads", 0) > 0
    if family in PARTIAL_ROTARY:
        assert any(n.attributes.get_int("rotary_embedding_dim", 0) for n in result.model.graph), "partial rotary unfused"

    # (c) a plain ORT session loads it and matches the export
    _check_loads_and_matches(family, src, result.model, feeds, tmp_path)


def _check_loads_and_matches(family, src, model, feeds, tmp_path) -> None:
    import onnxruntime as ort

    from graphopt import io
    from graphopt.data.metrics import compare

    out = tmp_path / "optimized.onnx"
    io.save(model, out)
    ref_sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [o.name for o in ref_sess.get_outputs()]
    assert [o.name for o in sess.get_outputs()] == names
    ref = [dict(zip(names, ref_sess.run(None, f), strict=True)) for f in feeds]
    got = [dict(zip(names, sess.run(None, f), strict=True)) for f in feeds]
    # mask-aware like the pipeline: padded positions of a padded batch are not compared (remove-padding
    # leaves other values there); the unpadded feeds are compared whole
    worst = compare(got, ref, feeds, atol=1e-4, rtol=0.0)
    assert worst.worst("max_abs") <= 1e-4, f"{family}: {worst.summary()}"


DECODERS = ["llama", "qwen2", "qwen3", "gemma", "phi", "phi3", "gpt_neox", "stablelm", "falcon"]


@pytest.mark.parametrize("option", ["gqa", "cuda"])
@pytest.mark.parametrize("family", DECODERS)
def test_decoder_options_load(family, option, tmp_path):
    """``fuse.gqa=true`` (GroupQueryAttention refused where its rewrite would be ill-formed: positions given by
    their start, partial rotary) and the CUDA forms (Skip* norms kept) pass and load too."""
    from graphopt import io
    from graphopt.data.feeds import generate
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.pipeline import optimize

    model = _load(family)
    src = tmp_path / "export.onnx"
    io.save(model, src)
    kw = {"overrides": ["fuse.gqa=true"]} if option == "gqa" else {"provider": "cuda"}
    result = optimize(src, OptimizeOptions(**kw))
    assert result.ok and {p.status for p in result.report.passes} == {"ok"}, [
        (p.name, p.status, p.error) for p in result.report.passes]
    ops = _counts(result.model)
    # group-query-attention (the decoder recipe) takes the rotaries inside where it applies (never on cuda
    # for float32: ORT's CUDA kernel is fp16/bf16 only)
    gqa = ops[f"{MS}::GroupQueryAttention"]
    assert (ops[ROPE], ops[MHA] + gqa) in ((4, 2), (0, 2)) and (ops[ROPE] == 0) == (gqa == 2), ops
    if option == "cuda":
        assert gqa == 0, ops
    if option == "cuda":
        assert ops[SUM] == 0 and ops[SKIP_LN] + ops[SKIP_RMS] >= 2, ops
    _check_loads_and_matches(family, src, result.model, generate(model), tmp_path)

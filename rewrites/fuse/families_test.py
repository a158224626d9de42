"""``fuse`` on the seeded tiny families of models/tiny.py: op counts, parity, and why what stays unfused does.

What is fused today (dynamo exports):

- BERT-like: fully fused (2 Attention with the 2-D mask_index, 4 residual LayerNorms, 2 BiasGelu, EmbedLayerNorm).
- GPT-2-like with past: 2 MultiHeadAttention (past/present), 4 residual LayerNorms, 2 FastGelu (tanh GELU).
  Not fused: the first LayerNorm, fed by the embedding sum ``wte + wpe``, which is also the first
  residual (SkipLayerNormalization's rule refuses a sum used elsewhere).
- Llama-like with past (opset 20): 4 residual SkipSimplifiedLayerNormalization, 4 RotaryEmbedding (run-time
  cos/sin cache, see fuse_rotary_cache), 2 MultiHeadAttention. Not fused: the first RMSNorm (fed by the
  embedding, not a residual): below opset 23 no ONNX op computes an RMSNorm (see fuse_rms_norm).
  Not used: GroupQueryAttention (option ``gqa``, off by default: it replaces the mask by per-row
  lengths, exact only for right padding), so K/V heads stay expanded (Expand/Reshape) for
  MultiHeadAttention; ``--explain`` says so.

On the CPU provider (the default here) each residual LayerNorm is ``Sum`` + ``LayerNormalization``
rather than ``SkipLayerNormalization`` (see fuse_residual_norm); the ``_cuda`` test checks the fused
form. The residual RMSNorms stay ``SkipSimplifiedLayerNormalization`` below opset 23 on both.
More families (GQA, partial rotary, parallel residual, ALiBi, learned positions): tests/test_fuse_families.py.
"""

from __future__ import annotations

import collections

import onnx_ir as ir
import pytest

from graphopt.analysis.fusion_status import fusion_status
from graphopt.data.feeds import generate
from graphopt.data.metrics import compare
from graphopt.engine import registry
from graphopt.engine.registry import PassContext
from graphopt.runtime.session import make_session, run


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("torch", reason="torch is needed to export the tiny models")
    from conftest import load_models_module

    mod = load_models_module("tiny")
    return lambda family, task: mod.build(family, task, exporter="dynamo")


def _fuse(path):
    model = ir.load(path)
    feeds = generate(model)
    ref = run(make_session(model, optimize=False), feeds)
    p = registry.create("fuse")
    result = p(model, PassContext(explain=True))
    got = run(make_session(model, optimize=False), feeds)
    ops = collections.Counter(n.op_type for n in model.graph)
    return model, ops, result.notes, compare(got, ref, feeds).worst("max_abs")


def test_bert_fully_fused(tiny):
    model, ops, _, err = _fuse(tiny("bert", "feature-extraction"))
    want = {"Attention": 2, "Sum": 4, "LayerNormalization": 4, "BiasGelu": 2, "EmbedLayerNormalization": 1}
    assert dict(ops) == {**want, "MatMul": 6, "Cast": 3}, ops
    assert ops["Softmax"] == 0 and ops["Where"] == 0  # the mask subgraph is gone: 2-D mask_index
    att = next(n for n in model.graph if n.op_type == "Attention")
    assert att.inputs[3] is not None and att.inputs[3].shape.rank() == 2
    assert fusion_status(model)["fully_fused"]
    assert err <= 1e-5


def test_gpt2_with_past(tiny):
    model, ops, notes, err = _fuse(tiny("gpt2", "causal-lm-with-past"))
    # 4 residual Sum + LayerNormalization, and the first LayerNorm left after its Add (below)
    want = {"MultiHeadAttention": 2, "Sum": 4, "LayerNormalization": 5, "SkipLayerNormalization": 0, "FastGelu": 2}
    assert {k: ops[k] for k in want} == want, ops
    assert ops["Softmax"] == 0 and ops["Tanh"] == 0
    assert err <= 1e-5
    status = fusion_status(model)
    assert status["attention"]["unfused"] == 0 and status["gelu"]["unfused"] == 0
    # the stock LayerNormalization is ORT's kernel: fused, and noted as one after an Add
    assert status["layer_norm"]["unfused"] == 0 and status["layer_norm_after_add"] == 1
    assert not any("layer_norm site(s) left unfused" in n for n in notes), notes
    (ln,) = [n for n in model.graph if n.op_type == "LayerNormalization" and n.inputs[0].producer().op_type != "Sum"]
    emb_sum = ln.inputs[0]
    assert emb_sum.producer().op_type == "Add" and len(emb_sum.uses()) > 1  # the sum is also the residual


def test_llama_with_past(tiny):
    model, ops, notes, err = _fuse(tiny("llama", "causal-lm-with-past"))
    want = {"SimplifiedLayerNormalization": 0, "Sum": 0, "SkipSimplifiedLayerNormalization": 4,
            "MultiHeadAttention": 2, "RotaryEmbedding": 4, "ReduceMean": 1}
    assert {k: ops[k] for k in want} == want, ops
    assert all(n.domain == "com.microsoft" for n in model.graph if n.op_type == "RotaryEmbedding")
    assert ops["Softmax"] == 0 and ops["GroupQueryAttention"] == 0
    assert err <= 1e-5
    status = fusion_status(model)
    assert status["rotary"] == {"fused": 4, "unfused": 0, "unfused_nodes": []}
    assert status["attention"]["unfused"] == 0 and status["layer_norm"]["unfused"] == 1
    assert any("opset 20 < 23 has no RMSNormalization" in n for n in notes), notes
    assert any(n.startswith("fuse: gqa: GroupQueryAttention not tried") for n in notes), notes


@pytest.mark.parametrize("family,task,want,unfused_norms", [
    ("bert", "feature-extraction", {"SkipLayerNormalization": 4, "Sum": 0}, 0),
    # the first RMSNorm (not a residual) has no ONNX op below opset 23
    ("llama", "causal-lm-with-past", {"SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 0, "Sum": 0}, 1),
])
def test_cuda_keeps_skip_norm(tiny, family, task, want, unfused_norms):
    """With the CUDA provider the residual LayerNorms stay ORT's fused Skip* ops (checked on CPU here)."""
    model = ir.load(tiny(family, task))
    feeds = generate(model)
    ref = run(make_session(model, optimize=False), feeds)
    p = registry.create("fuse")
    p(model, PassContext(provider="cuda"))
    ops = collections.Counter(n.op_type for n in model.graph)
    assert {k: ops[k] for k in want} == want, ops
    status = fusion_status(model)
    assert status["layer_norm"]["unfused"] == unfused_norms and status["attention"]["unfused"] == 0, status
    got = run(make_session(model, optimize=False), feeds)
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-5

"""Tests of the ``fuse`` pass: small graphs per fusion, refusals, and MiniLM from four exporters."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.analysis.fusion_status import fusion_status
from graphopt.data.feeds import generate
from graphopt.data.metrics import compare
from graphopt.engine import registry
from graphopt.engine.registry import PassContext
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(0)
D, F = 8, 16


def _init(name, shape, scale=0.3):
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _model(nodes, inits, outputs=("y",), opset=17) -> ir.Model:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", "seq", None]) for o in outputs],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _erf_gelu(x: str, y: str) -> list:
    """y = x * 0.5 * (1 + erf(x / sqrt 2)) as exporters write it."""
    return [
        helper.make_node("Div", [x, "sqrt2"], [f"{y}_d"]),
        helper.make_node("Erf", [f"{y}_d"], [f"{y}_e"]),
        helper.make_node("Add", [f"{y}_e", "one"], [f"{y}_a"]),
        helper.make_node("Mul", [x, f"{y}_a"], [f"{y}_m"]),
        helper.make_node("Mul", [f"{y}_m", "half"], [y]),
    ]


def _consts():
    return [
        numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "sqrt2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]


def _ffn_model(extra_output: str | None = None) -> ir.Model:
    """x ─ MatMul ─ Add(b1) ─ erf-GELU ─ MatMul ─ Add(b2) ─ Add(x) ─ LayerNorm ─ y."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        *_erf_gelu("hb", "g"),
        helper.make_node("MatMul", ["g", "w2"], ["o"]),
        helper.make_node("Add", ["o", "b2"], ["ob"]),
        helper.make_node("Add", ["ob", "x"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5),
    ]
    inits = [
        _init("w1", (D, F)), _init("b1", (F,)), _init("w2", (F, D)), _init("b2", (D,)),
        _init("gamma", (D,), 1.0), _init("beta", (D,)), *_consts(),
    ]
    outputs = ("y",) if extra_output is None else ("y", extra_output)
    return _model(nodes, inits, outputs)


def _feeds(batch=2, seq=5):
    return [{"x": RNG.standard_normal((batch, seq, D)).astype(np.float32)}]


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _fuse(model: ir.Model, **opts):
    feeds = _feeds()
    ref = run(make_session(model, optimize=False), feeds)
    p = registry.create("fuse", opts)
    result = p(model, PassContext(explain=True))
    got = run(make_session(result.model, optimize=False), feeds)
    cmp = compare(got, ref, feeds)
    return result, p, cmp


def test_registered():
    cls = registry.get("fuse")
    assert cls.exact and "cleanup" in cls.run_after
    assert "com.microsoft::Attention" in cls.emits
    assert cls.summary()


def test_skip_layernorm_and_bias_gelu():
    """CPU (the default provider): the residual LayerNorm ends as Sum + LayerNormalization."""
    result, p, cmp = _fuse(_ffn_model())
    ops = _ops(result.model)
    assert ops["Sum"] == 1 and ops["LayerNormalization"] == 1 and ops["BiasGelu"] == 1, ops
    assert ops["SkipLayerNormalization"] == 0 and ops["Erf"] == 0 and ops["Add"] == 0, ops
    assert cmp.worst("max_abs") <= 1e-5
    assert result.rule_counts["bias_gelu"] == 1
    assert result.rule_counts["residual_norm"] == 1
    assert fusion_status(result.model)["fully_fused"]


@pytest.mark.parametrize("provider,skip_norm,fused", [
    ("cuda", "auto", True), ("cpu", "fused", True), ("cuda", "sum", False), ("cpu", "auto", False),
])
def test_skip_norm_form_follows_provider(provider, skip_norm, fused):
    feeds = _feeds()
    model = _ffn_model()
    ref = run(make_session(model, optimize=False), feeds)
    p = registry.create("fuse", {"skip_norm": skip_norm})
    result = p(model, PassContext(provider=provider))
    ops = _ops(result.model)
    if fused:
        assert ops["SkipLayerNormalization"] == 1 and ops["Sum"] == 0 and ops["LayerNormalization"] == 0, ops
    else:
        assert ops["SkipLayerNormalization"] == 0 and ops["Sum"] == 1 and ops["LayerNormalization"] == 1, ops
    assert fusion_status(result.model)["fully_fused"]
    got = run(make_session(result.model, optimize=False), feeds)
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-5


def test_unknown_skip_norm_is_rejected():
    from graphopt.errors import UsageError

    with pytest.raises(UsageError):
        registry.create("fuse", {"skip_norm": "maybe"})


def test_gelu_off_keeps_erf():
    result, _, cmp = _fuse(_ffn_model(), gelu="off")
    ops = _ops(result.model)
    assert ops["Erf"] == 1 and ops["BiasGelu"] == 0
    assert ops["Sum"] == 1 and ops["LayerNormalization"] == 1
    assert cmp.worst("max_abs") <= 1e-5


def test_refuses_when_intermediate_is_used_outside():
    """The GELU's input is also a graph output: no BiasGelu may swallow it."""
    result, _, cmp = _fuse(_ffn_model(extra_output="hb"))
    ops = _ops(result.model)
    assert ops["BiasGelu"] == 0, ops
    assert "hb" in [o.name for o in result.model.graph.outputs]
    assert cmp.worst("max_abs") <= 1e-5
    assert not fusion_status(result.model)["fully_fused"] or ops["Gelu"] == 1


def test_unknown_gelu_mode_is_rejected():
    from graphopt.errors import UsageError

    with pytest.raises(UsageError):
        registry.create("fuse", {"gelu": "sometimes"})


def test_explain_names_unfused_sites():
    result, p, _ = _fuse(_ffn_model(), gelu="off")
    assert not fusion_status(result.model)["fully_fused"]
    assert any("1 gelu site(s) left unfused: Erf" in n for n in result.notes), result.notes


def test_fusion_status_counts_unfused():
    status = fusion_status(_ffn_model())
    assert status["gelu"]["unfused"] == 1
    # a stock LayerNormalization is ORT's fused kernel, also after a residual Add (noted: SkipLayerNorm on CUDA)
    assert status["layer_norm"] == {"fused": 1, "unfused": 0, "unfused_nodes": []}
    assert status["layer_norm_after_add"] == 1 and status["fused_ops"]["layer_norm"] == {"LayerNormalization": 1}
    assert status["attention"] == {"fused": 0, "unfused": 0, "unfused_nodes": []}
    assert not status["fully_fused"]


# ------------------------------------------------------------------ MiniLM, four exporters

#: on CPU (the default provider) each residual LayerNorm is Sum + LayerNormalization (see fuse_residual_norm)
EXPECTED = {"Attention": 6, "Sum": 12, "LayerNormalization": 12, "BiasGelu": 6, "EmbedLayerNormalization": 1}


@pytest.mark.parametrize("exporter,attn", [
    ("torchscript", "eager"), ("torchscript", "sdpa"), ("dynamo", "eager"), ("dynamo", "sdpa"),
])
def test_minilm_fully_fused(minilm, exporter, attn):
    model = ir.load(minilm(exporter, attn))
    feeds = generate(model)
    assert any(f["attention_mask"].min() == 0 for f in feeds), "feeds must include padding"
    ref = run(make_session(model, optimize=False), feeds)
    p = registry.create("fuse")
    p(model)
    ops = _ops(model)
    assert {k: ops[k] for k in EXPECTED} == EXPECTED, ops
    assert ops["Softmax"] == 0 and ops["Erf"] == 0 and ops["SkipLayerNormalization"] == 0
    # no float islands left: the mask subgraph is dead (2-D mask_index), packed QKV weights are folded
    assert dict(ops) == {**EXPECTED, "MatMul": 18, "Cast": 3}, ops
    att = next(n for n in model.graph if n.op_type == "Attention")
    assert att.inputs[3].name == "attention_mask_int32" and att.attributes["mask_filter_value"].value < -1e4
    status = fusion_status(model)
    assert status["fully_fused"], status
    got = run(make_session(model, optimize=False), feeds)
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-4


def _tanh_gelu_model(c1=0.044715) -> ir.Model:
    """x ─ MatMul ─ 0.5 x (1 + tanh(sqrt(2/pi) (x + c1 x^3))) as GPT-2 writes it."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Pow", ["h", "three"], ["h3"]),
        helper.make_node("Mul", ["h3", "c1"], ["h3c"]),
        helper.make_node("Add", ["h", "h3c"], ["s"]),
        helper.make_node("Mul", ["s", "c2"], ["sc"]),
        helper.make_node("Tanh", ["sc"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["a"]),
        helper.make_node("Mul", ["h", "half"], ["hh"]),
        helper.make_node("Mul", ["hh", "a"], ["y"]),
    ]
    inits = [
        _init("w1", (D, F)),
        numpy_helper.from_array(np.array(3.0, np.float32), "three"),
        numpy_helper.from_array(np.array(c1, np.float32), "c1"),
        numpy_helper.from_array(np.array(np.sqrt(2 / np.pi), np.float32), "c2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    return _model(nodes, inits)


def test_tanh_gelu_to_fast_gelu():
    result, p, cmp = _fuse(_tanh_gelu_model())
    ops = _ops(result.model)
    assert ops["FastGelu"] == 1 and ops["Tanh"] == 0, ops
    assert result.rule_counts["tanh_gelu"] == 1
    assert cmp.worst("max_abs") <= 1e-5


def test_tanh_gelu_refuses_other_constant():
    from graphopt.rewrites.fuse import _why_not
    from graphopt.rewrites.fuse.rules.gelu_tanh import tanh_gelu_rules

    result, _, cmp = _fuse(_tanh_gelu_model(c1=0.05))
    assert _ops(result.model)["FastGelu"] == 0 and not result.modified
    model = _tanh_gelu_model(c1=0.05)
    ir.passes.common.ShapeInferencePass()(model)
    assert "is not 0.044715" in (_why_not(tanh_gelu_rules, model, "tanh_gelu") or "")


def test_placeholder_without_contrib_form_is_never_emitted(minilm, monkeypatch):
    """When onnxscript's SDPA placeholder matches but no later rule maps it to a contrib op, attention stays as
    the exporter wrote it (the placeholder is no op ORT knows) and every other fusion still applies."""
    import graphopt.rewrites.fuse as fuse_mod
    from graphopt.opsets import FUSION_PLACEHOLDER_DOMAIN

    real_steps = fuse_mod._steps
    mapping = {"mha1", "mha2", "mha_scale", "mha_bias", "attention", "sdpa_via_mha", "mask_index"}
    monkeypatch.setattr(fuse_mod, "_steps", lambda opts, provider: [
        (n, s) for n, s in real_steps(opts, provider) if not (opts.attention and n in mapping)])
    model = ir.load(minilm("dynamo", "sdpa"))
    feeds = generate(model)
    ref = run(make_session(model, optimize=False), feeds)
    result = registry.create("fuse").call(model, PassContext())
    ops = _ops(model)
    assert not any(n.domain == FUSION_PLACEHOLDER_DOMAIN for n in model.graph)
    assert ops["Softmax"] == 6 and ops["Attention"] == 0 and ops["LayerNormalization"] == 12, ops
    assert result.modified and any("attention left unfused" in n for n in result.notes), result.notes
    got = run(make_session(model, optimize=False), feeds)
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-4

"""Tests of prune-heads: seeded two-layer fused encoders (no torch) and the real MiniLM exports."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from testmodels import embed_layernorm_prologue

from graphopt.data.metrics import compare, parse_budget
from graphopt.engine import pipeline, recipe, registry
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.registry import PassContext
from graphopt.errors import UsageError
from graphopt.runtime import standins
from graphopt.runtime.session import make_session, run

H, NH, VOCAB, MAXPOS, LAYERS = 16, 4, 50, 64, 2
MS = "com.microsoft"


def _encoder(kind: str = "attention", *, unidirectional: int = 0, extra_context_use: bool = False) -> ir.Model:
    """EmbedLayerNormalization, then per layer a fused attention (``attention``: packed QKV ``Attention``;
    ``mha``: Q/K/V MatMuls into ``MultiHeadAttention``), output projection, SkipLayerNorm, FFN."""
    rng = np.random.default_rng(3)
    inits = []

    def w(name, *shape, scale=0.4):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    nodes = embed_layernorm_prologue(w, vocab=VOCAB, max_pos=MAXPOS, hidden=H)
    x = "x0"
    for i in range(LAYERS):
        if kind == "attention":
            nodes.append(helper.make_node("Attention", [x, w(f"Wqkv{i}", H, 3 * H), w(f"bqkv{i}", 3 * H), "mask32"],
                                          [f"ctx{i}"], domain=MS, num_heads=NH, unidirectional=unidirectional))
        else:
            for p in "qkv":
                nodes.append(helper.make_node("MatMul", [x, w(f"W{p}{i}", H, H)], [f"{p}{i}"]))
            nodes.append(helper.make_node("MultiHeadAttention", [f"q{i}", f"k{i}", f"v{i}", w(f"bqkv{i}", 3 * H),
                                                                 "mask32"], [f"ctx{i}"], domain=MS, num_heads=NH))
        ctx = f"ctx{i}"
        if extra_context_use and i == 0:
            nodes.append(helper.make_node("Relu", [ctx], ["ctx_relu"]))
            nodes.append(helper.make_node("Add", [ctx, "ctx_relu"], ["ctx_more"]))
            ctx = "ctx_more"
        nodes += [
            helper.make_node("MatMul", [ctx, w(f"Wo{i}", H, H)], [f"om{i}"]),
            helper.make_node("SkipLayerNormalization", [f"om{i}", x, w(f"g1{i}", H), w(f"b1{i}", H), w(f"bo{i}", H)],
                             [f"x1{i}"], domain=MS, epsilon=1e-5),
            helper.make_node("MatMul", [f"x1{i}", w(f"W1{i}", H, 4 * H)], [f"f1{i}"]),
            helper.make_node("BiasGelu", [f"f1{i}", w(f"bf1{i}", 4 * H)], [f"f1g{i}"], domain=MS),
            helper.make_node("MatMul", [f"f1g{i}", w(f"W2{i}", 4 * H, H)], [f"f2{i}"]),
            helper.make_node("SkipLayerNormalization", [f"f2{i}", f"x1{i}", w(f"g2{i}", H), w(f"b2{i}", H)],
                             [f"x{i + 1}"], domain=MS, epsilon=1e-5),
        ]
        x = f"x{i + 1}"
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", H])
    graph = helper.make_graph(nodes, "encoder", inputs, [out], initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=9)
    return ir.serde.deserialize_model(proto)


def _feeds(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = rng.integers(3, 12, 4)
        m = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int64)
        out.append({"input_ids": rng.integers(1, VOCAB, (4, 12)).astype(np.int64) * m, "attention_mask": m,
                    "token_type_ids": np.zeros((4, 12), np.int64)})
    return out


CALIB, HELD = _feeds(3), _feeds(3, seed=1)


def _ctx() -> PassContext:
    return PassContext(feeds=HELD, calib_feeds=CALIB)


def _removed(notes: list[str]) -> dict[int, list[int]]:
    """Layer -> removed heads, from the pass's note."""
    line = next(n for n in notes if n.startswith("removed "))
    return {int(i): [int(h) for h in hs.split(", ")] for i, hs in re.findall(r"layer (\d+): \d+ of \d+ \(([\d, ]+)\)", line)}


def _zeroed(model: ir.Model, removed: dict[int, list[int]]) -> ir.Model:
    """``model`` with the context of the ``removed`` heads multiplied by 0 before each output projection."""
    graph = model.graph
    projections = [n for n in graph if n.op_type == "MatMul" and n.inputs[0].name.startswith("ctx")]
    d = H // NH
    for i, mm in enumerate(projections):
        mask = np.ones(H, np.float32)
        for h in removed.get(i, []):
            mask[h * d:(h + 1) * d] = 0
        c = ir.Value(name=f"zero_mask{i}", const_value=ir.tensor(mask, name=f"zero_mask{i}"),
                     type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([H]))
        graph.register_initializer(c)
        mul = ir.node("Mul", [mm.inputs[0], c])
        graph.insert_before(mm, mul)
        mm.replace_input_with(0, mul.outputs[0])
    return model


def _padding_removed(kind: str, provider: str) -> ir.Model:
    m = _encoder(kind)
    res = registry.create("remove-padding", {})(m, PassContext(provider=provider))
    assert res.modified, res.notes
    return m


@pytest.mark.parametrize("form", ["attention", "mha", "attention+remove-padding",
                                  "attention+remove-padding-cuda"])
def test_removed_heads_equal_zeroed_context(form):
    """Removing heads (no compensation) == the input model with those heads' context zeroed, on every
    fused form: packed-QKV Attention, MHA, remove-padding's 8 length-group copies, and its CUDA
    PackedMultiHeadAttention (run through its CPU stand-in)."""
    provider = "cuda" if form.endswith("cuda") else "cpu"
    model = _padding_removed("attention", provider) if "+" in form else _encoder(form)
    result = registry.create("prune-heads", {"heads": 3, "compensate": False})(
        model, PassContext(provider=provider, feeds=HELD, calib_feeds=CALIB))
    assert result.modified and result.rule_counts["prune-heads-removed"] == 3, result.notes
    removed = _removed(result.notes)
    assert sum(map(len, removed.values())) == 3
    attn = [n for n in model.graph if n.domain == MS and "Attention" in n.op_type]
    heads = {n.attributes["num_heads"].value for n in attn}
    assert heads <= {NH - len(removed.get(i, [])) for i in range(LAYERS)} and len(heads) >= 1
    ref = run(make_session(_zeroed(_encoder(form.split("+")[0]), removed), optimize=False), HELD)
    got = run(make_session(standins.cpu_runnable(model)[0], optimize=False), HELD)
    c = compare(got, ref, HELD, atol=1e-4, rtol=1e-4)
    assert c.worst("max_abs") <= 1e-4, c.summary()


def test_compensation_beats_none_and_ranking_beats_random():
    def held_cosine(**opts) -> float:
        m = _encoder("attention")
        registry.create("prune-heads", {"ratio": 0.5, **opts})(m, _ctx())
        ref = run(make_session(_encoder("attention"), optimize=False), HELD)
        return compare(run(make_session(m, optimize=False), HELD), ref, HELD).worst("cosine")

    comp, plain = held_cosine(compensate=True), held_cosine(compensate=False)
    assert comp > plain, (comp, plain)
    ranked = held_cosine(compensate=False, importance="ablation")
    randoms = [held_cosine(compensate=False, importance="random", seed=s) for s in range(3)]
    assert ranked >= np.mean(randoms), (ranked, randoms)


def test_budget_search_confirms_on_held_back(tmp_path: Path):
    src = tmp_path / "enc.onnx"
    ir.save(_encoder("mha"), src)
    res = pipeline.optimize(src, OptimizeOptions(passes="prune-heads", budget="cosine>=0.995",
                                                 feeds=CALIB + HELD))
    rec = res.report.passes[-1]
    assert rec.status == "ok" and rec.modified, (rec.status, rec.error, rec.notes)
    assert rec.rule_counts["prune-heads-removed"] >= 1
    assert any(n.startswith("held-back: with compensation") for n in rec.notes)


def test_refusals_leave_the_graph_unchanged():
    causal = _encoder("attention", unidirectional=1)
    before = ir.serde.serialize_model(causal).SerializeToString()
    res = registry.create("prune-heads", {"heads": 1})(causal, _ctx())
    assert not res.modified and "causal" in res.notes[0]
    assert ir.serde.serialize_model(causal).SerializeToString() == before
    other = _encoder("attention", extra_context_use=True)
    res = registry.create("prune-heads", {"heads": 1})(other, _ctx())
    assert not res.modified and "reaches Relu" in res.notes[0], res.notes
    quantized = _encoder("mha")
    q = registry.create("quantize", {"mode": "dynamic", "mixed": False})(quantized, PassContext(
        feeds=HELD, calib_feeds=CALIB, budget=parse_budget("cosine>=0.5")))
    assert q.modified, q.notes
    res = registry.create("prune-heads", {"heads": 1})(quantized, _ctx())
    assert not res.modified and "run prune-heads before quantize" in res.notes[0], res.notes
    from tests.testmodels import make_mlp

    mlp = ir.serde.deserialize_model(make_mlp())
    res = registry.create("prune-heads", {})(mlp, PassContext())
    assert not res.modified and "no attention found" in res.notes[0], res.notes


def test_budget_share_and_the_prune_int8_recipe():
    from graphopt.rewrites.common.budget import share

    half = share(parse_budget("cosine>=0.99,cosine_min>=0.97,max_abs<=0.2"), 0.5)
    assert [round(t.value, 6) for t in half.terms] == [0.995, 0.985, 0.1]
    steps = [p.name for p in recipe.load("prune-int8").build()]
    assert steps == ["cleanup", "fuse", "remove-padding", "prune-heads", "quantize"]


@pytest.mark.parametrize("opts", [{"importance": "gradient"}, {"ratio": 1.0}, {"ratio": 0.2, "heads": 2},
                                  {"min_heads": 0}, {"budget_share": 0.0}])
def test_bad_options(opts):
    with pytest.raises(UsageError):
        registry.create("prune-heads", opts)




@pytest.mark.slow
def test_minilm_fused_and_padding_removed(minilm):
    """MiniLM (TorchScript export): fuse + remove-padding + prune-heads ratio 0.25 (local ranking)."""
    src = minilm("torchscript", "eager")  # built into the cache when missing (a fresh machine has none)
    res = pipeline.optimize(src, OptimizeOptions(
        passes="cleanup,fuse,remove-padding,prune-heads",
        overrides=["prune-heads.ratio=0.25", "prune-heads.importance=local"], budget="cosine>=0.95"))
    rec = res.report.passes[-1]
    assert rec.status == "ok" and rec.rule_counts["prune-heads-removed"] == 18, (rec.status, rec.error, rec.notes)
    assert any("+7 copies" in n for n in rec.notes), rec.notes


def _unfused(shapes: str = "constant") -> ir.Model:
    """Embedding Gather, then per layer MatMul/Softmax/MatMul attention as the exporters write it (Q/K/V
    MatMul + bias Add, head-split Reshape, Transpose, scaled scores + mask, Softmax, head merge) and
    LayerNormalization. ``shapes``: ``constant`` Reshape shapes [0, 0, NH, d] / [0, 0, H] (rewritten by
    the pass), ``computed``: the split shape Concat(Shape(x)[:2], [NH, d]) (refused)."""
    rng = np.random.default_rng(5)
    inits = []
    d = H // NH

    def c(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def w(name, *shape, scale=0.4):
        return c(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    nodes = [
        helper.make_node("Gather", [w("word", VOCAB, H), "input_ids"], ["x0"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", [c("one", np.float32(1)), "maskf"], ["inv"]),
        helper.make_node("Mul", ["inv", c("neg", np.float32(-1e4))], ["bias2"]),
        helper.make_node("Unsqueeze", ["bias2", c("axes12", np.array([1, 2], np.int64))], ["maskbias"]),
        helper.make_node("Shape", ["x0"], ["xshape"]),
        helper.make_node("Slice", ["xshape", c("start0", np.array([0], np.int64)), c("end2", np.array([2], np.int64))],
                         ["bs"]),
        helper.make_node("Concat", ["bs", c("nd", np.array([NH, d], np.int64))], ["split_computed"], axis=0),
    ]
    split = "split_computed" if shapes == "computed" else c("split", np.array([0, 0, NH, d], np.int64))
    merge = c("merge", np.array([0, 0, H], np.int64))
    x = "x0"
    for i in range(LAYERS):
        for p, perm in (("q", (0, 2, 1, 3)), ("k", (0, 2, 3, 1)), ("v", (0, 2, 1, 3))):
            nodes += [helper.make_node("MatMul", [x, w(f"W{p}{i}", H, H)], [f"{p}m{i}"]),
                      helper.make_node("Add", [f"{p}m{i}", w(f"b{p}{i}", H)], [f"{p}a{i}"]),
                      helper.make_node("Reshape", [f"{p}a{i}", split], [f"{p}r{i}"]),
                      helper.make_node("Transpose", [f"{p}r{i}"], [f"{p}{i}"], perm=perm)]
        nodes += [
            helper.make_node("MatMul", [f"q{i}", f"k{i}"], [f"s{i}"]),
            helper.make_node("Mul", [f"s{i}", c(f"scale{i}", np.float32(d ** -0.5))], [f"ss{i}"]),
            helper.make_node("Add", [f"ss{i}", "maskbias"], [f"sm{i}"]),
            helper.make_node("Softmax", [f"sm{i}"], [f"p{i}"], axis=-1),
            helper.make_node("MatMul", [f"p{i}", f"v{i}"], [f"pv{i}"]),
            helper.make_node("Transpose", [f"pv{i}"], [f"pvt{i}"], perm=(0, 2, 1, 3)),
            helper.make_node("Reshape", [f"pvt{i}", merge], [f"ctx{i}"]),
            helper.make_node("MatMul", [f"ctx{i}", w(f"Wo{i}", H, H)], [f"om{i}"]),
            helper.make_node("Add", [f"om{i}", w(f"bo{i}", H)], [f"ob{i}"]),
            helper.make_node("Add", [f"ob{i}", x], [f"res{i}"]),
            helper.make_node("LayerNormalization", [f"res{i}", w(f"g{i}", H), w(f"b{i}", H)], [f"x{i + 1}"],
                             axis=-1, epsilon=1e-5),
        ]
        x = f"x{i + 1}"
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", H])
    graph = helper.make_graph(nodes, "unfused", inputs, [out], initializer=inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                        ir_version=9))


def _zeroed_layers(model: ir.Model, removed: dict[int, list[int]]) -> ir.Model:
    """``model`` with the ``removed`` heads' context zeroed before each layer's output projection."""
    from graphopt.rewrites.prune_heads import layers

    for i, la in enumerate(layers.find_layers(model)):
        mask = np.ones(la.hidden, np.float32)
        for h in removed.get(i, []):
            mask[h * la.head_size:(h + 1) * la.head_size] = 0
        c = ir.Value(name=f"zero_mask{i}", const_value=ir.tensor(mask, name=f"zero_mask{i}"),
                     type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([la.hidden]))
        model.graph.register_initializer(c)
        mul = ir.node("Mul", [la.out_matmul.inputs[0], c])
        model.graph.insert_before(la.out_matmul, mul)
        la.out_matmul.replace_input_with(0, mul.outputs[0])
    return model


def _check_exact(model: ir.Model, fresh: ir.Model, feeds, heads: int) -> dict[int, list[int]]:
    result = registry.create("prune-heads", {"heads": heads, "compensate": False, "importance": "local"})(
        model, PassContext(feeds=feeds, calib_feeds=feeds))
    assert result.modified and result.rule_counts["prune-heads-removed"] == heads, result.notes
    removed = _removed(result.notes)
    ref = run(make_session(_zeroed_layers(fresh, removed), optimize=False), feeds)
    got = run(make_session(model, optimize=False), feeds)
    c = compare(got, ref, feeds, atol=1e-4, rtol=1e-4)
    assert c.worst("max_abs") <= 1e-4, c.summary()
    return removed


def test_unfused_removed_heads_equal_zeroed_context():
    """Unfused attention: Q/K/V MatMuls, biases and W_o sliced, constant [0, 0, NH, d] / [0, 0, H] shapes
    rewritten; equal to the input with those heads' context zeroed."""
    model = _unfused()
    removed = _check_exact(model, _unfused(), HELD, 3)
    shapes = [ir.convenience.get_const_tensor(n.inputs[1]).numpy().tolist() for n in model.graph
              if n.op_type == "Reshape"]
    d = H // NH
    assert {tuple(s) for s in shapes} == {(0, 0, NH - len(removed.get(i, [])), d) for i in range(LAYERS)} | {
        (0, 0, (NH - len(removed.get(i, []))) * d) for i in range(LAYERS)}


def test_unfused_computed_head_count_is_refused():
    model = _unfused("computed")
    before = ir.serde.serialize_model(model).SerializeToString()
    res = registry.create("prune-heads", {"heads": 1})(model, _ctx())
    assert not res.modified and "computes its shape with the head count 4" in res.notes[0], res.notes
    assert ir.serde.serialize_model(model).SerializeToString() == before


def _minilm_feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        m = (np.arange(16)[None, :] < rng.integers(5, 16, 3)[:, None]).astype(np.int64)
        out.append({"input_ids": rng.integers(1000, 20000, (3, 16)).astype(np.int64) * m, "attention_mask": m,
                    "token_type_ids": np.zeros((3, 16), np.int64)})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("export", ["dynamo-sdpa", "dynamo-eager", "torchscript-sdpa", "torchscript-eager"])
def test_minilm_unfused_exports_exact(export, minilm):
    """Every MiniLM export, unfused: 9 heads removed == the export with their context zeroed."""
    src = minilm(*export.split("-"))
    _check_exact(ir.load(src), ir.load(src), _minilm_feeds(), 9)


def test_iterative_reranking():
    """iterative=N: the first round is the ablation ranking (same first head without compensation); later
    rounds re-rank on top of the chosen heads and keep min_heads per layer."""
    def removed(**opts) -> dict[int, list[int]]:
        res = registry.create("prune-heads", {"compensate": False, **opts})(_encoder("attention"), _ctx())
        assert res.modified, res.notes
        return _removed(res.notes)

    assert removed(heads=1, iterative=1) == removed(heads=1)
    most = removed(heads=2 * (NH - 1), iterative=2)
    assert {i: len(h) for i, h in most.items()} == {i: NH - 1 for i in range(LAYERS)}
    with pytest.raises(UsageError):
        registry.create("prune-heads", {"iterative": 2, "importance": "local"})

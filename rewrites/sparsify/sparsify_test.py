"""sparsify: every pattern on the seeded tiny BERT (unfused, fused, packed), refusals, the budget on MiniLM."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import tiny_bert_feeds

from graphopt.data.metrics import compare, parse_budget
from graphopt.engine.registry import PassContext
from graphopt.errors import UsageError
from graphopt.rewrites.common import bounds
from graphopt.rewrites.common import ffn as _ffn
from graphopt.rewrites.sparsify import SparsifyPass
from graphopt.rewrites.sparsify.weights import lstsq_columns, nm_mask, sparsegpt
from graphopt.runtime import custom_ops, standins
from graphopt.runtime import session as runtime


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("torch", reason="torch is needed to export the tiny models")
    from conftest import load_models_module

    path = load_models_module("tiny").build("bert", "feature-extraction", exporter="dynamo")
    return path, tiny_bert_feeds(path)


def _ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


def _run(model, feeds):
    return runtime.run(runtime.make_session(standins.cpu_runnable(model)[0], threads=1), feeds)


def _call(path, feeds, budget=None, **opts):
    model = ir.load(path)
    ctx = PassContext(calib_feeds=feeds[:3], feeds=feeds[3:], budget=parse_budget(budget) if budget else None)
    return SparsifyPass(**opts)(model, ctx)


def test_finds_ffns_unfused_and_fused(tiny):
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    path, feeds = tiny
    ffns = _ffn.find(ir.load(path))
    assert [f.act.op_type for f in ffns] == ["Gelu", "Gelu"] and all(f.add1 is not None for f in ffns)
    fused = pipeline.optimize(str(path), OptimizeOptions(passes="cleanup,fuse", feeds=feeds)).model
    ffns = _ffn.find(fused)
    assert [f.act.op_type for f in ffns] == ["BiasGelu", "BiasGelu"] and all(f.add1 is None for f in ffns)
    assert all(f.w1.shape == (64, 128) and f.w2.shape == (128, 64) and f.b1.shape == (128,) for f in ffns)


@pytest.mark.parametrize(("pattern", "sparsity", "op", "count"), [
    ("neurons", 0.5, "MatMul", None), ("blocks", 0.75, "BlockSparseMatMul", 4), ("2:4", 0.5, "NMSparseMatMul", 4),
    ("unstructured", 0.5, "MatMul", None)])
def test_explicit_pattern_does_what_it_is_told(tiny, pattern, sparsity, op, count):
    path, feeds = tiny
    before = ir.load(path)
    res = _call(path, feeds, pattern=pattern, sparsity=sparsity, block_size=16)
    assert res.modified and res.budget_met is None and res.rule_counts == {pattern: 2}
    ops = _ops(res.model)
    if count:
        assert ops[op] == count and ops["MatMul"] == _ops(before)["MatMul"] - 4, ops
        assert res.model.opset_imports[custom_ops.DOMAIN] == 1
        assert {f.name for f in res.model.functions.values()} == {op}
    ffns = _ffn.find(res.model)
    if pattern == "neurons":  # two plain, narrower MatMuls per FFN
        assert [f.width for f in ffns] == [64, 64] and all(f.b1.shape == (64,) for f in ffns)
    if pattern == "unstructured":
        assert all(abs(float((f.w1 == 0).mean()) - 0.5) < 0.01 for f in ffns)
    # the cost it reports is what the model does on the held-back feeds
    held = feeds[3:]
    got = compare(_run(res.model, held), _run(before, held), held)
    assert f"held-back cosine {got.worst('cosine'):.4f}" in " ".join(res.notes)


def test_blocks_keep_the_original_weights_without_compensation(tiny):
    path, feeds = tiny
    w = _ffn.find(ir.load(path))[0].w1
    res = _call(path, feeds, pattern="blocks", sparsity=0.75, block_size=16, compensate=False)
    node = next(n for n in res.model.graph if n.op_type == "BlockSparseMatMul")
    wb, idx = node.inputs[1].const_value.numpy(), node.inputs[2].const_value.numpy()
    assert idx.shape == (8, 1) and wb.shape == (8, 16, 16)  # W1 64x128: 8 output block columns keep 1 of 4
    for j in range(8):
        k = idx[j, 0]
        np.testing.assert_array_equal(wb[j], w[k * 16:(k + 1) * 16, j * 16:(j + 1) * 16])


def test_rectangular_blocks(tiny):
    """block_cols: 16x32 blocks (fewer, wider GEMMs); exact against the pruned dense weights, compensated."""
    path, feeds = tiny
    res = _call(path, feeds, pattern="blocks", sparsity=0.75, block_size=16, block_cols=32)
    nodes = [n for n in res.model.graph if n.op_type == "BlockSparseMatMul"]
    assert len(nodes) == 2 * len(_ffn.find(ir.load(path)))
    wb, idx = nodes[0].inputs[1].const_value.numpy(), nodes[0].inputs[2].const_value.numpy()
    assert idx.shape == (4, 1) and wb.shape == (4, 16, 32)  # W1 64x128: 4 output block columns keep 1 of 4
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    dense = np.zeros((64, 128), np.float32)
    for j in range(4):
        dense[idx[j, 0] * 16:(idx[j, 0] + 1) * 16, j * 32:(j + 1) * 32] = wb[j]
    y = ir.Value(name="y", shape=ir.Shape([5, 128]), type=ir.TensorType(ir.DataType.FLOAT))
    xv = ir.Value(name="x", shape=ir.Shape([5, 64]), type=ir.TensorType(ir.DataType.FLOAT))
    consts = [ir.Value(name=v.name, const_value=v.const_value) for v in nodes[0].inputs[1:]]
    node = ir.Node(custom_ops.DOMAIN, "BlockSparseMatMul", [xv, *consts], attributes=[ir.AttrInt64("block_size", 16)],
                   outputs=[y])
    m = ir.Model(ir.Graph([xv], [y], nodes=[node], initializers=consts, opset_imports={"": 17}), ir_version=10)
    custom_ops.attach(m)
    np.testing.assert_allclose(runtime.make_session(m).run(None, {"x": x})[0], x @ dense, rtol=1e-5, atol=1e-5)


def test_compensation_recovers_quality(tiny):
    path, feeds = tiny
    cos = {}
    for comp in (False, True):
        res = _call(path, feeds, pattern="neurons", sparsity=0.5, compensate=comp)
        cos[comp] = compare(_run(res.model, feeds[3:]), _run(ir.load(path), feeds[3:]), feeds[3:]).worst("cosine")
    assert cos[True] > cos[False]


def test_compensation_keeps_the_mask_and_lowers_the_error():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32)) @ rng.standard_normal((32, 32))  # correlated inputs
    w = rng.standard_normal((32, 16)).astype(np.float32)
    keep = nm_mask(w, x.T @ x, "wanda")
    assert keep.sum() == w.size // 2
    plain = np.linalg.norm(x @ (w * keep) - x @ w)
    seq = sparsegpt(w, keep, x.T @ x, 0.01)
    exact = lstsq_columns(w, keep, x.T @ x, 0.01)
    assert np.all(seq[~keep] == 0) and np.all(exact[~keep] == 0)
    assert np.linalg.norm(x @ seq - x @ w) < 0.95 * plain
    assert np.linalg.norm(x @ exact - x @ w) < 0.7 * plain
    # exact: the residual of every column is orthogonal to its kept inputs (the normal equations)
    for c in range(w.shape[1]):
        s = np.flatnonzero(keep[:, c])
        r = x @ exact[:, c].astype(np.float64) - x @ w[:, c]
        assert np.abs(x[:, s].T @ r).max() < 1e-2 * np.abs(x[:, s].T @ (x @ w[:, c])).max()


def test_budget_holds_on_held_back_feeds_or_declines(tiny):
    path, feeds = tiny
    res = _call(path, feeds, budget="cosine>=0.999")
    held = feeds[3:]
    if res.modified:
        assert res.budget_met is True
        got = compare(_run(res.model, held), _run(ir.load(path), held), held)
        assert got.worst("cosine") >= 0.999
    else:
        assert res.budget_met is False and any(n.startswith("declined") for n in res.notes)
    assert any("measured (pattern" in n for n in res.notes)


def test_declines_when_nothing_fits(tiny):
    path, feeds = tiny
    res = _call(path, feeds, budget="max_abs<=1e-6", pattern="blocks", block_size=16)
    assert not res.modified and res.budget_met is False
    assert any(n.startswith("declined") for n in res.notes) and any("fails on calib" in n for n in res.notes)
    assert _ops(res.model) == _ops(ir.load(path))


def test_explicit_sparsity_that_breaks_a_given_budget_keeps_the_model(tiny):
    path, feeds = tiny
    res = _call(path, feeds, budget="cosine>=0.99999", pattern="neurons", sparsity=0.75)
    assert not res.modified and res.budget_met is False and any("not met" in n for n in res.notes)


def test_cosine_lower_bound_per_sentence():
    """The bound's mean is metrics' mean (padded and packed); it lies below it, by more for fewer sentences."""
    rng = np.random.default_rng(0)
    feeds, got, ref = [], [], []
    for _ in range(3):
        mask = (np.arange(10)[None] < rng.integers(2, 11, 8)[:, None]).astype(np.int64)
        r = rng.standard_normal((8, 10, 16))
        noise = rng.uniform(0.1, 0.6, (8, 1, 1)) * rng.standard_normal(r.shape)  # rows differ: a spread
        feeds.append({"attention_mask": mask})
        got.append({"h": r + noise})
        ref.append({"h": r})
    mean = compare(got, ref, feeds).worst("cosine")
    assert bounds.cosine_lower_bound(got, ref, feeds, 0.0)["h"] == pytest.approx(mean, abs=1e-12)
    packed = [{"h": g["h"][f["attention_mask"].astype(bool)]} for g, f in zip(got, feeds)]
    assert bounds.cosine_lower_bound(packed, ref, feeds, 0.0)["h"] == pytest.approx(mean, abs=1e-12)
    lb3 = bounds.cosine_lower_bound(got, ref, feeds, 0.95)["h"]
    lb1 = bounds.cosine_lower_bound(got[:1], ref[:1], feeds[:1], 0.95)["h"]
    assert lb3 < mean and mean - lb1 > mean - lb3 > 0.002
    assert bounds.bounded(compare(got, ref, feeds), got, ref, feeds, 0.95).worst("cosine") == pytest.approx(lb3)


def test_budget_needs_the_lower_bound(tiny):
    """A budget between the held-back lower bound and the plain mean: met only with confidence=0."""
    path, feeds = tiny
    res = _call(path, feeds, pattern="neurons", sparsity=0.75, compensate=False, scores="magnitude")
    held = feeds[3:]
    got, ref = _run(res.model, held), _run(ir.load(path), held)
    mean = compare(got, ref, held).worst("cosine")
    lb = min(bounds.cosine_lower_bound(got, ref, held, 0.95).values())
    assert lb < mean and re.search(rf"cosine {mean:.4f} \(lb {lb:.4f}\)", " ".join(res.notes))
    budget = f"cosine>={(mean + lb) / 2:.9f}"
    res = _call(path, feeds, budget=budget, pattern="neurons", sparsity=0.75, compensate=False, scores="magnitude")
    assert not res.modified and res.budget_met is False
    res = _call(path, feeds, budget=budget, pattern="neurons", sparsity=0.75, compensate=False, scores="magnitude", confidence=0.0)
    assert res.modified and res.budget_met is True


def test_refusals(tiny, mlp_path):
    path, feeds = tiny
    res = SparsifyPass()(ir.load(mlp_path), PassContext())
    assert not res.modified and res.notes[0].startswith("not applied: no FFN")
    res = _call(path, feeds, pattern="blocks", block_size=128)
    assert not res.modified and "blocks 128x128" in res.notes[-1]
    for bad in ({"pattern": "diag"}, {"sparsity": 0.5}, {"pattern": "2:4", "sparsity": 0.75}, {"block_size": 12},
                {"scores": "random"}, {"block_cols": 6},
                {"confidence": 1.0}):
        with pytest.raises(UsageError):
            SparsifyPass(**bad)


def test_through_the_pipeline_after_remove_padding(tiny):
    """Packed tokens ([N, H]): the FFNs are found after remove-padding and rewritten; stock ORT runs it."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    path, feeds = tiny
    result = pipeline.optimize(str(path), OptimizeOptions(
        passes="cleanup,fuse,remove-padding,sparsify", feeds=feeds,
        overrides=["sparsify.pattern=blocks", "sparsify.sparsity=0.5", "sparsify.block_size=16"],
        budget="cosine>=0.9"))
    rec = result.report.passes[-1]
    assert result.ok and rec.modified, rec.error
    assert result.report.passes[-2].name == "remove-padding" and result.report.passes[-2].modified
    probe = result.model.clone()
    probe.graph.outputs.append(next(n for n in probe.graph if n.op_type == "BlockSparseMatMul").inputs[0])
    x = _run(probe, feeds[:1])[0][probe.graph.outputs[-1].name]
    assert x.size <= (feeds[0]["attention_mask"].sum() + 1) * 64  # packed: rows are tokens, not the padded 4 x 16
    assert rec.rule_counts == {"blocks": 2}
    assert _ops(result.model)["BlockSparseMatMul"] == 4


@pytest.mark.slow
def test_minilm_budget_holds_on_held_back_data(minilm):
    """MiniLM (fused): under cosine>=0.99 the chosen model (or the declined input) meets it on held-back feeds."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    path = minilm("dynamo", "eager")
    feeds = tiny_bert_feeds(path, n=4, seed=1)
    result = pipeline.optimize(str(path), OptimizeOptions(passes="cleanup,fuse,sparsify", feeds=feeds,
                                                          budget="cosine>=0.99", keep_going=True,
                                                          overrides=["sparsify.pattern=neurons"]))
    rec = result.report.passes[-1]
    assert rec.status in ("ok", "budget-not-met"), rec.error
    if rec.modified and rec.status == "ok":
        assert rec.verification["cosine"] >= 0.99


@pytest.mark.parametrize("name", ["sparse", "sparse-int8"])
def test_sparse_recipes_end_to_end(tiny, name, run_cli):
    """The builtin sparse recipes run on the tiny BERT under a budget; the result meets it and runs in stock ORT."""
    from graphopt.engine import pipeline, recipe
    from graphopt.engine.options import OptimizeOptions

    path, feeds = tiny
    result = pipeline.optimize(str(path), OptimizeOptions(recipe=recipe.load(name), feeds=feeds,
                                                          budget="cosine>=0.95", keep_going=True))
    recs = {r.name: r for r in result.report.passes}
    assert list(recs) == recipe.load(name).pass_names()
    assert recs["sparsify"].status == "ok" and recs["sparsify"].modified, recs["sparsify"].notes
    counts = recs["sparsify"].rule_counts
    assert set(counts) <= {"neurons", "blocks"} and sum(counts.values()) == 2  # both FFNs, a faster form
    if name == "sparse-int8":
        assert counts == {"neurons": 2}
        assert any(n.startswith("budget_share 0.5: searching under cosine>=0.975") for n in recs["sparsify"].notes)
        assert recs["quantize"].status in ("ok", "budget-not-met")
    held = feeds[3:]
    got = compare(runtime.run(runtime.make_session(result.model), held), _run(ir.load(path), held), held)
    assert got.worst("cosine") >= 0.95
    code, out, _ = run_cli("passes")
    assert code == 0 and name in out


def _erf_ffn_model(gelu: str, seed: int = 0) -> ir.Model:
    """x[B, S, 16] → MatMul W1[16, 32] → Add b1 → GELU → MatMul W2[32, 16] → + x. ``gelu``: ``op`` (one Gelu, opset
    20), ``erf`` (TorchScript's ``(z * (1 + Erf(z / √2))) * 0.5``, Constant nodes) or ``erf-half-first``
    (``(z * 0.5) * (1 + Erf(z * (1/√2)))``)."""
    import onnx
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    inits = [nh.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1"),
             nh.from_array(rng.standard_normal(32).astype(np.float32), "b1"),
             nh.from_array(rng.standard_normal((32, 16)).astype(np.float32) / 4, "w2")]

    def c(name: str, v: float):
        return h.make_node("Constant", [], [name], value=nh.from_array(np.array(v, np.float32)))

    nodes = [h.make_node("MatMul", ["x", "w1"], ["m"]), h.make_node("Add", ["b1", "m"], ["z"])]
    if gelu == "op":
        nodes.append(h.make_node("Gelu", ["z"], ["a"]))
    elif gelu == "erf":
        nodes += [c("sq2", 2 ** 0.5), h.make_node("Div", ["z", "sq2"], ["d"]), h.make_node("Erf", ["d"], ["e"]),
                  c("one", 1.0), h.make_node("Add", ["e", "one"], ["p"]), h.make_node("Mul", ["z", "p"], ["q"]),
                  c("half", 0.5), h.make_node("Mul", ["q", "half"], ["a"])]
    else:
        nodes += [c("isq2", 2 ** -0.5), h.make_node("Mul", ["isq2", "z"], ["d"]), h.make_node("Erf", ["d"], ["e"]),
                  c("one", 1.0), h.make_node("Add", ["one", "e"], ["p"]), c("half", 0.5),
                  h.make_node("Mul", ["z", "half"], ["q"]), h.make_node("Mul", ["p", "q"], ["a"])]
    nodes += [h.make_node("MatMul", ["a", "w2"], ["f"]), h.make_node("Add", ["f", "x"], ["y"])]  # + residual
    graph = h.make_graph(nodes, "ffn", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", "S", 16])],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", "S", 16])], initializer=inits)
    return ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=9))


def _x_feeds(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((2, 3, 16)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("gelu", ["erf", "erf-half-first"])
def test_erf_gelu_ffn_found_and_sparsified(gelu):
    """GELU written out with Erf (TorchScript): the FFN is found (5 activation nodes), and sparsify/
    contextual-sparsity rewrite it exactly as they rewrite the same FFN with one Gelu op."""
    from graphopt.rewrites.contextual_sparsity import ContextualSparsityPass

    ffns = _ffn.find(_erf_ffn_model(gelu))
    assert len(ffns) == 1 and ffns[0].add1 is not None and ffns[0].b1.shape == (32,)
    assert sorted(n.op_type for n in ffns[0].act_nodes) == sorted(["Add", "Div" if gelu == "erf" else "Mul", "Erf",
                                                                    "Mul", "Mul"])
    feeds = _x_feeds(4)
    ctx = PassContext(calib_feeds=feeds[:2], feeds=feeds[2:])
    for make in (lambda: SparsifyPass(pattern="neurons", sparsity=0.5, compensate=False),
                 lambda: SparsifyPass(pattern="blocks", sparsity=0.5, block_size=8, compensate=False),
                 lambda: ContextualSparsityPass(keep=0.25, rank=8)):
        outs = []
        for form in (gelu, "op"):
            res = make()(_erf_ffn_model(form), ctx)
            assert res.modified, res.notes
            outs.append(_run(res.model, feeds)[0]["y"])
            if form != "op":
                assert _ops(res.model)["Erf"] == 1
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    # the dense FFN itself still equals numpy's GELU FFN (the chain is a GELU)
    m = _erf_ffn_model(gelu)
    w = {v.name: v.const_value.numpy() for v in m.graph.initializers.values()}
    want = _ffn.gelu(feeds[0]["x"] @ w["w1"] + w["b1"]) @ w["w2"] + feeds[0]["x"]
    np.testing.assert_allclose(_run(m, feeds[:1])[0]["y"], want, rtol=1e-4, atol=1e-4)


def test_erf_chain_read_elsewhere_is_not_an_ffn():
    """The pre-activation also read outside the chain: not an FFN (nothing else may see it)."""
    m = _erf_ffn_model("erf")
    z = next(n for n in m.graph if n.op_type == "Add").outputs[0]
    extra = ir.Node("", "Identity", [z], name="tap")
    m.graph.append(extra)
    m.graph.outputs.append(extra.outputs[0])
    extra.outputs[0].name = "tap"
    assert _ffn.find(m) == []
    assert _ffn.find(_erf_ffn_model("erf")) != []


@pytest.mark.slow
def test_minilm_torchscript_erf_gelu(minilm):
    """The unfused TorchScript MiniLM (GELU as Div/Erf/Add/Mul/Mul): 6 FFNs found; sparsify and
    contextual-sparsity rewrite all of them and the results run in stock ORT."""
    from graphopt.rewrites.contextual_sparsity import ContextualSparsityPass

    path = minilm("torchscript", "eager")
    model = ir.load(path)
    ffns = _ffn.find(model)
    assert len(ffns) == 6 and all(len(f.act_nodes) == 5 and f.w1.shape == (384, 1536) for f in ffns)
    feeds = tiny_bert_feeds(path, n=4, seed=2)
    ctx = PassContext(calib_feeds=feeds[:2], feeds=feeds[2:])
    ref = _run(model, feeds[2:])
    res = SparsifyPass(pattern="neurons", sparsity=0.25, compensate=False)(ir.load(path), ctx)
    assert res.modified and res.rule_counts == {"neurons": 6}
    assert [f.w1.shape for f in _ffn.find(res.model)] == [(384, 1152)] * 6
    got = compare(runtime.run(runtime.make_session(res.model), feeds[2:]), ref, feeds[2:])
    assert f"held-back cosine {got.worst('cosine'):.4f}" in " ".join(res.notes) and got.worst("cosine") > 0.5
    res = ContextualSparsityPass(keep=0.5)(ir.load(path), ctx)
    assert res.modified and res.rule_counts == {"ffn": 6} and _ops(res.model)["Erf"] == 6
    got = compare(runtime.run(runtime.make_session(res.model), feeds[2:]), ref, feeds[2:])
    assert got.worst("cosine") > 0.9

"""Tests of ``decode-sparsity`` on the tiny llama: exact when every group is kept, dense prefill, the budget
met or declined, the speed decline, 4-bit projections cut exactly, refusals."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.data.metrics import parse_budget
from graphopt.engine.registry import PassContext, create
from graphopt.errors import UsageError
from graphopt.generate import quality
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import open_decoder
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common import gated_ffn
from graphopt.rewrites.decode_sparsity import build, groups
from graphopt.runtime.session import make_session


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _grouped(model: ir.Model, k: int, *, simulate: bool = False, n_groups: int = 8) -> ir.Model:
    cand = model.clone()
    rng = np.random.default_rng(0)
    for f in gated_ffn.find(cand):
        units = f.width // f.down.unit
        perm = rng.permutation(units)
        gs = [np.sort((np.sort(perm[g::n_groups])[:, None] * f.down.unit + np.arange(f.down.unit)).reshape(-1))
              for g in range(n_groups)]
        router = (rng.standard_normal((f.hidden, n_groups)).astype(np.float32), np.zeros(n_groups, np.float32))
        build.rewrite(cand, f, gs, router, k, simulate=simulate)
    return cand


def _logits(sess, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(prefill logits of all but the last token, the decode step's logits of the last token)."""
    dec = open_decoder(sess, threads=1)
    n = len(ids)
    cache = KVCache(dec.sig, 1, n)
    a = np.asarray(ids, np.int64)[None]
    pre = dec.step(cache, a[:, :-1], np.ones((1, n - 1), np.int64), np.arange(n - 1)[None], all_positions=True)
    last = dec.step(cache, a[:, -1:], np.ones((1, n), np.int64), np.array([[n - 1]]))
    return pre, last


def test_finds_the_gated_ffns_and_their_weights(tiny_llama):
    model = io.load(tiny_llama)
    ffns = gated_ffn.find(model)
    assert len(ffns) == 2 and all(f.gate.kind == f.down.kind == "matmul" and f.width == 128 for f in ffns)
    f = ffns[0]
    assert f.down.dense().shape == (128, 64) and f.gate.cut(cols=np.array([1, 5])).dense().shape == (64, 2)


@pytest.mark.parametrize("simulate", [False, True])
def test_every_group_kept_is_exact(tiny_llama, simulate):
    model = io.load(tiny_llama)
    cand = _grouped(model, 8, simulate=simulate)
    ops = _ops(cand)
    assert ops["If" if not simulate else "TopK"] == (16 if not simulate else 2)
    assert ops["Sigmoid"] == (0 if not simulate else 16)  # the groups' FFNs live in the If branches
    if not simulate:
        # per group: gate and up as one projection and a Split; one down projection per FFN, outside
        ifs = [n for n in cand.graph if n.op_type == "If"]
        assert {tuple(b.op_type for b in n.attributes["then_branch"].value) for n in ifs} == {
            ("MatMul", "Split", "Sigmoid", "Mul", "Mul")}
        assert ops["Concat"] - _ops(model)["Concat"] == 2
    ids = [5, 17, 300, 42, 8, 999, 3, 250]
    ref, got = _logits(make_session(model), ids), _logits(make_session(cand), ids)
    np.testing.assert_allclose(got[0], ref[0], atol=2e-5)
    np.testing.assert_allclose(got[1], ref[1], atol=2e-5)


def test_prefill_is_dense_and_decode_is_sparse(tiny_llama):
    model = io.load(tiny_llama)
    ids = [5, 17, 300, 42, 8, 999, 3, 250]
    ref, got = _logits(make_session(model), ids), _logits(make_session(_grouped(model, 2)), ids)
    np.testing.assert_allclose(got[0], ref[0], atol=2e-5)  # prefill: every group runs
    assert np.abs(got[1] - ref[1]).max() > 1e-3  # a one-token step runs 2 of 8 groups
    # the simulation form masks every position to its own groups: a token gets the same logits whether it
    # comes in one forward with the others or as a decode step after them (a prompt run sparse too, so
    # its perplexity is the bound of sparse decoding from the first token)
    sim = _logits(make_session(_grouped(model, 2, simulate=True)), ids)
    dec = open_decoder(make_session(_grouped(model, 2, simulate=True)), threads=1)
    cache = KVCache(dec.sig, 1, len(ids))
    whole = dec.step(cache, np.asarray(ids)[None], np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None],
                     all_positions=True)[0, -1]
    np.testing.assert_allclose(whole, sim[1][0], atol=2e-4)


def test_4bit_projections_cut_in_whole_blocks_exactly():
    rng = np.random.default_rng(0)
    k, n, bs = 128, 48, 32
    q = rng.integers(0, 256, (n, k // bs, bs // 2), dtype=np.uint8)
    p = gated_ffn.Projection("nbits+mins", None, None, (), k, n, bs, 1, q=q,
                             scales=rng.random((n, k // bs), dtype=np.float32) * 0.1,
                             zp=np.zeros((n, k // bs), np.uint8), mins=rng.standard_normal((k // bs, n)).astype(
                                 np.float32) * 0.1)
    rows, cols = np.arange(32, 96), np.array([0, 3, 4, 40, 47])
    cut = p.cut(cols=cols, rows=rows)
    np.testing.assert_array_equal(cut.dense(), p.dense()[rows][:, cols])
    with pytest.raises(ValueError, match="whole blocks"):
        p.cut(rows=np.arange(8, 40))
    x = ir.Value(name="x", shape=ir.Shape([1, 1, 64]), type=ir.TensorType(ir.DataType.FLOAT))
    g = ir.Graph([x], [], nodes=[], opset_imports={"": 21, MS_DOMAIN: 1})
    nodes, y = cut.emit(x, g, "p")
    g.extend(nodes)
    y.name, y.type = "y", ir.TensorType(ir.DataType.FLOAT)
    g.outputs.append(y)
    assert [nd.op_type for nd in nodes] == ["MatMulNBits", "Reshape", "ReduceSum", "MatMul", "Add"]
    xv = rng.standard_normal((1, 1, 64)).astype(np.float32)
    got = make_session(ir.Model(g, ir_version=10)).run(None, {"x": xv})[0]
    np.testing.assert_allclose(got, xv @ cut.dense(), rtol=1e-4, atol=1e-4)


def test_balanced_groups_and_router_recall():
    rng = np.random.default_rng(0)
    # 32 units in 4 planted groups: each token activates one group
    who = rng.integers(0, 4, 400)
    prof = (np.repeat(np.arange(4), 8)[:, None] == who[None, :]) * rng.random((32, 400)) + 0.01
    gs = groups.balanced_clusters(prof, 4)
    assert sorted(len(g) for g in gs) == [8] * 4
    assert sorted(tuple(g) for g in gs) == [tuple(range(i * 8, i * 8 + 8)) for i in range(4)]


def test_explicit_keep_within_budget(tiny_llama):
    model = io.load(tiny_llama)
    p = create("decode-sparsity", {"keep": 0.5, "min_speedup": 0, "steps": 2})
    res = p(model, PassContext(budget=parse_budget("ppl_ratio<=1.5")))
    assert res.modified and res.budget_met is True
    assert res.budget_outcome.measured["ppl_ratio"] <= 1.5
    assert any("held ppl_ratio" in n and "greedy" in n for n in res.notes)
    assert _ops(model)["If"] == 16 and _ops(model)["TopK"] == 2
    make_session(model)


def test_searched_keep_honours_the_budget(tiny_llama):
    model = io.load(tiny_llama)
    check = quality.decoder_check(make_session(model))
    res = create("decode-sparsity", {"min_speedup": 0, "steps": 2})(
        model, PassContext(budget=parse_budget("ppl_ratio<=1.2"), decoder=check))
    assert res.budget_met is True and res.modified
    got = quality.DecoderCheck.of(make_session(model), check.rows)  # decode-only sparsity: prefill exact
    assert got.ref_ppl == pytest.approx(check.ref_ppl, rel=1e-4)
    assert res.budget_outcome.measured["ppl_ratio"] <= 1.2
    assert any("measured (rung" in n for n in res.notes)


def test_declines_an_unreachable_budget(tiny_llama):
    model = io.load(tiny_llama)
    # a random tiny model barely notices its FFNs: make them dominate the residual stream
    for f in gated_ffn.find(model):
        w = f.down.nodes[0].inputs[1]
        w.const_value = ir.tensor(w.const_value.numpy() * 40.0, name=w.name)
    before = _ops(model)
    res = create("decode-sparsity", {"keep": 0.125, "min_speedup": 0, "steps": 2})(
        model, PassContext(budget=parse_budget("ppl_ratio<=1.001,greedy_match>=1")))
    assert res.modified is False and res.budget_met is False and _ops(model) == before
    assert any("not met" in n for n in res.notes)


def test_declines_where_it_does_not_pay(tiny_llama):
    model = io.load(tiny_llama)
    before = _ops(model)
    res = create("decode-sparsity", {"min_speedup": 50, "steps": 2})(
        model, PassContext(budget=parse_budget("ppl_ratio<=1.5")))
    assert res.modified is False and res.budget_met is False and _ops(model) == before
    assert any("decode step, batch 1" in n for n in res.notes)
    assert any("declined: no keep level decodes >= 50x" in n for n in res.notes)


def test_refusals():
    with pytest.raises(UsageError, match="groups"):
        create("decode-sparsity", {"groups": 1})
    with pytest.raises(UsageError, match="keep"):
        create("decode-sparsity", {"keep": 1.0})


def test_a_model_without_gated_ffn_is_not_applied():
    pytest.importorskip("torch", reason="torch is needed to export the tiny gpt2")
    model = io.load(load_models_module("tiny").build("gpt2", "causal-lm-with-past"))
    res = create("decode-sparsity")(model, PassContext(budget=parse_budget("ppl_ratio<=1.03")))
    assert res.modified is False and any("no gated FFN" in n for n in res.notes)


def test_refuses_a_budget_without_decoder_terms(tiny_llama):
    with pytest.raises(UsageError, match="decoder metrics only"):
        create("decode-sparsity")(io.load(tiny_llama), PassContext(budget=parse_budget("cosine>=0.99")))


def test_oracle_simulation_runs_and_keeps_everything_exactly(tiny_llama):
    from graphopt.rewrites import decode_sparsity as ds

    model = io.load(tiny_llama)
    cal = ds.calibrate(model, [list(range(3, 67)), list(range(70, 134))], 8)
    assert all(c is not None and len(c.groups) == 8 for c in cal)
    ids = [5, 17, 300, 42, 8, 999, 3, 250]
    ref = _logits(make_session(model), ids)
    every = _logits(make_session(ds.sparse_model(model, cal, [8, 8], simulate=True, oracle=True,
                                                 grouped_dense=True)), ids)
    np.testing.assert_allclose(every[1], ref[1], atol=2e-5)
    some = _logits(make_session(ds.sparse_model(model, cal, [2, 2], simulate=True, oracle=True)), ids)
    assert np.abs(some[1] - ref[1]).max() > 1e-4
    # the oracle's groups lose less of the FFN output than the router's on its calibration tokens
    assert all(c.local(2, oracle=True)[0] <= c.local(2)[0] + 1e-6 for c in cal)


def test_int4_sparse_recipe_on_the_tiny_llama(run_cli, tiny_llama, tmp_path):
    """The recipe end to end: 4-bit blocks, then groups of whole blocks, then merged projections (exit 0)."""
    from graphopt.engine import recipe

    steps = [s.pass_name for s in recipe.load("int4-sparse").steps]
    assert steps.index("quantize-int4") < steps.index("decode-sparsity") < steps.index("merge-projections")
    out = tmp_path / "s.onnx"
    code, _, err = run_cli("optimize", tiny_llama, "-o", out, "--recipe", "int4-sparse",
                           "--set", "quantize-int4.block_sizes=32", "--set", "quantize-int4.accuracy_levels=1",
                           "--set", "quantize-int4.steps=2", "--set", "decode-sparsity.groups=4",
                           "--set", "decode-sparsity.min_speedup=0", "--set", "decode-sparsity.steps=2",
                           "--budget", "ppl_ratio<=1.5")
    assert code == 0, err
    ops = _ops(io.load(out))
    assert ops["If"] == 8 and ops["TopK"] == 2

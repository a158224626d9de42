"""contextual-sparsity on the seeded tiny BERT: the predictor, the rewritten FFN, the budget, refusals."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import tiny_bert_feeds

from graphopt.data.metrics import compare, parse_budget
from graphopt.engine.registry import PassContext
from graphopt.errors import UsageError
from graphopt.rewrites.common import ffn as _ffn
from graphopt.rewrites.contextual_sparsity import ContextualSparsityPass, fit_predictor, recall, topk_rows
from graphopt.runtime import session as runtime
from graphopt.runtime import standins


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("torch", reason="torch is needed to export the tiny models")
    from conftest import load_models_module

    path = load_models_module("tiny").build("bert", "feature-extraction", exporter="dynamo")
    return path, tiny_bert_feeds(path)


def _run(model, feeds):
    return runtime.run(runtime.make_session(standins.cpu_runnable(model)[0], threads=1), feeds)


def _call(path, feeds, budget=None, **opts):
    ctx = PassContext(calib_feeds=feeds[:3], feeds=feeds[3:], budget=parse_budget(budget) if budget else None)
    return ContextualSparsityPass(**opts)(ir.load(path), ctx)


def test_predictor_is_the_best_low_rank_fit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 16))
    w = rng.standard_normal((16, 40))
    u, v = fit_predictor(w, x.T @ x, rank=16, damp=1e-9)  # full rank: exact
    np.testing.assert_allclose(x @ u @ v, x @ w, atol=1e-3)
    u4, v4 = fit_predictor(w, x.T @ x, rank=4)
    err4 = np.linalg.norm(x @ u4 @ v4 - x @ w)
    uw, sw, vw = np.linalg.svd(w, full_matrices=False)  # the plain SVD ignores the input statistics
    assert err4 <= np.linalg.norm(x @ (uw[:, :4] * sw[:4]) @ vw[:4] - x @ w) + 1e-6
    pick = topk_rows(x @ w, 8)
    assert recall(pick, pick, 40) == 1.0 and recall(topk_rows(-(x @ w), 8), pick, 40) == 0.0


def test_keep_rewrites_every_ffn_and_keeps_only_the_union_of_rows(tiny):
    path, feeds = tiny
    res = _call(path, feeds, keep=0.5, rank=16)
    assert res.modified and res.rule_counts == {"ffn": 2} and res.budget_met is None
    ops = Counter(n.op_type for n in res.model.graph)
    assert ops["TopK"] == 2 and ops["NonZero"] == 2 and ops["Gather"] >= 6 and ops["Gelu"] == 2
    assert not _ffn.find(res.model)  # the FFNs now gather their rows
    notes = " ".join(res.notes)
    assert "predictor recall vs oracle top-k" in notes and "union kept" in notes
    # one token per batch: the union is exactly that token's k = 64 rows
    model = ir.load(path)
    one = [{k: v[:1, :1] for k, v in f.items()} for f in feeds[3:4]]
    probe = res.model.clone()
    gathers = [n for n in probe.graph if n.op_type == "NonZero"]
    probe.graph.outputs.extend(g.outputs[0] for g in gathers)
    got = _run(probe, one)[0]
    assert [got[g.outputs[0].name].size for g in gathers] == [64, 64]
    got = _run(probe, feeds[3:4])[0]  # a padded batch of 4 x 16: the union is wider
    assert all(got[g.outputs[0].name].size > 64 for g in gathers)
    # keep near 1: every row of a padded batch survives the union -> the dense model's outputs
    full = _call(path, feeds, keep=0.99, rank=16)
    a, b = _run(full.model, feeds[3:]), _run(model, feeds[3:])
    assert compare(a, b, feeds[3:]).worst("cosine") > 0.9999


def test_declines_when_the_batch_union_is_nearly_dense(tiny):
    path, feeds = tiny
    res = _call(path, feeds, budget="cosine>=0.9", rank=16, max_union=0.5)  # 4 x 16 batches: wide unions
    assert not res.modified and res.budget_met is False
    assert "union of their tokens' selections" in res.notes[-1]


def test_budget_holds_on_held_back_feeds_or_declines(tiny):
    path, feeds = tiny
    res = _call(path, feeds, budget="cosine>=0.999", rank=16, max_union=1.0)
    if res.modified:
        assert res.budget_met is True
        held = feeds[3:]
        assert compare(_run(res.model, held), _run(ir.load(path), held), held).worst("cosine") >= 0.999
    else:
        assert res.budget_met is False and any(n.startswith("declined") for n in res.notes)


def test_declines_when_nothing_fits(tiny):
    path, feeds = tiny
    res = _call(path, feeds, budget="max_abs<=1e-7", rank=8)
    assert not res.modified and res.budget_met is False and any(n.startswith("declined") for n in res.notes)


def test_refusals(mlp_path):
    res = ContextualSparsityPass()(ir.load(mlp_path), PassContext())
    assert not res.modified and res.notes[0].startswith("not applied")
    for bad in ({"rank": 0}, {"keep": 1.5}, {"damp": 0}, {"max_union": 0}):
        with pytest.raises(UsageError):
            ContextualSparsityPass(**bad)


def test_through_the_pipeline_fused(tiny):
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    path, feeds = tiny
    result = pipeline.optimize(str(path), OptimizeOptions(
        passes="cleanup,fuse,contextual-sparsity", feeds=feeds,
        overrides=["contextual-sparsity.keep=0.75", "contextual-sparsity.rank=16"], budget="cosine>=0.9"))
    rec = result.report.passes[-1]
    assert result.ok and rec.modified, rec.error
    assert Counter(n.op_type for n in result.model.graph)["BiasGelu"] == 2

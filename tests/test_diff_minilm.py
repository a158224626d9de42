"""`graphopt diff` on real MiniLM before/after fusion: every fused region listed with its pass."""

from __future__ import annotations

import collections

import onnx_ir as ir
import pytest

from graphopt import PASS_TAG, io
from graphopt.diff import diff_models

pytestmark = pytest.mark.slow

FUSED = ("com.microsoft::Attention", "com.microsoft::MultiHeadAttention", "com.microsoft::SkipLayerNormalization",
         "com.microsoft::BiasGelu", "com.microsoft::FastGelu", "com.microsoft::Gelu",
         "com.microsoft::EmbedLayerNormalization",
         "Sum")  # fuse's CPU residual LayerNorm: Sum + LayerNormalization (rewrites/fuse/rules/residual_norm.py)


def _check_regions(result, pass_name: str) -> dict[str, int]:
    """Each fused op sits in its own region made by ``pass_name``; returns fused-op -> regions."""
    new_ops = {op: n for op, n in result.op_histogram["delta"].items() if n > 0 and op in FUSED}
    assert new_ops, "nothing was fused"
    per_op: collections.Counter = collections.Counter()
    for r in result.regions:
        if r["b_nodes"]:
            assert r["kind"] == "rewritten", r["summary"]
            assert set(r["passes"]) == {pass_name}, r["summary"]
            assert r["passes"][pass_name] == len(r["b_nodes"])  # every new node is tagged
            fused_here = [op for op in r["b_ops"] if op in FUSED]
            if not fused_here:  # a new helper shared by several fused regions (e.g. one mask Cast)
                assert len(r["shared_by"]) >= 2, r["summary"]
                continue
            assert len(fused_here) == 1 and r["b_ops"][fused_here[0]] == 1, r["summary"]
            per_op[fused_here[0]] += 1
        else:  # helper nodes shared by several fused regions (e.g. the mask computation)
            assert r["shared_by"], r["summary"]
    assert dict(per_op) == new_ops
    assert result.summary["passes"] == {pass_name: result.summary["added"]}
    return dict(per_op)


def test_minilm_onnxscript_fusions(minilm):
    """Stand-in for the fuse pass: onnxscript's ORT fusions, new nodes tagged like `optimize` does."""
    pytest.importorskip("onnxscript.rewriter.ort_fusions")
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    path = minilm("dynamo", "sdpa")
    a, b = io.load(path), io.load(path)
    before = {id(n) for n in ir.traversal.RecursiveGraphIterator(b.graph)}
    optimize_for_ort(b)
    for n in ir.traversal.RecursiveGraphIterator(b.graph):
        if id(n) not in before:
            n.metadata_props[PASS_TAG] = "ort-fusions"
    r = diff_models(a, b, numeric=True)
    per_op = _check_regions(r, "ort-fusions")
    assert per_op == {"com.microsoft::Attention": 6, "com.microsoft::SkipLayerNormalization": 12,
                      "com.microsoft::BiasGelu": 6}
    assert r.numeric["first_divergence"] is None and not r.drift


def test_minilm_fuse_pass(minilm, tmp_path):
    """The real `fuse` pass through the pipeline (which writes the graphopt.pass tags)."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    path = minilm("dynamo", "sdpa")
    res = pipeline.optimize(path, OptimizeOptions(passes="fuse", verify_level="structure"))
    # a fuse pass that fails or fuses nothing is a regression, not a reason to skip
    assert res.ok, [(p.name, p.status, p.error) for p in res.report.failed()]
    out = io.save(res.model, tmp_path / "fused.onnx")
    r = diff_models(path, out, numeric=True)
    per_op = _check_regions(r, "fuse")  # asserts that something was fused
    embed = per_op.pop("com.microsoft::EmbedLayerNormalization", 0)
    assert embed <= 1
    # CPU (the pipeline's default provider): each residual LayerNorm is one Sum + LayerNormalization region
    assert per_op == {"com.microsoft::Attention": 6, "Sum": 12, "com.microsoft::BiasGelu": 6}
    norm = [g for g in r.regions if "Sum" in g["b_ops"]]
    assert all(g["b_ops"] == {"Sum": 1, "LayerNormalization": 1} for g in norm), [g["b_ops"] for g in norm]
    # the 6 fused attentions each replaced the same 31-node subgraph
    attn = [g for g in r.regions if "com.microsoft::Attention" in g["b_ops"]]
    assert len({len(g["a_nodes"]) for g in attn}) == 1
    assert r.numeric["first_divergence"] is None or r.numeric["outputs_exceeding"] == []


def test_minilm_default_recipe_credits_fuse_and_pairs_nothing_unrelated(minilm, tmp_path):
    """The default recipe (cleanup, fuse, remove-padding): remove-padding rebuilds every fused op on packed
    tokens; the diff still credits each to fuse, with the chain, and pairs only what the passes replaced."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    path = minilm("dynamo", "sdpa")
    res = pipeline.optimize(path, OptimizeOptions(verify_level="structure"))
    assert res.ok and [p.name for p in res.report.passes if p.modified] == ["fuse", "remove-padding"]
    out = io.save(res.model, tmp_path / "opt.onnx")
    r = diff_models(path, out)
    by_id = {n["id"]: n for n in r.graphs["b"]}

    # every contrib op was created by fuse and rebuilt by remove-padding
    contrib = [n for n in r.graphs["b"] if n["op"].startswith("com.microsoft::")]
    assert collections.Counter(n["op"] for n in contrib) == {"com.microsoft::MultiHeadAttention": 48,
                                                             "com.microsoft::BiasGelu": 6}
    assert all(n["pass"] == "fuse" and n["chain"] == ["fuse", "remove-padding"] for n in contrib)
    for g in r.regions:
        if any(op.startswith("com.microsoft::") for op in g["b_ops"]):
            assert g["passes"]["fuse"] >= 1 and g["chains"]["fuse → remove-padding"] >= 1, g["summary"]
            assert "fuse, rebuilt by remove-padding" in g["summary"] or "fuse (rebuilt by remove-padding)" in g[
                "summary"], g["summary"]

    # every region that pairs A nodes with B nodes holds a construct fuse made: nothing unrelated paired
    rewritten = [g for g in r.regions if g["kind"] == "rewritten"]
    for g in rewritten:
        assert any(by_id[b]["chain"][:1] == ["fuse"] for b in g["b_nodes"]), g["summary"]
    gelu = [g for g in rewritten if "com.microsoft::BiasGelu" in g["b_ops"]]
    assert [g["summary"] for g in gelu] == ["2 nodes (Add, Gelu) became BiasGelu by fuse, rebuilt by remove-padding"] * 6
    attn = [g for g in rewritten if "com.microsoft::MultiHeadAttention" in g["b_ops"]]
    assert len(attn) == 6  # one region per layer: its attention became 8 MultiHeadAttention (length groups)
    assert all(g["b_ops"]["com.microsoft::MultiHeadAttention"] == 8 and g["a_ops"]["Softmax"] == 1 for g in attn)
    norms = [g for g in rewritten if g["a_ops"] == {"Add": 2, "LayerNormalization": 1}]
    assert len(norms) == 12 and all(g["b_ops"].get("Sum") == 1 for g in norms)
    assert len(rewritten) == 6 + 6 + 12 + 1  # + the embeddings
    # matched pairs are the same op; each one a pass rebuilt says so
    assert r.summary["matched"] == r.summary["modified"] == 36
    assert all(m["op"] == "MatMul" and m["changes"][0].startswith("rebuilt by") for m in r.modified)
    # the packing index remove-padding computes from the mask is one shared, added region
    index = [g for g in r.regions if g["kind"] == "added" and len(g["b_nodes"]) > 100]
    assert len(index) == 1 and set(index[0]["passes"]) >= {"remove-padding"} and len(index[0]["shared_by"]) >= 7
    assert r.summary["passes"]["fuse"] == r.summary["chains"]["fuse → remove-padding"] + r.summary["chains"]["fuse"]

"""`graphopt diff`: structural matching, rewritten regions, numeric localisation, outputs, CLI."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from graphopt.diff import SCHEMA_VERSION, diff_models
from graphopt.diff import html as diff_html
from graphopt.diff import mapping as diff_mapping

_spec = importlib.util.spec_from_file_location("diff_models", Path(__file__).with_name("diff_models.py"))
dm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dm)

LN_OPS = {"ReduceMean": 2, "Sub": 1, "Pow": 1, "Add": 2, "Sqrt": 1, "Div": 1, "Mul": 1}


def _ir(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


@pytest.fixture
def files(tmp_path):
    """a: decomposed LN model, b: fused, c: W2 perturbed, u: unrelated, if0/if1: If bodies."""
    out = {}
    for key, proto in {
        "a": dm.mlp_ln(), "b": dm.mlp_ln(fused=True), "c": dm.mlp_ln(perturb="W2"), "u": dm.unrelated(),
        "if0": dm.with_if(), "if1": dm.with_if(then_extra=True),
    }.items():
        out[key] = tmp_path / f"{key}.onnx"
        onnx.save(proto, out[key])
    return out


def test_model_vs_itself_nothing_changed():
    a = _ir(dm.mlp_ln())
    r = diff_models(a, _ir(dm.mlp_ln()))
    s = r.summary
    assert s["identical"] and r.identical
    assert s["matched"] == s["nodes_a"] == s["nodes_b"] == 23
    assert s["unchanged"] == 23 and s["removed"] == s["added"] == s["modified"] == s["regions"] == 0
    assert r.op_histogram["delta"] == {} and r.regions == [] and r.modified == []
    assert r.initializers["delta"] == {"count": 0, "bytes": 0, "params": 0, "sparsity": 0.0}
    assert not r.io["changed"] and r.flops["delta"] == 0
    assert all(n["status"] == "unchanged" for side in "ab" for n in r.graphs[side])


def test_unrelated_models_everything_changed():
    r = diff_models(_ir(dm.mlp_ln()), _ir(dm.unrelated()))
    s = r.summary
    assert not s["identical"]
    assert s["matched"] == 0 and s["removed"] == 23 and s["added"] == 3
    assert all(n["status"] == "removed" for n in r.graphs["a"])
    assert all(n["status"] == "added" for n in r.graphs["b"])
    assert r.io["changed"] and r.io["inputs"]["removed"] == ["x"] and r.io["inputs"]["added"] == ["img"]
    assert len(r.initializers["removed"]) == 7 and len(r.initializers["added"]) == 1
    assert r.flops["b"]["by_op"] == {"Conv": 2 * 4 * 8 * 8 * 3 * 3 * 3}


@pytest.mark.parametrize("rename_outputs", [False, True])
def test_layernorm_fusion_regions(rename_outputs):
    """Each 9-node decomposed LayerNorm became one LayerNormalization made by pass `fuse`."""
    b = dm.mlp_ln(fused=True)
    if rename_outputs:  # a rewriter that does not keep value names: matching goes through wildcards
        for node in b.graph.node:
            node.output[:] = [o + "_new" if o in ("ln1", "ln2") else o for o in node.output]
            node.input[:] = [i + "_new" if i in ("ln1", "ln2") else i for i in node.input]
    r = diff_models(_ir(dm.mlp_ln()), _ir(b))
    s = r.summary
    assert s["regions"] == 2 and s["matched"] == 5 and s["unchanged"] == 5
    assert s["removed"] == 18 and s["added"] == 2 and s["passes"] == {"fuse": 2}
    for k, region in enumerate(r.regions):
        assert region["kind"] == "rewritten"
        assert len(region["a_nodes"]) == 9 and len(region["b_nodes"]) == 1
        assert region["a_ops"] == LN_OPS and region["b_ops"] == {"LayerNormalization": 1}
        assert region["passes"] == {"fuse": 1}
        assert region["inputs"] == [f"r{k + 1}"] and region["outputs"] == [f"ln{k + 1}"]
        assert region["summary"] == "9 nodes (Add×2, ReduceMean×2, Div, Mul, Pow, Sqrt, Sub) became LayerNormalization by fuse"
    assert r.op_histogram["delta"] == {"Add": -4, "Div": -2, "LayerNormalization": 2, "Mul": -2, "Pow": -2,
                                       "ReduceMean": -4, "Sqrt": -2, "Sub": -2}
    assert sorted(x["name"] for x in r.initializers["removed"]) == ["eps", "two"]
    assert r.initializers["delta"]["count"] == -2 and r.params["delta"] == -2
    # the MatMuls after each LayerNorm are matched, not swallowed by the regions
    names_b = {n["name"]: n for n in r.graphs["b"]}
    assert names_b["mm2"]["status"] == names_b["mm3"]["status"] == "unchanged"


def test_regions_hold_typed_node_ids():
    """Matching and regions work on NodeId(side, index); the JSON ids are their "a12" / "b7" form."""
    from graphopt.diff.matching import NodeId, Side, match_graphs
    from graphopt.diff.regions import find_regions

    a, b = _ir(dm.mlp_ln()), _ir(dm.mlp_ln(fused=True))
    m = match_graphs(a.graph, b.graph)
    regions = find_regions(m)
    assert len(regions) == 2
    for region in regions:
        assert all(isinstance(n, NodeId) and n.side is Side.A for n in region.a_nodes)
        assert all(isinstance(n, NodeId) and n.side is Side.B for n in region.b_nodes)
        assert [m.node(n).op_type for n in region.b_nodes] == ["LayerNormalization"]
        d = region.as_dict()
        assert d["a_nodes"] == [f"a{n.index}" for n in region.a_nodes]
        assert d["b_nodes"] == [f"b{n.index}" for n in region.b_nodes]
    assert str(NodeId(Side.B, 7)) == "b7" and NodeId(Side.A, 3) != NodeId(Side.B, 3)
    # the JSON records are in graph order, so the id's index names the node
    r = diff_models(a, b)
    for side in Side:
        nodes = m.nodes(side)
        for k, rec in enumerate(r.graphs[side.value]):
            assert rec["id"] == str(NodeId(side, k)) and rec["name"] == (nodes[k].name or "")
    for pair in r.modified + [{"a": n["id"], "b": n["match"]} for n in r.graphs["a"] if n["match"]]:
        assert pair["a"].startswith("a") and pair["b"].startswith("b")


def test_fusion_is_numerically_clean():
    r = diff_models(_ir(dm.mlp_ln()), _ir(dm.mlp_ln(fused=True)), numeric=True)
    n = r.numeric
    assert n["first_divergence"] is None and n["exceeding"] == 0 and not r.drift
    assert set(n["outputs"]) == {"y"} and n["outputs"]["y"]["max_abs"] < 1e-5
    compared = {t["a"] for t in n["tensors"]}
    assert {"h1", "r1", "ln1", "h2", "r2", "ln2", "y"} <= compared  # region outputs line up


def test_injected_weight_error_localised_to_consumer():
    """W2 (read by mm2, deep in the model) perturbed: numeric diff points at mm2."""
    r = diff_models(_ir(dm.mlp_ln()), _ir(dm.mlp_ln(perturb="W2")), numeric=True)
    assert [m["name"] for m in r.modified] == ["mm2"]
    assert [c["name"] for c in r.initializers["changed"]] == ["W2"]
    assert r.initializers["changed"][0]["elements_changed"] == 1
    n = r.numeric
    f = n["first_divergence"]
    assert f["node_name"] == "mm2" and f["op"] == "MatMul" and f["a"] == "h2"
    assert f["changed_initializers"] == ["W2"]
    # everything upstream is clean
    up = {t["a"]: t for t in n["tensors"]}
    assert not up["h1"]["exceeds"] and not up["ln1"]["exceeds"]
    assert n["path"][0]["a"] == "h2" and n["path"][-1]["a"] == "y"
    assert all(p["exceeds"] for p in n["path"])
    assert r.drift and n["outputs_exceeding"] == ["y"]
    # the error shows on the nodes for the HTML view
    a_nodes = {x["name"]: x for x in r.graphs["a"]}
    assert a_nodes["mm2"]["max_abs"] > 0.1 and a_nodes["mm1"]["max_abs"] == 0.0


def test_subgraph_changes():
    r = diff_models(_ir(dm.with_if()), _ir(dm.with_if(then_extra=True)))
    assert len(r.subgraphs) == 1
    sg = r.subgraphs[0]
    assert sg["op"] == "If" and sg["changed"]
    bodies = {b["attribute"]: b for b in sg["bodies"]}
    assert bodies["then_branch"]["a_nodes"] == 1 and bodies["then_branch"]["b_nodes"] == 2
    assert bodies["then_branch"]["op_delta"] == {"Neg": 1} and not bodies["else_branch"]["changed"]
    assert r.op_histogram["delta"] == {"Neg": 1} and not r.identical
    same = diff_models(_ir(dm.with_if()), _ir(dm.with_if()))
    assert same.identical and not same.subgraphs[0]["changed"]


def test_json_schema_is_stable():
    r = diff_models(_ir(dm.mlp_ln()), _ir(dm.mlp_ln(fused=True)), numeric=True)
    d = json.loads(r.to_json())
    assert d["schema_version"] == SCHEMA_VERSION
    assert list(d) == ["schema_version", "a", "b", "summary", "op_histogram", "regions", "modified",
                       "initializers", "io", "params", "flops", "subgraphs", "graphs", "numeric"]
    region_keys = {"id", "kind", "summary", "a_nodes", "b_nodes", "a_ops", "b_ops", "passes", "inputs", "outputs",
                   "shared_by", "chains"}
    assert set(d["regions"][0]) == region_keys
    assert d["regions"][0]["chains"] == {"fuse": 1}
    assert {"passes", "chains"} <= set(d["summary"])
    node_keys = {"id", "name", "op", "status", "match", "region", "pass", "chain", "changes", "inputs", "outputs"}
    assert node_keys <= set(d["graphs"]["b"][0])
    assert {"feeds", "atol", "rtol", "compared", "exceeding", "first_divergence", "path", "outputs",
            "outputs_exceeding", "tensors", "node_errors"} == set(d["numeric"])


def test_mapping_and_html_are_self_contained():
    r = diff_models(_ir(dm.mlp_ln()), _ir(dm.mlp_ln(fused=True)))
    m = diff_mapping.mapping_data(r)
    entries = m["mappingEntries"]
    assert {"leftNodeIds": ["mm2"], "rightNodeIds": ["mm2"]} in entries
    region_entries = [e for e in entries if len(e["leftNodeIds"]) > 1]
    assert len(region_entries) == 2 and region_entries[0]["rightNodeIds"] == ["ln1/LayerNorm"]
    page = diff_html.render_html(r)
    assert "<script src" not in page and "<link" not in page and "https://" not in page
    assert page.count("http://") == 1  # the SVG namespace string only
    assert "</script>" not in page.split('id="diff-data">')[1].split("</script>")[0]


def test_cli_outputs_and_exit_codes(files, tmp_path, run_cli):
    j, h, mp = tmp_path / "d.json", tmp_path / "d.html", tmp_path / "m.json"
    code, out, err = run_cli("diff", files["a"], files["b"], "--report", j, "--html", h, "--mapping", mp)
    assert code == 0, err
    assert "2 regions" in out and "fuse" in out and "LayerNormalization" in out
    assert f"JSON written to {j}" in out
    assert json.loads(j.read_text())["summary"]["regions"] == 2
    assert h.read_text().startswith("<!DOCTYPE html>")
    assert json.loads(mp.read_text())["mappingEntries"]
    code, out, _ = run_cli("diff", files["a"], files["a"])
    assert code == 0 and "nothing changed" in out
    code, out, _ = run_cli("diff", files["a"], files["c"], "--numeric")
    assert code == 0 and "first divergence" in out and "mm2" in out
    code, _, _ = run_cli("diff", files["a"], files["c"], "--numeric", "--fail-on-drift")
    assert code == 3
    code, _, _ = run_cli("diff", files["a"], files["b"], "--numeric", "--fail-on-drift")
    assert code == 0
    code, out, _ = run_cli("diff", files["a"], files["b"], "--json")
    assert code == 0 and json.loads(out)["schema_version"] == SCHEMA_VERSION


def test_cli_json_is_a_flag_and_report_a_file(files, tmp_path, run_cli):
    """--json prints the JSON diff (and nothing else) on stdout; --report FILE writes the same JSON."""
    j, h = tmp_path / "d.json", tmp_path / "d.html"
    code, out, err = run_cli("diff", files["a"], files["b"], "--json", "--report", j, "--html", h)
    assert code == 0, err
    assert json.loads(out) == json.loads(j.read_text())  # stdout is the JSON alone: no table, no "written to"
    assert json.loads(out)["summary"]["regions"] == 2 and h.exists()
    code, _, err = run_cli("diff", files["a"], files["b"], "--json", tmp_path / "old.json")
    assert code == 2 and "old.json" in err and not (tmp_path / "old.json").exists()
    code, out, _ = run_cli("diff", files["a"], files["b"], "--report", j, "-q")
    assert code == 0 and out == "" and json.loads(j.read_text())["summary"]["regions"] == 2


def test_cli_errors(files, tmp_path, run_cli):
    code, _, err = run_cli("diff", files["a"], tmp_path / "missing.onnx")
    assert code == 2 and "missing.onnx" in err  # a missing input is a usage error everywhere
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    code, _, err = run_cli("diff", bad, files["a"])
    assert code == 1 and "bad.onnx" in err
    code, _, err = run_cli("diff", files["a"], files["b"], "--calib", tmp_path)
    assert code == 2 and "--numeric" in err
    code, _, err = run_cli("diff", files["a"], files["b"], "--numeric", "--calib", tmp_path)
    assert code == 2 and "no .npz" in err


def test_calib_feeds(files, tmp_path, run_cli):
    import numpy as np

    from graphopt.data.feeds import save_dir

    rng = np.random.default_rng(0)
    save_dir([{"x": rng.standard_normal((1, 3, dm.H)).astype(np.float32)}], tmp_path / "calib")
    j = tmp_path / "n.json"
    code, _, err = run_cli("diff", files["a"], files["c"], "--numeric", "--calib", tmp_path / "calib", "--report", j)
    assert code == 0, err
    d = json.loads(j.read_text())
    assert d["numeric"]["feeds"] == 1 and d["numeric"]["first_divergence"]["node_name"] == "mm2"

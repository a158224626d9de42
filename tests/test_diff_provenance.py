"""Provenance chains through the pipeline, and a diff that credits them and pairs only what it can show.

Hand-made before/after pairs, each stating the regions a person would draw.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from graphopt import PASS_TAG, io
from graphopt.diff import diff_models
from graphopt.engine import pipeline, provenance, registry
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.registry import GraphoptPass, PassResult

H = 8
MS = "com.microsoft"


def _init(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.tensor(array.astype(np.float32), name=name))
    graph.register_initializer(v)
    return v


def mlp_gelu() -> ir.Model:
    """x -> MatMul W1 -> h -> Add b -> lin -> Gelu -> gelu -> MatMul W2 -> y (opset 20)."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", shape=ir.Shape(["batch", H]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="mlp_gelu")
    w1, b, w2 = (_init(graph, n, rng.standard_normal(s)) for n, s in (("W1", (H, H)), ("b", (H,)), ("W2", (H, H))))
    mm1 = ir.node("MatMul", [x, w1], name="mm1")
    add = ir.node("Add", [mm1.outputs[0], b], name="add")
    gelu = ir.node("Gelu", [add.outputs[0]], name="gelu")
    mm2 = ir.node("MatMul", [gelu.outputs[0], w2], name="mm2")
    for node, out in ((mm1, "h"), (add, "lin"), (gelu, "gelu"), (mm2, "y")):
        node.outputs[0].name = out
        node.outputs[0].dtype, node.outputs[0].shape = ir.DataType.FLOAT, ir.Shape(["batch", H])
    graph.extend([mm1, add, gelu, mm2])
    graph.outputs.append(mm2.outputs[0])
    return ir.Model(graph, ir_version=10)


def _node(model: ir.Model, op: str) -> ir.Node:
    return next(n for n in model.graph if n.op_type == op)


class FuseBiasGelu(GraphoptPass):
    """Test-only: Add + Gelu -> com.microsoft BiasGelu, keeping the output name (as onnxscript's rewriter does)."""

    name = "test-fuse"

    def call(self, model, ctx):
        g = model.graph
        gelu = _node(model, "Gelu")
        add = gelu.inputs[0].producer()
        new = ir.node("BiasGelu", list(add.inputs), domain=MS)
        out = gelu.outputs[0]
        name, out.name = out.name, None
        new.outputs[0].name, new.outputs[0].dtype, new.outputs[0].shape = name, out.dtype, out.shape
        g.insert_after(gelu, new)
        out.replace_all_uses_with(new.outputs[0])
        g.remove([add, gelu], safe=True)
        model.opset_imports[MS] = 1
        return PassResult(model, True)


class RebuildBiasGelu(GraphoptPass):
    """Test-only: re-emits each BiasGelu as a new node. ``inherit``: say so and take a new output name;
    else keep the output name and leave the history to the pipeline."""

    name = "test-rebuild"

    def __init__(self, *, inherit: bool = True):
        super().__init__()
        self.inherit = inherit

    def call(self, model, ctx):
        old = _node(model, "BiasGelu")
        new = ir.node("BiasGelu", list(old.inputs), domain=MS)
        out = old.outputs[0]
        if self.inherit:
            provenance.inherit(new, old)
            new.outputs[0].name = f"{out.name}_rebuilt"
        else:
            name, out.name = out.name, None
            new.outputs[0].name = name
        new.outputs[0].dtype, new.outputs[0].shape = out.dtype, out.shape
        model.graph.insert_after(old, new)
        out.replace_all_uses_with(new.outputs[0])
        model.graph.remove(old, safe=True)
        return PassResult(model, True)


class AddScale(GraphoptPass):
    """Test-only: y -> Mul(y, 1) with a new node whose fresh name reuses the freed name ``lin``."""

    name = "test-scale"

    def call(self, model, ctx):
        g = model.graph
        one = _init(g, "one", np.ones((), np.float32))
        y = g.outputs[0]
        mul = ir.node("Mul", [y, one])
        g.append(mul)
        mul.outputs[0].name, mul.outputs[0].dtype, mul.outputs[0].shape = "lin", y.dtype, y.shape
        name, y.name = y.name, f"{y.name}_pre"
        out = ir.node("Identity", [mul.outputs[0]])
        g.append(out)
        out.outputs[0].name, out.outputs[0].dtype, out.outputs[0].shape = name, y.dtype, y.shape
        g.outputs[0] = out.outputs[0]
        return PassResult(model, True)


@pytest.fixture(autouse=True)
def _test_passes():
    with registry.using(registry.with_builtins(FuseBiasGelu, RebuildBiasGelu, AddScale)):
        yield


def _run(passes: str, **kw) -> ir.Model:
    res = pipeline.optimize(mlp_gelu(), OptimizeOptions(passes=passes, **kw))
    assert res.ok and all(p.modified for p in res.report.passes), [(p.name, p.status, p.error) for p in res.report.passes]
    return res.model


def _meta(node: ir.Node) -> dict[str, str]:
    return {k: v for k, v in node.metadata_props.items() if k.startswith("graphopt.")}


# ---------------------------------------------------------------- provenance through the pipeline


def test_a_fused_node_records_its_pass_and_the_name_it_kept():
    fused = _node(_run("test-fuse"), "BiasGelu")
    assert _meta(fused) == {PASS_TAG: "test-fuse", provenance.CHAIN_TAG: "test-fuse", provenance.KEPT_TAG: "gelu"}


@pytest.mark.parametrize("inherit", [True, False])
def test_a_rebuilt_node_keeps_the_history_of_the_pass_that_made_it(inherit):
    """Explicit (``provenance.inherit``) or inferred (same op, took over the removed node's output name)."""
    m = _run("test-fuse,test-rebuild", overrides=[f"test-rebuild.inherit={inherit}"])
    node = _node(m, "BiasGelu")
    assert provenance.chain_of(node) == ["test-fuse", "test-rebuild"]
    assert node.metadata_props[PASS_TAG] == "test-fuse"  # the pass that created the construct
    # the kept output name continues the input model's 'gelu' only when the rebuild kept it
    assert provenance.kept_names(node) == (set() if inherit else {"gelu"})


def test_a_pass_run_twice_is_not_repeated_in_the_chain():
    node = _node(_run("test-fuse,test-rebuild,test-rebuild"), "BiasGelu")
    assert provenance.chain_of(node) == ["test-fuse", "test-rebuild"]


def test_provenance_survives_save_and_load(tmp_path):
    path = io.save(_run("test-fuse,test-rebuild"), tmp_path / "m.onnx")
    node = _node(io.load(path), "BiasGelu")
    assert provenance.chain_of(node) == ["test-fuse", "test-rebuild"]


def test_nodes_without_a_chain_read_as_their_pass_tag():
    node = ir.node("Relu", [None])
    assert provenance.chain_of(node) == [] and provenance.kept_names(node) is None
    node.metadata_props[PASS_TAG] = "fuse"  # an older graphopt, or another tool
    assert provenance.chain_of(node) == ["fuse"] and provenance.kept_names(node) is None


# ---------------------------------------------------------------- credit in the diff


@pytest.mark.parametrize("inherit", [True, False])
def test_diff_credits_the_pass_that_created_the_construct(inherit):
    m = _run("test-fuse,test-rebuild", overrides=[f"test-rebuild.inherit={inherit}"])
    r = diff_models(mlp_gelu(), m)
    assert [g["summary"] for g in r.regions] == [
        "2 nodes (Add, Gelu) became BiasGelu by test-fuse, rebuilt by test-rebuild"]
    g = r.regions[0]
    assert g["passes"] == {"test-fuse": 1} and g["chains"] == {"test-fuse → test-rebuild": 1}
    assert r.summary["passes"] == {"test-fuse": 1} and r.summary["chains"] == {"test-fuse → test-rebuild": 1}
    rec = next(n for n in r.graphs["b"] if n["op"] == "com.microsoft::BiasGelu")
    assert rec["pass"] == "test-fuse" and rec["chain"] == ["test-fuse", "test-rebuild"]
    assert r.summary["matched"] == 2 and r.summary["modified"] == 0  # the MatMuls


def test_diff_from_an_intermediate_model_credits_only_what_happened_since():
    """A already has the fused node: B's rebuild of it is a rebuilt pair, not a new construct."""
    fused = _run("test-fuse")
    final = _run("test-fuse,test-rebuild")
    r = diff_models(fused, final)
    assert r.regions == []
    assert [(x["op"], x["changes"]) for x in r.modified] == [("com.microsoft::BiasGelu", ["rebuilt by test-rebuild"])]


def test_singular_and_plural_in_summaries(tmp_path, run_cli):
    m = _run("test-fuse")
    a, b = io.save(mlp_gelu(), tmp_path / "a.onnx"), io.save(m, tmp_path / "b.onnx")
    code, out, err = run_cli("diff", a, b)
    assert code == 0, err
    text = " ".join(out.split())
    assert "in 1 region (test-fuse: 1 node)" in text and "matched 2 nodes" in text
    assert "1 nodes" not in text and "1 regions" not in text


# ---------------------------------------------------------------- honest pairing


def test_a_fresh_name_equal_to_an_old_one_pairs_nothing():
    """test-scale's new Mul output is named 'lin', like A's Add output: a coincidence, not a rewrite.

    Without provenance the diff paired A's Add + Gelu with B's Mul (a region "Add, Gelu became Mul").
    """
    m = _run("test-fuse,test-scale")
    mul = _node(m, "Mul")
    assert mul.outputs[0].name == "lin" and provenance.kept_names(mul) == set()
    r = diff_models(mlp_gelu(), m)
    by_kind = {(g["kind"], tuple(sorted(g["a_ops"])), tuple(sorted(g["b_ops"]))) for g in r.regions}
    assert by_kind == {("rewritten", ("Add", "Gelu"), ("com.microsoft::BiasGelu",)),
                       ("added", (), ("Identity", "Mul"))}
    assert [g["summary"] for g in r.regions if g["kind"] == "added"] == ["2 nodes added (Identity, Mul) by test-scale"]


def _chain_models(tag_b: bool, kept: bool = False) -> tuple[ir.Model, ir.Model]:
    """A: x -> Softmax -> val_1 -> Neg -> val_2 -> Relu 'out' -> y.  B: x -> Mul -> val_1 -> Div -> val_2 -> Relu.

    The inner names agree by construction (as onnx-ir's reused ``val_<n>`` names do); the Relu is the same.
    """
    models = []
    for ops in (("Softmax", "Neg"), ("Mul", "Div")):
        x = ir.Value(name="x", shape=ir.Shape([2, H]), type=ir.TensorType(ir.DataType.FLOAT))
        g = ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="chain")
        c = _init(g, "c", np.full((), 2.0))
        first = ir.node(ops[0], [x] if ops[0] == "Softmax" else [x, c], name=f"n_{ops[0]}")
        second = ir.node(ops[1], [first.outputs[0]] if ops[1] == "Neg" else [first.outputs[0], c],
                         name=f"n_{ops[1]}")
        relu = ir.node("Relu", [second.outputs[0]], name="out")
        for node, name in ((first, "val_1"), (second, "val_2"), (relu, "y")):
            node.outputs[0].name, node.outputs[0].dtype = name, ir.DataType.FLOAT
            node.outputs[0].shape = ir.Shape([2, H])
        g.extend([first, second, relu])
        g.outputs.append(relu.outputs[0])
        models.append(ir.Model(g, ir_version=10))
    a, b = models
    if tag_b:
        for n in list(b.graph)[:2]:
            n.metadata_props[PASS_TAG] = "p"
            n.metadata_props[provenance.CHAIN_TAG] = "p"
            if kept:
                n.metadata_props[provenance.KEPT_TAG] = n.outputs[0].name
    return a, b


def test_coincident_names_do_not_split_a_rewrite_into_invented_pairs():
    """B's new nodes say their names are new: one region, Softmax + Neg became Mul + Div."""
    a, b = _chain_models(tag_b=True)
    r = diff_models(a, b)
    assert [g["summary"] for g in r.regions] == ["2 nodes (Neg, Softmax) became 2 nodes (Div, Mul) by p"]
    assert r.summary["matched"] == 1  # the Relu


def test_kept_names_are_evidence():
    """Had the pass kept the names (the values continue A's), each op replaced the other one by one."""
    a, b = _chain_models(tag_b=True, kept=True)
    r = diff_models(a, b)
    assert [g["summary"] for g in r.regions] == ["1 node (Softmax) became Mul by p", "1 node (Neg) became Div by p"]


def test_untagged_names_pair_unless_their_dtypes_differ():
    a, b = _chain_models(tag_b=False)
    r = diff_models(a, b)  # no provenance: equal names and dtypes are taken at their word
    assert len(r.regions) == 2
    b.graph.node(0).outputs[0].dtype = ir.DataType.DOUBLE  # Mul now yields doubles: not A's val_1
    r = diff_models(a, b)
    assert [g["summary"] for g in r.regions] == ["2 nodes (Neg, Softmax) became 2 nodes (Div, Mul)"]


def test_a_new_node_with_an_old_node_name_is_not_that_node_modified():
    """A pass-made Relu named 'out' like A's (a reused name), output 'y' not kept, is not A's Relu."""
    a, b = _chain_models(tag_b=True)
    relu = b.graph.node(2)
    relu.replace_input_with(0, b.graph.node(0).outputs[0])  # reads Mul now; Div feeds nothing else
    b.graph.outputs.append(b.graph.node(1).outputs[0])
    assert diff_models(a, b).summary["matched"] == 1  # untagged: its names are evidence, it pairs
    relu.metadata_props[provenance.CHAIN_TAG] = "p"
    r = diff_models(a, b)
    assert r.summary["matched"] == 0 and r.summary["modified"] == 0

"""The pipeline: verification after each pass, rollback, reports, tags, recipes and options."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from graphopt import PASS_TAG, io
from graphopt.engine import pipeline, recipe, registry
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.registry import GraphoptPass, PassResult
from graphopt.errors import UsageError


class CorruptWeight(GraphoptPass):
    """Test-only: scales the first float initializer by 1.5 (a silent numeric bug)."""

    name = "test-corrupt-weight"

    def __init__(self, *, factor: float = 1.5):
        super().__init__()
        self.factor = factor

    def call(self, model, ctx):
        for v in model.graph.initializers.values():
            t = v.const_value
            if t is not None and t.dtype == ir.DataType.FLOAT and t.size > 1:
                v.const_value = ir.tensor(t.numpy() * self.factor, name=v.name)
                return PassResult(model, True)
        return PassResult(model, False)


class AddNoOp(GraphoptPass):
    """Test-only: routes the first output through a new Identity node (lossless)."""

    name = "test-add-noop"

    def call(self, model, ctx):
        g = model.graph
        out = g.outputs[0]
        node = ir.node("Identity", [out], num_outputs=1)
        g.append(node)
        new = node.outputs[0]
        name = out.name
        out.name = name + "_pre"
        new.name = name
        new.shape, new.dtype = out.shape, out.dtype
        g.outputs[0] = new
        return PassResult(model, True)


class LeavesUntyped(GraphoptPass):
    """Test-only: routes the first output through an Identity whose output has no element type (the model
    cannot be serialized, as after a pass that forgot a dtype)."""

    name = "test-untyped"
    exact = True

    def call(self, model, ctx):
        g = model.graph
        out = g.outputs[0]
        node = ir.node("Identity", [out], num_outputs=1)
        g.append(node)
        new = node.outputs[0]
        new.name, out.name = out.name, out.name + "_pre"
        new.type = ir.TensorType(None)
        g.outputs[0] = new
        return PassResult(model, True)


class Crashes(GraphoptPass):
    """Test-only: raises."""

    name = "test-crash"

    def call(self, model, ctx):
        raise RuntimeError("boom")


class KeepsState(GraphoptPass):
    """Test-only: breaks the protocol by writing on itself during call()."""

    name = "test-keeps-state"

    def call(self, model, ctx):
        self.seen = model.graph.name
        return PassResult(model, False)


@pytest.fixture(autouse=True)
def _test_passes():
    """The test passes live in a local registry, active only inside each test of this module."""
    local = registry.with_builtins(CorruptWeight, AddNoOp, LeavesUntyped, Crashes, KeepsState, NudgeWeights)
    with registry.using(local):
        yield local


def test_unserializable_pass_output_is_a_failed_pass(run_cli, mlp_path, tmp_path):
    """A pass whose model cannot be serialized is rolled back like any failed pass (exit 0 and the recipe goes
    on; exit 3 under --strict), never a crash with exit 1."""
    out = tmp_path / "out.onnx"
    code, _, stderr = run_cli("optimize", mlp_path, "-o", out, "--passes", "test-untyped,cleanup")
    assert code == 0, stderr
    assert "warning: pass 'test-untyped' rolled-back" in stderr
    assert out.exists()
    code, _, stderr = run_cli("optimize", mlp_path, "-o", tmp_path / "strict.onnx", "--passes", "test-untyped",
                              "--strict")
    assert code == 3 and not (tmp_path / "strict.onnx").exists(), stderr


def test_lossless_pass_failing_is_rolled_back_and_the_run_goes_on(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    code, _, stderr = run_cli("optimize", mlp_path, "-o", out, "--passes", "test-corrupt-weight,cleanup",
                              "--report", tmp_path / "r.json", "-q")
    assert code == 0 and out.exists()
    assert "warning: pass 'test-corrupt-weight' rolled-back" in stderr and "--strict" in stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [p["status"] for p in rep["passes"]] == ["rolled-back", "ok"] and rep["ok"]
    assert any("went on without" in n for n in rep["passes"][0]["notes"])
    w = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer}["w1"]
    w_ref = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(mlp_path)).graph.initializer}["w1"]
    np.testing.assert_array_equal(w, w_ref)  # written without the corrupting pass


def test_strict_fails_on_a_rolled_back_lossless_pass(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    before = mlp_path.read_bytes()
    code, stdout, stderr = run_cli("optimize", mlp_path, "-o", out, "--passes", "cleanup,test-corrupt-weight",
                                   "--report", tmp_path / "r.json", "--strict")
    assert code == 3
    assert not out.exists()
    assert mlp_path.read_bytes() == before
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [p["status"] for p in rep["passes"]] == ["ok", "rolled-back"]
    bad = rep["passes"][1]
    assert bad["verification"]["max_abs"] > 1e-3
    assert "verification failed" in bad["error"]
    assert "test-corrupt-weight" in stderr


def test_keep_going_writes_last_good_model(run_cli, mlp_path, tmp_path):
    out = tmp_path / "out.onnx"
    args = ("optimize", mlp_path, "-o", out, "--passes", "test-nudge,cleanup", "--set", "test-nudge.eps=0.5", "-q")
    code, _, err = run_cli(*args)
    assert code == 3 and not out.exists() and "--keep-going" in err  # a lossy pass over budget stops the run
    code, _, _ = run_cli(*args, "--keep-going")
    assert code == 0
    ref = onnx.load(str(mlp_path))
    got = onnx.load(str(out))
    w_ref = {i.name: onnx.numpy_helper.to_array(i) for i in ref.graph.initializer}["w1"]
    w_got = {i.name: onnx.numpy_helper.to_array(i) for i in got.graph.initializer}["w1"]
    np.testing.assert_array_equal(w_ref, w_got)  # the corrupting pass was rolled back


def test_debug_dir_saves_pair(run_cli, mlp_path, tmp_path):
    dbg = tmp_path / "dbg"
    code, _, _ = run_cli("optimize", mlp_path, "-o", tmp_path / "o.onnx", "--passes", "test-corrupt-weight",
                         "--debug-dir", dbg, "-q", "--strict")
    assert code == 3
    names = sorted(p.name for p in dbg.iterdir())
    assert names == ["00-test-corrupt-weight.after.onnx", "00-test-corrupt-weight.before.onnx"]


def test_crashing_pass_reported_not_raised(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-crash,cleanup"))
    assert res.ok  # lossless: rolled back, the recipe went on
    assert [p.status for p in res.report.passes] == ["error", "ok"]
    assert "boom" in res.report.passes[0].error
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-crash,cleanup", strict=True))
    assert not res.ok and [p.status for p in res.report.passes] == ["error"]


def test_a_pass_that_keeps_state_breaks_the_protocol(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-keeps-state", strict=True))
    assert not res.ok
    assert "wrote seen on itself" in res.report.passes[0].error


def test_pass_is_built_once(mlp_path, monkeypatch):
    built = []
    orig = CorruptWeight.__init__

    def counting(self, **kw):
        built.append(kw)
        orig(self, **kw)

    monkeypatch.setattr(CorruptWeight, "__init__", counting)
    pipeline.optimize(mlp_path, OptimizeOptions(passes="test-corrupt-weight"))
    assert len(built) == 1


def test_no_test_pass_is_visible_to_graphopt_passes(run_cli):
    with registry.using(registry.builtin()):
        code, out, _ = run_cli("passes", "--json")
    assert code == 0
    names = [p["name"] for p in json.loads(out)]
    assert {"cleanup", "fuse", "remove-padding", "quantize"} <= set(names)
    assert not [n for n in names if n.startswith("test-")]


def test_a_builtin_module_failing_to_import_is_named(monkeypatch, run_cli):
    import sys

    monkeypatch.setattr(registry, "_BUILTIN", None)
    monkeypatch.setattr(registry, "BUILTIN_MODULES", (*registry.BUILTIN_MODULES, "broken"))
    monkeypatch.setitem(sys.modules, "graphopt.rewrites.broken", None)  # import raises ImportError
    for _ in range(2):  # and stays failing: no half-filled registry afterwards
        with pytest.raises(registry.PassLoadError, match=r"graphopt\.rewrites\.broken"):
            registry.builtin()
    with registry.using(None):
        code, _, err = run_cli("passes")
    assert code == 1 and "cannot load the builtin pass module graphopt.rewrites.broken" in err
    assert "Traceback" not in err


def test_new_nodes_tagged_with_pass_name(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-add-noop"))
    assert res.ok
    tagged = [n for n in res.model.graph if n.metadata_props.get(PASS_TAG)]
    assert [(n.op_type, n.metadata_props[PASS_TAG]) for n in tagged] == [("Identity", "test-add-noop")]


def test_report_counts_and_delta(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="cleanup"))
    rec = res.report.passes[0]
    assert rec.modified and rec.status == "ok"
    assert rec.nodes_before == 6 and rec.nodes_after == 4  # Mul folded, Identity removed
    assert rec.op_delta == {"Identity": -1, "Mul": -1}
    assert rec.verification["level"] == "numeric" and rec.verification["max_abs"] <= 1e-6
    d = json.loads(res.report.to_json())
    assert d["schema_version"] == 1 and d["passes"][0]["name"] == "cleanup"


def test_set_option_reaches_pass(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="cleanup",
                                                      overrides=["cleanup.fold_constants=false"]))
    assert res.report.passes[0].options["fold_constants"] is False
    assert "Mul" in res.report.ops_after  # nothing folded


def test_unknown_pass_did_you_mean():
    with pytest.raises(UsageError) as e:
        registry.get("clenup")
    assert "did you mean 'cleanup'" in e.value.hint


def test_unknown_option_lists_accepted():
    with pytest.raises(UsageError) as e:
        registry.create("cleanup", {"bogus": 1})
    assert "bogus" in e.value.message and "fold_constants" in e.value.hint


def test_bad_option_value():
    with pytest.raises(UsageError, match="not a bool"):
        registry.create("cleanup", {"cse": "maybe"})


def test_recipe_toml_roundtrip(tmp_path, mlp_path):
    r = tmp_path / "r.toml"
    r.write_text('name = "mine"\n[[step]]\npass = "cleanup"\noptions = { cse = false }\n')
    rec = recipe.load(r)
    assert rec.name == "mine" and rec.steps[0].options == {"cse": False}
    res = pipeline.optimize(mlp_path, OptimizeOptions(recipe=rec))
    assert res.ok and res.report.recipe == "mine"


def test_recipe_order_needs_checked(tmp_path):
    class Late(GraphoptPass):
        """Test-only: must run after cleanup."""

        name = "test-late"
        run_after = ("cleanup",)

        def call(self, model, ctx):
            return PassResult(model, False)

    registry.current().add(Late)  # the module's local registry (see _test_passes)
    with pytest.raises(UsageError, match="must run after 'cleanup'"):
        recipe.from_pass_list("test-late,cleanup").validate()
    recipe.from_pass_list("cleanup,test-late").validate()


def test_default_recipe_has_every_lossless_pass():
    names = set(recipe.default().pass_names())
    lossless = {n for n, c in registry.builtin().all().items() if c.exact and c.in_default_recipe}
    assert lossless <= names, f"default recipe misses {sorted(lossless - names)}"
    assert all(registry.get(n).exact for n in names)


def test_recipe_descriptions_say_their_steps():
    """A builtin recipe that says it starts with "the default recipe" runs the default recipe's steps first; the
    README names each recipe's lossless steps as the recipe runs them."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in recipe.builtin_names():
        for provider in ("cpu", "cuda"):
            r = recipe.load(name, provider=provider)
            steps = r.pass_names()
            if r.description.lower().startswith(("the default recipe", "the cuda default recipe")):
                base = recipe.load("default", provider=provider).pass_names()
                assert steps[: len(base)] == base, (name, provider, r.description)
        described = re.search(rf"`{re.escape(name)}` \(([^)]*)", " ".join(readme.split()))
        assert described, f"README does not describe the {name} recipe"
        text = described.group(1)
        steps, base = recipe.load(name).pass_names(), recipe.load("default").pass_names()
        if "the default recipe" in text:
            assert steps[: len(base)] == base, (name, text)
        elif name != "default" or "every lossless pass" not in text:
            lossless = [s for s in steps if registry.get(s).exact]
            for step in base:
                assert (f"`{step}`" in text) == (step in lossless), (name, step, text)


def test_verify_structure_level_skips_numerics(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-corrupt-weight", verify_level="structure"))
    assert res.ok  # structure cannot see a numeric bug; numeric level does (test above)
    assert "max_abs" not in res.report.passes[0].verification


def test_io_save_is_atomic_and_refuses_input(tmp_path, mlp_path):
    from graphopt.errors import ModelSaveError

    m = io.load(mlp_path)
    with pytest.raises(ModelSaveError, match="output path is the input path"):
        io.save(m, mlp_path, src=mlp_path)
    out = io.save(m, tmp_path / "x.onnx", src=mlp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx", "x.onnx"]  # no temp files left
    assert onnx.load(str(out)).graph.node


def test_external_data_roundtrip(tmp_path, mlp_path, monkeypatch):
    monkeypatch.setattr(io, "EXTERNAL_THRESHOLD", 16)
    m = io.load(mlp_path)
    out = io.save(m, tmp_path / "ext" / "m.onnx", external_data=True)
    assert (tmp_path / "ext" / "m.onnx.data").exists()
    m2 = io.load(out)
    # lazily mapped: the tensor is external until read
    assert any(isinstance(v.const_value, ir.ExternalTensor) for v in m2.graph.initializers.values())
    res = pipeline.optimize(out, OptimizeOptions(passes="cleanup"))
    assert res.ok
    # above the protobuf limit the saver switches to external data by itself
    monkeypatch.setattr(io, "PROTO_LIMIT", 100)
    out2 = io.save(res.model, tmp_path / "big" / "m.onnx")
    assert (tmp_path / "big" / "m.onnx.data").exists()
    (tmp_path / "big" / "m.onnx.data").unlink()
    from graphopt.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="external data file"):
        io.load(out2)


class NudgeWeights(GraphoptPass):
    """Test-only lossy pass: scales every float weight by (1 + eps); gives up above ``give_up``."""

    name = "test-nudge"
    exact = False
    default_budget = "cosine>=0.999"

    def __init__(self, *, eps: float = 1e-3, give_up: float = 1.0):
        super().__init__()
        self.eps = eps
        self.give_up = give_up

    def call(self, model, ctx):
        if self.eps > self.give_up:
            return PassResult(model, False, budget_met=False)
        rng = np.random.default_rng(0)
        for v in model.graph.initializers.values():
            t = v.const_value
            if t is not None and t.dtype == ir.DataType.FLOAT and t.size > 1:
                noise = 1 + self.eps * rng.standard_normal(t.shape.numpy())
                v.const_value = ir.tensor((t.numpy() * noise).astype(np.float32), name=v.name)
        return PassResult(model, True)


def test_lossy_pass_verified_against_budget(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-nudge", budget="cosine>=0.99"))
    rec = res.report.passes[0]
    assert res.ok and rec.status == "ok" and rec.verification["budget"] == "cosine>=0.99"
    assert 0 < rec.verification["max_abs"] and rec.verification["cosine"] >= 0.99
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-nudge", overrides=["test-nudge.eps=0.5"],
                                                      budget="cosine>=0.99"))
    assert not res.ok and res.report.passes[0].status == "rolled-back"
    assert "cosine>=0.99 not met" in res.report.passes[0].error


def test_lossy_pass_default_budget(mlp_path):
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-nudge"))
    assert res.ok and res.report.passes[0].verification["budget"] == "cosine>=0.999"
    res = pipeline.optimize(mlp_path, OptimizeOptions(passes="test-nudge", overrides=["test-nudge.eps=0.2"]))
    assert not res.ok  # the pass's own default budget still applies


def test_unmet_budget_fails_unless_keep_going(run_cli, mlp_path, tmp_path):
    out = tmp_path / "o.onnx"
    args = ("optimize", mlp_path, "-o", out, "--passes", "cleanup,test-nudge", "--set", "test-nudge.eps=0.5",
            "--set", "test-nudge.give_up=0.1", "-q", "--report", tmp_path / "r.json")
    code, stdout, err = run_cli(*args)
    assert code == 3 and not out.exists() and stdout == ""
    assert "error: pass 'test-nudge' budget-not-met" in err and "--keep-going" in err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [p["status"] for p in rep["passes"]] == ["ok", "budget-not-met"] and not rep["ok"]
    code, _, err = run_cli(*args, "--keep-going")
    assert code == 0 and out.exists()  # the best lossless model, and the report says so
    rep = json.loads((tmp_path / "r.json").read_text())
    assert any("kept as it was before 'test-nudge'" in n for n in rep["passes"][1]["notes"])
    assert "warning: pass 'test-nudge' budget-not-met" in err


def test_budget_with_only_lossless_passes_is_a_usage_error(run_cli, mlp_path, tmp_path):
    """--budget on a run of lossless passes only would be ignored: it is refused in one line (exit 2)."""
    code, _, err = run_cli("optimize", mlp_path, "-o", tmp_path / "o.onnx", "--budget", "cosine>=0.99")
    assert code == 2 and "only lossless" in err.splitlines()[0], err
    assert not (tmp_path / "o.onnx").exists()
    code, _, err = run_cli("optimize", mlp_path, "-o", tmp_path / "q.onnx", "--passes", "cleanup,quantize",
                           "--budget", "cosine>=0.9")
    assert code in (0, 3), err  # a lossy pass takes it

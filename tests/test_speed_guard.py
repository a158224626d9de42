"""The "never slower" guard of optimize (graphopt.engine.speed_guard).

A test-only lossless pass that routes the output through a chain of exact no-ops (MatMul by the
identity, ~30x the model's own cost) is timed, found slower and rolled back; a pass that removes such a
chain is kept; passes after a rolled-back one are re-run without it.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from testmodels import RenamesNodes

from graphopt import io
from graphopt.engine import pipeline, registry, speed_guard
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.registry import GraphoptPass, PassResult
from graphopt.errors import UsageError

N = 256
CHAIN = 12


def _eye_chain(model: ir.Model, value: ir.Value, n: int) -> ir.Value:
    eye = ir.Value(name=f"eye_{len(model.graph.initializers)}", const_value=ir.tensor(np.eye(N, dtype=np.float32)),
                   shape=ir.Shape([N, N]), type=ir.TensorType(ir.DataType.FLOAT))
    model.graph.register_initializer(eye)
    for _ in range(n):
        node = ir.node("MatMul", [value, eye], num_outputs=1)
        model.graph.append(node)
        value = node.outputs[0]
        value.dtype = ir.DataType.FLOAT
    return value


class SlowNoOps(GraphoptPass):
    """Test-only, exact but slow: the first output through a chain of MatMuls by the identity."""

    name = "test-slow-noops"

    def call(self, model, ctx):
        out = model.graph.outputs[0]
        relu = out.producer()
        pre = relu.inputs[0]
        end = _eye_chain(model, pre, CHAIN)
        relu.replace_input_with(0, end)
        model.graph.sort()
        return PassResult(model, True)


class DropsIdentityMatMuls(GraphoptPass):
    """Test-only, exact and fast: removes MatMuls by an identity matrix."""

    name = "test-drop-eye"

    def call(self, model, ctx):
        done = False
        for node in list(model.graph):
            w = node.inputs[1].const_value if node.op_type == "MatMul" else None
            if w is not None and w.shape[0] == w.shape[1] and np.array_equal(w.numpy(), np.eye(w.shape[0])):
                node.outputs[0].replace_all_uses_with(node.inputs[0])
                model.graph.remove(node, safe=True)
                done = True
        return PassResult(model, done)


@pytest.fixture(autouse=True)
def _test_passes():
    with registry.using(registry.with_builtins(SlowNoOps, DropsIdentityMatMuls, RenamesNodes)):
        yield


def _relu(tmp_path, chain: int = 0):
    """``y = Relu(x @ W)``, with ``chain`` MatMuls by the identity before the Relu."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((N, N)).astype(np.float32), "w"),
             numpy_helper.from_array(np.eye(N, dtype=np.float32), "eye")]
    nodes = [h.make_node("MatMul", ["x", "w"], ["a0"])]
    for k in range(chain):
        nodes.append(h.make_node("MatMul", [f"a{k}", "eye"], [f"a{k + 1}"]))
    nodes.append(h.make_node("Relu", [f"a{chain}"], ["y"]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", N])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["batch", N])], initializer=inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / f"relu{chain}.onnx"
    onnx.save(model, path)
    return path


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_a_slower_lossless_pass_is_rolled_back(tmp_path):
    res = pipeline.optimize(_relu(tmp_path), OptimizeOptions(passes="test-slow-noops,test-rename-nodes",
                                                                    speed_check="auto"))
    assert res.ok
    slow, tag = res.report.passes
    assert slow.status == "slower" and "rolled back" in " ".join(slow.notes)
    assert tag.status == "ok" and "re-run after a slower pass was rolled back" in tag.notes
    assert _ops(res.model) == ["MatMul", "Relu"]  # the chain is gone, the later pass kept
    assert [n.name for n in res.model.graph] == ["renamed_0", "renamed_1"]
    sp = res.report.speed
    assert sp["checked"] and sp["rolled_back"] == ["test-slow-noops"]
    # the chain costs ~30x the model, so the verdict before the rollback is robust; the figure after it times
    # the input against itself and is noise around 1.0 (its verdict, not slower, is what kept the later pass)
    assert sp["speedup_before_rollback"] < 0.5 and "the output is the input" not in sp.get("note", "")
    assert json.loads(res.report.to_json())["speed"]["rolled_back"] == ["test-slow-noops"]
    assert res.report.final["max_abs"] == 0.0


def test_a_faster_pass_is_kept(tmp_path):
    res = pipeline.optimize(_relu(tmp_path, chain=CHAIN), OptimizeOptions(passes="test-drop-eye", speed_check="auto"))
    assert res.ok and res.report.passes[0].status == "ok"
    assert _ops(res.model) == ["MatMul", "Relu"]
    assert res.report.speed["checked"] and res.report.speed["rolled_back"] == []
    assert res.report.speed["speedup"] > 2.0


def test_off_keeps_the_slower_model_and_cli_reports(tmp_path, run_cli):
    res = pipeline.optimize(_relu(tmp_path), OptimizeOptions(passes="test-slow-noops"))  # the API's default: off
    assert res.report.passes[0].status == "ok" and _ops(res.model).count("MatMul") == 1 + CHAIN
    assert res.report.speed == {}
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    code, text, err = run_cli("optimize", _relu(tmp_path), "-o", out, "--passes", "test-slow-noops",
                              "--speed-check", "on", "--report", rep)
    assert code == 0, err
    assert "speed check:" in text and "rolled back test-slow-noops" in text
    assert [n.op_type for n in io.load(out).graph] == ["MatMul", "Relu"]
    assert json.loads(rep.read_text())["passes"][0]["status"] == "slower"


def test_identical_models_are_not_slower(tmp_path):
    model = io.load(_relu(tmp_path))
    feeds = [{"x": np.random.default_rng(0).standard_normal((2, N)).astype(np.float32)}]
    t = speed_guard.time_pair(model, model.clone(), feeds)
    assert not t.slower and 0.5 < t.speedup < 2.0


def test_a_steady_microsecond_difference_is_not_slower():
    """Two sessions of one tiny model differ by a steady few percent; below MIN_SLOWER_S that is not slower."""
    assert not speed_guard.Timing([0.94] * 7, 8.6e-6, 9.1e-6).slower
    assert speed_guard.Timing([0.94] * 7, 1e-3, 1.06e-3).slower


def test_unknown_mode_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="unknown speed check"):
        pipeline.optimize(_relu(tmp_path), OptimizeOptions(passes="test-rename-nodes", speed_check="sometimes"))


def test_still_slower_after_the_rollback_gives_the_input_back(tmp_path, monkeypatch):
    """Every step lossless and the model still slower without the slower ones: the output is the input."""
    base, after_a, after_b = (io.load(_relu(tmp_path)) for _ in range(3))
    monkeypatch.setattr(speed_guard, "time_pair",
                        lambda a, b, feeds, **kw: speed_guard.Timing([0.5] * 7, 1.0, 2.0))  # always slower
    snaps = [speed_guard.Snapshot(0, "a", True, after_a), speed_guard.Snapshot(1, "b", True, after_b)]
    feeds = [{"x": np.zeros((1, N), np.float32)}]
    out = speed_guard.guard("on", base, after_b, snaps, feeds, lambda start, first, skip: (start, {}))
    assert out.model is base and sorted(out.rolled_back) == [0, 1]
    assert out.info["rolled_back"] == ["a", "b"] and "the output is the input model" in out.info["note"]

"""Edge feeds (graphopt.data.feeds.edge): lossless passes are verified at the corners of the input space.

A rewrite that drops an epsilon guard (``Log(x*x + 1e-10)`` -> ``Log(x*x)``) changes nothing on random
feeds and turns silence into -inf: verification with generated feeds catches it only through the
``zeros`` edge feed. Edge feeds a model refuses (ids past its table, lengths its graph cannot take) are
dropped, and lossy passes never see them.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from testmodels import RenamesNodes

from graphopt import io
from graphopt.data import feeds as feeds_mod
from graphopt.data.feeds import edge
from graphopt.engine import pipeline, registry
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.registry import GraphoptPass, PassResult
from graphopt.engine.verify import run_model


class DropsGuard(GraphoptPass):
    """Test-only, wrongly lossless: drops ``+ c`` when the constant ``c`` is within 1e-8 of zero."""

    name = "test-drop-guard"

    def call(self, model, ctx):
        for node in list(model.graph):
            c = node.inputs[1].const_value if node.op_type == "Add" and len(node.inputs) == 2 else None
            if c is not None and np.all(np.abs(c.numpy()) < 1e-8):
                node.outputs[0].replace_all_uses_with(node.inputs[0])
                model.graph.remove(node, safe=True)
                return PassResult(model, True)
        return PassResult(model, False)


@pytest.fixture(autouse=True)
def _test_passes():
    with registry.using(registry.with_builtins(DropsGuard, RenamesNodes)):
        yield


def _save(tmp_path, graph, name="m.onnx"):
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / name)
    return tmp_path / name


def _log_power(tmp_path):
    """``y = Log(x*x + 1e-10)`` over a [batch, samples] signal: finite on silence only thanks to the guard."""
    eps = numpy_helper.from_array(np.array(1e-10, np.float32), "eps")
    nodes = [h.make_node("Mul", ["x", "x"], ["p"]), h.make_node("Add", ["p", "eps"], ["q"]),
             h.make_node("Log", ["q"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", "samples"])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["batch", "samples"])], initializer=[eps])
    return _save(tmp_path, g)


def _ids_model(tmp_path, vocab=50):
    """ids into a ``vocab``-row table (ids >= vocab fail in ONNX Runtime), a mask, a conv over the length
    with kernel 3 (length 1 fails), a 32-row position table."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, 4)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "pos"),
             numpy_helper.from_array(rng.standard_normal((4, 4, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([-1], np.int64), "ax"),
             numpy_helper.from_array(np.array([0, 2, 1], np.int64), "perm")]
    nodes = [
        h.make_node("Gather", ["table", "input_ids"], ["e"]),
        h.make_node("Shape", ["input_ids"], ["shp"], start=1, end=2),
        h.make_node("Squeeze", ["shp"], ["n"]),
        h.make_node("Range", ["zero", "n", "one"], ["positions"]),
        h.make_node("Gather", ["pos", "positions"], ["pe"]),
        h.make_node("Add", ["e", "pe"], ["s"]),
        h.make_node("Cast", ["attention_mask"], ["m"], to=T.FLOAT),
        h.make_node("Unsqueeze", ["m", "ax"], ["m3"]),
        h.make_node("Mul", ["s", "m3"], ["sm"]),
        h.make_node("Transpose", ["sm"], ["t"], perm=[0, 2, 1]),
        h.make_node("Conv", ["t", "w"], ["c"]),
        h.make_node("Softmax", ["c"], ["y"], axis=-1),
    ]
    inits += [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")]
    ins = [h.make_tensor_value_info(n, T.INT64, ["batch", "sequence"]) for n in ("input_ids", "attention_mask")]
    g = h.make_graph(nodes, "g", ins, [h.make_tensor_value_info("y", T.FLOAT, [None, None, None])], initializer=inits)
    return _save(tmp_path, g)


def _optimize(path, passes, **kw):
    return pipeline.optimize(path, OptimizeOptions(passes=passes, **kw))


def test_a_dropped_epsilon_guard_is_caught_by_the_zeros_edge_feed(tmp_path):
    path = _log_power(tmp_path)
    # random feeds alone cannot see the guard: without edge feeds the broken rewrite passes
    blind = _optimize(path, "test-drop-guard", edge_feeds=False)
    assert blind.report.passes[0].status == "ok" and blind.report.edge_feeds == []
    assert blind.model.graph.num_nodes() == 2
    res = _optimize(path, "test-drop-guard")
    rec = res.report.passes[0]
    assert rec.status == "rolled-back"
    assert "edge feed 'zeros'" in rec.error and "NaN/Inf where the reference is finite" in rec.error
    assert "zeros" in rec.verification["edge"]["failed"] and "tiny" in rec.verification["edge"]["failed"]
    assert {"zeros", "ones", "tiny", "huge", "one-hot", "length 1"} <= set(res.report.edge_feeds)
    assert res.model.graph.num_nodes() == 3  # the guard is kept
    # the reference itself is finite on silence; the broken model is not
    feed = {"x": np.zeros((1, 4), np.float32)}
    assert np.isfinite(run_model(res.model, [feed])[0]["y"]).all()
    assert np.isneginf(run_model(blind.model, [feed])[0]["y"]).all()


def test_lossless_pass_passes_where_edge_feeds_the_model_refuses_are_dropped(tmp_path):
    path = _ids_model(tmp_path)
    model = io.load(path)
    sel = feeds_mod.select(model, edge=True)
    labels = sel.edge_labels
    # ids stay inside the table; length 1 cannot pass the kernel-3 conv, the longest is the position table
    assert {"ids 0", "ids max", "mask one token", "length 32"} <= set(labels) and "length 1" not in labels
    by_label = dict(zip(labels, sel.edge_feeds))
    assert int(by_label["ids max"]["input_ids"].max()) == 49
    assert by_label["length 32"]["input_ids"].shape == (1, 32)
    assert by_label["mask one token"]["attention_mask"].sum(axis=1).tolist() == [1, 1]
    res = _optimize(path, "test-rename-nodes")
    rec = res.report.passes[0]
    assert rec.status == "ok" and rec.verification["edge"] == {"feeds": len(labels), "max_abs": 0.0, "failed": []}


def test_candidates_respect_fixed_values_and_shapes(tmp_path):
    model = io.load(_log_power(tmp_path))
    base = {"x": np.ones((2, 8), np.float32)}
    assert not [lab for lab, _ in edge.candidates(model, base, values={"x": np.ones((2, 8), np.float32)})]
    labels = [lab for lab, f in edge.candidates(model, base, shapes={"x": [2, 8]})]
    assert "zeros" in labels and not any(lab.startswith("length") for lab in labels)
    assert "ones" not in labels  # equal to the base feed


def test_lossy_passes_do_not_calibrate_on_edge_feeds(tmp_path, monkeypatch):
    """A lossy pass gets the same calibration and held-back feeds with edge feeds on or off."""
    path = _log_power(tmp_path)
    seen = {}

    class Lossy(GraphoptPass):
        """Test-only lossy pass recording its feeds."""

        name = "test-lossy-record"
        exact = False

        def call(self, model, ctx):
            seen.setdefault("runs", []).append((len(ctx.calib_feeds), len(ctx.feeds),
                                                [f["x"].tobytes() for f in ctx.calib_feeds]))
            return PassResult(model, False)

    with registry.using(registry.with_builtins(Lossy)):
        _optimize(path, "test-lossy-record", edge_feeds=False)
        _optimize(path, "test-lossy-record")
    assert len(seen["runs"]) == 2 and seen["runs"][0] == seen["runs"][1]


def test_scaled_tolerance_on_huge_magnitudes():
    """On an edge feed the absolute tolerance scales with the output's largest magnitude."""
    from graphopt.data.metrics import Comparer

    ref = {"y": np.array([[1e6, 1e-3]], np.float32)}
    got = {"y": np.array([[1e6 + 64, 1e-3 + 50]], np.float32)}  # float32 rounding at 1e6 is 0.06
    plain, scaled = Comparer(atol=1e-4, rtol=1e-4), Comparer(atol=1e-4, rtol=1e-4, scale_atol=True)
    plain.add(got, ref)
    scaled.add(got, ref)
    assert not plain.result().within(1e-4, 1e-4) and scaled.result().within(1e-4, 1e-4)
    far = Comparer(atol=1e-4, rtol=1e-4, scale_atol=True)
    far.add({"y": np.array([[1e6, 1e-3 + 500]], np.float32)}, ref)
    assert not far.result().within(1e-4, 1e-4)


def test_scaled_tolerance_accepts_rounding_beside_large_values_only(tmp_path):
    # a decoder's logits: 1e-3 of rounding beside |logit| 30 passes with the scaled tolerance, not without it
    from graphopt.engine.verify import verify

    g = h.make_graph([h.make_node("Add", ["x", "c"], ["y"])], "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 2])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, 2])],
                     [numpy_helper.from_array(np.array([0.0, 1e-3], np.float32), "c")])
    model = io.load(_save(tmp_path, g))
    x = np.array([[30.0, 0.0]], np.float32)
    ref = [{"y": x.copy()}]
    assert not verify(model, level="numeric", feeds=[{"x": x}], reference=ref).ok
    assert verify(model, level="numeric", feeds=[{"x": x}], reference=ref, scale_atol=True).ok
    far = [{"y": np.array([[30.0, -0.01]], np.float32)}]  # 1e-2 off: beyond 1e-4 * 30 as well
    verdict = verify(model, level="numeric", feeds=[{"x": x}], reference=far, scale_atol=True)
    assert not verdict.ok and "max(1,|ref|max)" in verdict.reason

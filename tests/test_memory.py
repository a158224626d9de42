"""Bounded memory: numeric diff, verification and calibration stream feed by feed.

What is kept at once must not grow with the number of feeds, and the streamed numbers must be
exactly those of the all-at-once computation they replace.
"""

from __future__ import annotations

import gc
import importlib.util
import weakref
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from conftest import load_models_module
from graphopt.data import metrics, outputs
from graphopt.diff import diff_models, numeric, staged, structural
from graphopt.engine import pipeline
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model, verify
from graphopt.runtime import session as runtime

_spec = importlib.util.spec_from_file_location("diff_models", Path(__file__).with_name("diff_models.py"))
dm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dm)


def _ir(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


@pytest.fixture(scope="module")
def tiny_bert():
    """(A: the seeded tiny BERT export, B: A after cleanup,fuse,remove-padding) as onnx_ir models."""
    pytest.importorskip("torch", reason="torch is needed to export the tiny models")
    path = load_models_module("tiny").build("bert", "feature-extraction", exporter="dynamo")
    a = ir.load(path)
    b = pipeline.optimize(str(path), OptimizeOptions(passes="cleanup,fuse,remove-padding",
                                                     verify_level="structure")).model
    return a, b


def _bert_feeds(model: ir.Model, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` right-padded batches of 4 x 16 with different real lengths (so masks matter)."""
    rng = np.random.default_rng(seed)
    names = {v.name for v in model.graph.inputs}
    feeds = []
    for _ in range(n):
        lens = rng.integers(3, 17, size=4)
        mask = (np.arange(16)[None, :] < lens[:, None]).astype(np.int64)
        f = {"input_ids": (rng.integers(1, 1000, size=(4, 16)) * mask).astype(np.int64),
             "attention_mask": mask, "token_type_ids": np.zeros((4, 16), np.int64)}
        feeds.append({k: v for k, v in f.items() if k in names})
    return feeds


def _all_at_once(ma: ir.Model, mb: ir.Model, feeds, atol=1e-4, rtol=1e-4) -> metrics.Comparison:
    """The numeric diff's comparison as it was computed before streaming: every feed's intermediates kept."""
    pairs = numeric._pairs(structural.match_graphs(ma.graph, mb.graph))
    a_names = [va.name for va, _ in pairs]
    sa = runtime.make_session(numeric._with_outputs(ma, a_names), optimize=False)
    sb = runtime.make_session(numeric._with_outputs(mb, [vb.name for _, vb in pairs]), optimize=False)
    ra = runtime.run(sa, feeds, [o.name for o in sa.get_outputs()])
    rb = runtime.run(sb, feeds, [o.name for o in sb.get_outputs()])
    got = [{va.name: r[vb.name] for va, vb in pairs if vb.name in r} for r in rb]
    ref = [{va.name: r[va.name] for va, _ in pairs if va.name in r} for r in ra]
    return metrics.compare(got, ref, feeds, atol=atol, rtol=rtol, outputs=a_names)


def _no_whole_run(monkeypatch):
    """Fail if the numeric diff falls back to running a model whole (the staged run must suit these)."""
    def refuse(*a, **k):
        raise AssertionError("fell back to the whole-model run")
    monkeypatch.setattr(numeric, "_WholeRun", refuse)


def _assert_same(result: dict, expected: metrics.Comparison) -> None:
    assert result["compared"] == len([1 for _ in result["tensors"]]) > 0
    for t in result["tensors"]:
        d = expected.outputs[t["a"]]
        got = (t["max_abs"], t["max_rel"], t["cosine"], t["mismatch"], t["shape_mismatch"])
        assert got == (d.max_abs, d.max_rel, d.cosine, d.mismatch, d.shape_mismatch), t["a"]


def test_numeric_diff_streamed_equals_all_at_once_on_tiny_bert(tiny_bert, monkeypatch):
    """Fused + packed tiny BERT against its export on 5 masked feeds: every compared tensor's numbers
    are exactly those of the all-at-once computation (mask-aware, packed outputs included)."""
    a, b = tiny_bert
    feeds = _bert_feeds(a, 5)
    expected = _all_at_once(a, b, feeds)
    _no_whole_run(monkeypatch)
    monkeypatch.setattr(numeric, "GROUP", 4)  # small groups: several segments on this small pair
    r = diff_models(a, b, numeric=True, feeds=feeds).numeric
    assert r["feeds"] == 5
    _assert_same(r, expected)
    assert r["compared"] > 2 * numeric.GROUP  # several groups, so the model really ran in segments


@pytest.mark.parametrize("case", ["perturbed", "if"])
def test_numeric_diff_streamed_equals_all_at_once_small(case, monkeypatch):
    """Small hand-built pairs, incl. a model with If branches reading outer-scope values."""
    if case == "perturbed":
        a, b = _ir(dm.mlp_ln()), _ir(dm.mlp_ln(perturb="W2"))
    else:
        a, b = _ir(dm.with_if()), _ir(dm.with_if(then_extra=True))
    from graphopt.data import feeds as feeds_mod

    feeds = feeds_mod.generate(a, count=4)
    expected = _all_at_once(a, b, feeds)
    monkeypatch.setattr(numeric, "GROUP", 2)  # several segments even on a small graph
    _no_whole_run(monkeypatch)
    r = numeric.numeric_diff(a, b, structural.match_graphs(a.graph, b.graph), feeds=feeds)
    _assert_same(r, expected)
    if case == "perturbed":
        assert r["first_divergence"]["node_name"] == "mm2"


def _peak_live_tensors(monkeypatch, fn) -> int:
    """Most tensors handed to the comparison that were alive at once while ``fn`` ran."""
    refs: dict[int, weakref.ref] = {}
    peak = 0
    orig = metrics._Accumulator.add

    def add(self, got, ref, mask):
        nonlocal peak
        for arr in (got, ref):
            if isinstance(arr, np.ndarray) and (id(arr) not in refs or refs[id(arr)]() is not arr):
                refs[id(arr)] = weakref.ref(arr)
        peak = max(peak, sum(1 for r in refs.values() if r() is not None))
        return orig(self, got, ref, mask)

    with monkeypatch.context() as mp:
        mp.setattr(metrics._Accumulator, "add", add)
        fn()
    return peak


def test_numeric_diff_keeps_a_bounded_number_of_intermediates(tiny_bert, monkeypatch):
    """The tensors alive at once are one group's, whatever the number of feeds (all-at-once kept
    every intermediate of every feed: 8 feeds, 4x as many as 2)."""
    a, b = tiny_bert
    monkeypatch.setattr(numeric, "GROUP", 4)  # small groups: several segments on this small pair
    m = structural.match_graphs(a.graph, b.graph)
    peaks = {n: _peak_live_tensors(monkeypatch, lambda n=n: numeric.numeric_diff(a, b, m, feeds=_bert_feeds(a, n)))
             for n in (2, 8)}
    pairs = len(numeric._pairs(m))
    assert peaks[8] == peaks[2], peaks
    assert peaks[8] <= 3 * numeric.GROUP < 2 * pairs, (peaks, pairs)


def test_staged_run_matches_whole_model_outputs(tiny_bert):
    """Every value a staged run yields equals the whole model's value bit for bit."""
    a, _ = tiny_bert
    proto = ir.serde.serialize_model(a)
    names = [o.name for n in a.graph for o in n.outputs if o.name][::3]
    groups = [names[i:i + 5] for i in range(0, len(names), 5)]
    run = staged.StagedRun(proto, groups)
    assert sum(1 for s in run.segments if s.size) > 3
    whole = runtime.make_session(numeric._with_outputs(a, names), optimize=False)
    for feed in _bert_feeds(a, 2):
        ref = runtime.run(whole, [feed], names)[0]
        got = {}
        for grp, vals in zip(groups, run.run(feed), strict=True):
            assert set(vals) == set(grp)
            got.update(vals)
        for n in names:
            np.testing.assert_array_equal(got[n], ref[n], err_msg=n)


# ---------------------------------------------------------------- output store


def test_output_store_spills_and_round_trips(monkeypatch):
    rng = np.random.default_rng(0)
    items = [{"y": rng.standard_normal((4, 8)).astype(np.float32), "ids": np.arange(i + 1)} for i in range(6)]
    store = outputs.OutputStore(items, memory_bytes=300)  # room for about one feed
    assert len(store) == 6 and 4 <= store.spilled < 6
    folder = store._dir
    assert folder is not None and len(list(folder.iterdir())) == store.spilled
    for got, want in zip(store, items, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
            assert got[k].dtype == want[k].dtype
    view = store[2:5]
    assert len(view) == 3 and np.array_equal(view[0]["ids"], items[2]["ids"])
    assert np.array_equal(view[1:][1]["y"], items[4]["y"])
    del store
    gc.collect()
    assert folder.exists()  # the view keeps the files
    del view
    gc.collect()
    assert not folder.exists()


def test_run_model_memory_is_bounded(mlp_path, monkeypatch):
    """run_model keeps at most MEMORY_BYTES of outputs in memory; the rest goes to disk."""
    from graphopt.data import feeds as feeds_mod

    model = ir.load(mlp_path)
    feeds = feeds_mod.generate(model, count=6)
    monkeypatch.setattr(outputs, "MEMORY_BYTES", 0)
    out = run_model(model, feeds)
    assert isinstance(out, outputs.OutputStore) and out.spilled == 6
    in_memory = [x for x in out._items if isinstance(x, dict)]
    assert not in_memory
    monkeypatch.setattr(outputs, "MEMORY_BYTES", 1 << 30)
    again = run_model(model, feeds)
    assert again.spilled == 0
    for x, y in zip(out, again, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_verify_streams_against_a_spilled_reference(tiny_bert, monkeypatch):
    """verify() against a reference on disk gives exactly compare()'s numbers on plain lists."""
    a, b = tiny_bert
    feeds = _bert_feeds(a, 4)
    monkeypatch.setattr(outputs, "MEMORY_BYTES", 0)
    reference = run_model(a, feeds)
    assert reference.spilled == 4
    v = verify(b, level="numeric", feeds=feeds, reference=reference)
    assert v.ok, v.reason
    got = [dict(x) for x in run_model(b, feeds)]
    ref = [dict(x) for x in reference]
    assert v.comparison.as_dict() == metrics.compare(got, ref, feeds).as_dict()
    # the pipeline's held-back slice of the reference is a view, compared the same way
    v2 = verify(b, level="numeric", feeds=feeds[2:], reference=reference[2:])
    assert v2.comparison.as_dict() == metrics.compare(got[2:], ref[2:], feeds[2:]).as_dict()


def test_pipeline_report_unchanged_when_outputs_spill(tiny_bert, monkeypatch):
    """The default recipe with every output on disk reports the same numbers as with all in memory."""
    a, _ = tiny_bert
    feeds = _bert_feeds(a, 4)

    def numbers(mem):
        monkeypatch.setattr(outputs, "MEMORY_BYTES", mem)
        rep = pipeline.optimize(a.clone(), OptimizeOptions(feeds=feeds)).report
        assert rep.ok, [p.error for p in rep.passes]
        return [{k: v for k, v in p.verification.items() if k != "seconds"} for p in rep.passes], rep.final

    assert numbers(0) == numbers(1 << 30)


def test_comparer_in_parts_equals_compare():
    """Comparer fed one feed and one part of the outputs at a time == compare() on the lists."""
    rng = np.random.default_rng(1)
    feeds, got, ref = [], [], []
    for _ in range(3):
        mask = (np.arange(6)[None, :] < rng.integers(1, 7, size=(2, 1))).astype(np.int64)
        feeds.append({"attention_mask": mask})
        r = {"h": rng.standard_normal((2, 6, 4)), "l": rng.standard_normal((2, 5)), "i": rng.integers(0, 3, (2, 6))}
        ref.append(r)
        got.append({k: v + (rng.standard_normal(v.shape) * 1e-3 if v.dtype.kind == "f" else 0) for k, v in r.items()})
    names = ["h", "l", "i", "h"]
    c = metrics.Comparer(names)
    for g, r, f in zip(got, ref, feeds):
        c.add(g, r, f, names=["h", "l"])
        c.add(g, r, f, names=["i", "h"])
    assert c.result().as_dict() == metrics.compare(got, ref, feeds, outputs=names).as_dict()


# ---------------------------------------------------------------- calibration


def test_calibration_rows_bounded_with_many_feeds():
    """More feeds than sample_rows: the row sample stays at sample_rows (it grew one row per feed)."""
    from graphopt.rewrites.common import activations as _quant_calib

    x = ir.Value(name="x", shape=ir.Shape([None, 4]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node("Relu", [x], name="relu")
    node.outputs[0].name = "y"
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], opset_imports={"": 17})
    model = ir.Model(graph, ir_version=8)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((3, 4)).astype(np.float32)} for _ in range(40)]
    stats = _quant_calib.collect(model, feeds, ["y"], sample_rows=16)
    assert stats["y"].rows.shape == (16, 4)
    assert stats["y"].n_rows == 120
    few = _quant_calib.collect(model, feeds[:4], ["y"], sample_rows=16)
    assert few["y"].rows.shape == (12, 4)  # 4 per feed, all 3 rows of each: as before

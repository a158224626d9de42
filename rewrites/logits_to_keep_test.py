"""Tests of ``logits-to-keep``: the optional input that keeps the logits of the last N positions only."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import summed_head

from conftest import load_models_module
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.engine.registry import PassContext, create
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import Decoder, generate
from graphopt.generate.sampling import GREEDY
from graphopt.generate.scheduler import Scheduler, Sequence
from graphopt.rewrites.logits_to_keep import INPUT
from graphopt.runtime.session import make_session

pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny models are exported with torch")


@pytest.fixture(scope="module")
def tiny():
    return load_models_module("tiny")


@pytest.fixture(scope="module")
def decoder(tiny):
    """The tiny Llama through the decoder recipe (logits-to-keep its last step)."""
    result = optimize(tiny.build("llama", "causal-lm-with-past"), OptimizeOptions())
    assert result.ok and {p.name: p.status for p in result.report.passes}["logits-to-keep"] == "ok"
    return result.model


def _feeds(sess, ids):
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32)
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int64)
    return feeds


def test_the_input_defaults_to_all_positions_and_keeps_the_last_ones(decoder):
    sess = make_session(decoder)
    assert INPUT in {i.name for i in sess.get_overridable_initializers()}
    assert INPUT not in {i.name for i in sess.get_inputs()}  # callers that do not know it need not feed it
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 1000, (2, 9)).astype(np.int64)
    feeds = _feeds(sess, ids)
    full = sess.run(["logits"], feeds)[0]
    assert full.shape[:2] == (2, 9) and np.isfinite(full).all()
    for keep, want in ((0, 9), (1, 1), (4, 4), (9, 9), (50, 9)):
        got = sess.run(["logits"], {**feeds, INPUT: np.array(keep, np.int64)})[0]
        assert got.shape[1] == want, keep
        np.testing.assert_allclose(got, full[:, 9 - want:], rtol=1e-4, atol=1e-5)


def test_the_runtime_asks_a_prefill_for_the_last_position_and_tokens_are_unchanged(decoder):
    dec = Decoder(make_session(decoder))
    assert dec.sig.logits_to_keep
    plain = Decoder(dec.session, dataclasses.replace(dec.sig, logits_to_keep=False))  # feeds nothing: all positions
    ids = np.arange(3, 15, dtype=np.int64)[None]
    cache = KVCache(dec.sig, 1, 16)
    dec.step(cache, ids, np.ones_like(ids), None)
    assert dec._binding.get_outputs()[0].shape()[1] == 1  # the head ran on one position
    cache = KVCache(dec.sig, 1, 16)
    assert dec.step(cache, ids, np.ones_like(ids), None, all_positions=True).shape[1] == 12
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (1, 7, 3, 12, 5)]
    ours, ref = (generate(d, prompts, max_new_tokens=9) for d in (dec, plain))
    assert ours.token_ids == ref.token_ids  # a right-padded batch: each row read at its own last position
    for p, row in zip(prompts, ours.token_ids):
        assert generate(dec, p, max_new_tokens=9).token_ids == row


def test_the_scheduler_prefills_right_padded_newcomers_the_same(decoder):
    dec = Decoder(make_session(decoder))
    plain = Decoder(dec.session, dataclasses.replace(dec.sig, logits_to_keep=False))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (2, 11, 6, 1)]
    got = []
    for d in (dec, plain):
        sched = Scheduler(d, slots=4, context=64)
        seqs = [Sequence(list(p), 7, GREEDY, frozenset()) for p in prompts]
        sched.waiting.extend(seqs)
        while not sched.idle:
            sched.step()
        got.append([s.tokens for s in seqs])
    assert got[0] == got[1] and all(len(t) == 7 for t in got[0])


def test_declines_without_past_without_a_head_or_twice(tiny, decoder):
    p = create("logits-to-keep")
    enc = optimize(tiny.build("bert", "feature-extraction"), OptimizeOptions(passes="cleanup")).model
    res = p(enc, PassContext())
    assert not res.modified and "no past_key_values" in res.notes[0]
    again = p(decoder.clone(), PassContext())
    assert not again.modified and "already has" in again.notes[0]
    # logits made by a Softmax of the head: not position-wise with constants, declined, graph unchanged
    src = optimize(tiny.build("llama", "causal-lm-with-past"), OptimizeOptions(passes="cleanup")).model
    out = next(o for o in src.graph.outputs if o.name == "logits")
    head = out.producer()
    inner = ir.Value(name="logits.raw", type=out.type, shape=out.shape)
    head.outputs[0].name = "logits.pre"
    soft = ir.node("Softmax", [head.outputs[0]], attributes={"axis": -1}, outputs=[inner])
    src.graph.append(soft)
    src.graph.outputs[list(src.graph.outputs).index(out)] = inner
    inner.name = "logits"
    n = len(list(src.graph))
    res = p(src, PassContext())
    assert not res.modified and "Softmax" in res.notes[0] and len(list(src.graph)) == n


def test_a_head_summed_from_two_kernels_is_sliced_once_for_both(tiny):
    """q8-tables' tied head is the Add of two 4-bit kernels over one hidden state: both read the kept rows."""
    src = optimize(tiny.build("llama", "causal-lm-with-past"), OptimizeOptions(passes="cleanup")).model
    assert next(o for o in src.graph.outputs if o.name == "logits").producer().op_type == "MatMul"
    summed_head(src, seed=3)
    before = make_session(src.clone())
    res = create("logits-to-keep")(src, PassContext())
    assert res.modified, res.notes
    assert "head_part0" in res.notes[0] and "head_part1" in res.notes[0]
    cut = next(n for n in src.graph if n.name == "logits_to_keep/Slice")
    assert {n.name for n in cut.outputs[0].consumers()} == {"head_part0", "head_part1"}
    sess = make_session(src)
    ids = np.random.default_rng(4).integers(3, 1000, (2, 7)).astype(np.int64)
    feeds = _feeds(sess, ids)
    full = before.run(["logits"], feeds)[0]
    np.testing.assert_allclose(sess.run(["logits"], feeds)[0], full, rtol=1e-4, atol=1e-5)
    last = sess.run(["logits"], {**feeds, INPUT: np.array(1, np.int64)})[0]
    assert last.shape[1] == 1
    np.testing.assert_allclose(last, full[:, -1:], rtol=1e-4, atol=1e-5)

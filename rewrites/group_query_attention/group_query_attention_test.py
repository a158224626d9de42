"""Tests of group-query-attention: the tiny Llama with past through the decoder recipe (op counts, numeric
parity, greedy tokens = transformers and the export, a mixed-length batch = each row alone, the shared KV
buffer), Q/K/V from a Split of one MatMul, and the refusals."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.engine.registry import PassContext
from graphopt.generate.batch import Batch
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import generate, open_decoder
from graphopt.rewrites.group_query_attention import GroupQueryAttentionPass
from graphopt.runtime.session import make_session

pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny models are exported with torch")

MS = "com.microsoft"
EOS = 2
PROMPTS = [[5, 17, 99, 3, 250, 7], [901, 44, 12], [1, 600, 601, 602, 603, 604, 605, 606, 607], [8]]


@pytest.fixture(scope="module")
def tiny():
    return load_models_module("tiny")


@pytest.fixture(scope="module")
def llama(tiny, tmp_path_factory):
    """(export path, decoder-recipe result, optimized path) of the tiny Llama with past."""
    src = tiny.build("llama", "causal-lm-with-past")
    result = optimize(src, OptimizeOptions())
    out = tmp_path_factory.mktemp("gqa") / "llama.gqa.onnx"
    io.save(result.model, out)
    return src, result, out


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)


def _fused(src) -> ir.Model:
    """The export after cleanup and fuse (what the pass matches)."""
    return optimize(src, OptimizeOptions(passes="cleanup,fuse")).model


def test_decoder_recipe_is_the_default_and_rewrites_every_layer(llama):
    _, result, _ = llama
    assert result.report.recipe == "decoder" and result.ok
    statuses = {p.name: p.status for p in result.report.passes}
    assert statuses == {"cleanup": "ok", "fuse": "ok", "group-query-attention": "ok", "merge-projections": "ok",
                        "implied-zero-points": "ok", "logits-to-keep": "ok"}, statuses
    ops = _ops(result.model)
    assert ops[f"{MS}::GroupQueryAttention"] == 2
    for gone in (f"{MS}::MultiHeadAttention", f"{MS}::RotaryEmbedding", "Expand", "Concat"):
        assert ops[gone] == 0, (gone, ops)
    graph = result.model.graph
    for out in graph.outputs:
        if out.name.startswith("present."):
            assert out.producer().op_type == "GroupQueryAttention", out.name
    pasts = [v for v in graph.inputs if v.name.startswith("past_key_values.")]
    assert all({n.op_type for n, _ in v.uses()} == {"GroupQueryAttention"} for v in pasts)
    gqa = next(n for n in graph if n.op_type == "GroupQueryAttention")
    assert gqa.attributes.get_int("do_rotary") == 1 and gqa.attributes.get_int("kv_num_heads") == 2
    assert gqa.inputs[7].const_value is not None and gqa.inputs[7].const_value.shape == (4096, 8)
    assert result.model.metadata_props["graphopt.kv_cache"] == "shared-buffer"
    rec = next(p for p in result.report.passes if p.name == "group-query-attention")
    assert rec.verification and "max_abs" in rec.verification


def test_outputs_match_the_export_on_contract_feeds(llama):
    """Prefill of two rows, a decode step of two rows after a past, a 5-token step of one row after a past,
    and a right-padded prefill compared on its real tokens: logits and presents within 1e-4."""
    src, _, out = llama
    ref, got = make_session(src, optimize=False), make_session(out, optimize=False)
    rng = np.random.default_rng(0)
    names = [o.name for o in ref.get_outputs()]
    for b, s, p in ((2, 7, 0), (2, 1, 6), (1, 5, 6)):
        feed = {"input_ids": rng.integers(1, 1000, (b, s)), "attention_mask": np.ones((b, p + s), np.int64)}
        for i in range(2):
            for kind in ("key", "value"):
                feed[f"past_key_values.{i}.{kind}"] = rng.standard_normal((b, 2, p, 16)).astype(np.float32)
        for name, x, y in zip(names, ref.run(None, feed), got.run(None, feed)):
            np.testing.assert_allclose(y, x, atol=1e-4, rtol=0, err_msg=f"{name} b={b} s={s} past={p}")
    lengths = np.array([7, 4])
    mask = (np.arange(7)[None] < lengths[:, None]).astype(np.int64)
    feed = {"input_ids": rng.integers(1, 1000, (2, 7)), "attention_mask": mask}
    feed.update({f"past_key_values.{i}.{k}": np.zeros((2, 2, 0, 16), np.float32) for i in range(2)
                 for k in ("key", "value")})
    x, y = ref.run(["logits"], feed)[0], got.run(["logits"], feed)[0]
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(y[row, :n], x[row, :n], atol=1e-4, rtol=0)


def _hf_greedy(folder, prompt, max_new):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=EOS,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_transformers_and_the_export(tiny, llama):
    src, _, out = llama
    folder = tiny.build_folder("llama", "causal-lm-with-past")
    base, fast = open_decoder(src), open_decoder(out)
    assert fast.sig.shared_buffer and not base.sig.shared_buffer
    for prompt in PROMPTS:
        want = _hf_greedy(folder, prompt, 24)
        assert generate(fast, prompt, max_new_tokens=24).token_ids == want, prompt
        assert generate(base, prompt, max_new_tokens=24).token_ids == want, prompt


def test_mixed_length_batch_is_one_run_and_equals_each_row_alone(llama):
    _, _, out = llama
    dec = open_decoder(out)
    alone = [generate(dec, p, max_new_tokens=20).token_ids for p in PROMPTS]
    runs = []
    real = dec.step
    dec.step = lambda *a, **k: runs.append(a[1].shape) or real(*a, **k)  # count the batched runs
    together = generate(dec, PROMPTS, max_new_tokens=20)
    assert together.token_ids == alone
    assert runs[0] == (len(PROMPTS), max(map(len, PROMPTS))) and len(runs) == 20  # one prefill, 19 decode steps
    b = Batch.of(PROMPTS)
    assert b.input_ids(right=True)[1].tolist() == [901, 44, 12] + [0] * 6
    assert b.attention_mask(right=True, extra=2)[3].tolist() == [1, 1, 1] + [0] * 8


def test_the_cache_is_one_buffer_bound_as_past_and_present(llama):
    """The present is written into the past's buffer: after a prefill and a decode step the buffer holds
    the export's presents at the real positions; rollback moves only the length."""
    src, _, out = llama
    dec, ref = open_decoder(out), make_session(src, optimize=False)
    prompt = np.array([PROMPTS[0]], np.int64)
    cache = KVCache(dec.sig, 1, 10)
    buffers = [id(b) for b in cache._shared]
    logits = dec.step(cache, prompt, np.ones((1, 6), np.int64), None)
    tok = int(np.argmax(logits))
    dec.step(cache, np.array([[tok]]), np.ones((1, 7), np.int64), None)
    assert [id(b) for b in cache._shared] == buffers and cache.length == 7
    feed = {"input_ids": np.concatenate([prompt, [[tok]]], 1), "attention_mask": np.ones((1, 7), np.int64)}
    feed.update({f"past_key_values.{i}.{k}": np.zeros((1, 2, 0, 16), np.float32) for i in range(2)
                 for k in ("key", "value")})
    want = dict(zip([o.name for o in ref.get_outputs()], ref.run(None, feed)))
    for (past, present), buf in zip(dec.sig.cache_names, cache._shared):
        np.testing.assert_allclose(buf[:, :, :7], want[present], atol=1e-4)
        assert cache.past()[past].shape == (1, 2, 7, 16)
    cache.rollback(3)
    assert cache.length == 3 and [id(b) for b in cache._shared] == buffers
    with pytest.raises(Exception, match="at most 4096 positions"):
        KVCache(dec.sig, 1, 5000)


def _split_qkv(model: ir.Model) -> int:
    """Replace each layer's three q/k/v MatMuls on one input by one MatMul on their concatenated weights and
    a Split (the merge-projections form); returns how many layers were changed."""
    done = 0
    by_input = collections.defaultdict(list)
    for n in model.graph:
        if n.op_type == "MatMul" and n.inputs[1].const_value is not None:
            by_input[id(n.inputs[0])].append(n)
    for group in by_input.values():
        if len(group) != 3:
            continue
        ws = [n.inputs[1].const_value.numpy() for n in group]
        w = ir.Value(name=f"qkv_w_{done}", const_value=ir.tensor(np.concatenate(ws, 1), name=f"qkv_w_{done}"))
        model.graph.register_initializer(w)
        mm = ir.node("MatMul", [group[0].inputs[0], w])
        sizes = ir.Value(name=f"qkv_sizes_{done}", const_value=ir.tensor(np.array([x.shape[1] for x in ws], np.int64)))
        model.graph.register_initializer(sizes)
        split = ir.node("Split", [mm.outputs[0], sizes], attributes={"axis": -1}, num_outputs=3)
        model.graph.insert_before(group[0], [mm, split])
        for old, new in zip(group, split.outputs):
            new.shape, new.type = old.outputs[0].shape, old.outputs[0].type
            old.outputs[0].replace_all_uses_with(new)
            model.graph.remove(old, safe=True)
        done += 1
    return done


def test_q_k_v_from_a_split_of_one_matmul(llama):
    src, _, _ = llama
    model = _fused(src)
    assert _split_qkv(model) == 2
    reference = model.clone()
    res = GroupQueryAttentionPass()(model, PassContext())
    assert res.modified and _ops(model)[f"{MS}::GroupQueryAttention"] == 2
    assert _ops(model)["Split"] == 2
    feed = {"input_ids": np.array([[5, 17, 99], [3, 4, 5]]), "attention_mask": np.ones((2, 3), np.int64)}
    feed.update({f"past_key_values.{i}.{k}": np.zeros((2, 2, 0, 16), np.float32) for i in range(2)
                 for k in ("key", "value")})
    want = make_session(reference, optimize=False).run(["logits"], feed)[0]
    got = make_session(model, optimize=False).run(["logits"], feed)[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _refused(model: ir.Model, why: str) -> None:
    before = _ops(model)
    res = GroupQueryAttentionPass()(model, PassContext())
    assert not res.modified and _ops(model) == before
    assert any(why in n for n in res.notes), res.notes


def test_refuses_a_decoder_without_past(tiny):
    _refused(_fused(tiny.build("llama", "causal-lm")), "no past_key_values")


def test_refuses_gpt2_no_rotary(tiny):
    _refused(_fused(tiny.build("gpt2", "causal-lm-with-past")), "no RotaryEmbedding")


def test_refuses_partial_and_mismatched_rotary(llama):
    src, _, _ = llama
    model = _fused(src)
    rot = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    key_rot = next(n for n in rot if n.outputs[0].shape is not None and n.outputs[0].shape.rank() == 4)
    key_rot.attributes["interleaved"] = ir.AttrInt64("interleaved", 1)
    _refused(model, "differ in interleaving")
    model = _fused(src)
    for n in model.graph:
        if n.op_type == "RotaryEmbedding":
            n.attributes["rotary_embedding_dim"] = ir.AttrInt64("rotary_embedding_dim", 8)
    _refused(model, "partial rotary")


def test_refuses_a_mask_that_is_not_causal_padding(llama):
    """A bias that lets every query see every key (no causal part) is found by running it."""
    src, _, _ = llama
    model = _fused(src)
    zero = ir.Value(name="zero_bias", const_value=ir.tensor(np.zeros((1, 1, 1, 1), np.float32)))
    model.graph.register_initializer(zero)
    for i, n in enumerate(n for n in list(model.graph) if n.op_type == "MultiHeadAttention"):
        mul = ir.node("Mul", [n.inputs[5], zero], name=f"no_causal_{i}")
        mul.outputs[0].name = f"no_causal_bias_{i}"
        model.graph.insert_before(n, mul)
        n.replace_input_with(5, mul.outputs[0])
    _refused(model, "not the causal + padding mask")


def test_refuses_float32_on_cuda(llama):
    src, _, _ = llama
    model = _fused(src)
    res = GroupQueryAttentionPass()(model, PassContext(provider="cuda"))
    assert not res.modified and "fp16/bf16" in res.notes[0]


def test_verification_feeds_keep_the_contract(llama):
    """Generated feeds of a decoder with past: a prefill, a decode step, a one-row chunk after a past; full
    masks; the past is the model's own presents of a prefill (not random values)."""
    from graphopt.data.feeds.probe import runnable

    src, _, _ = llama
    model = ir.load(src)
    feeds, _ = runnable(model)
    shapes = [(f["input_ids"].shape, f["past_key_values.0.key"].shape[2]) for f in feeds]
    assert shapes == [((2, 16), 0), ((2, 1), 8), ((1, 16), 8)]
    assert all(f["attention_mask"].all() for f in feeds)
    sess = make_session(src, optimize=False)
    f = feeds[1]
    pre = {"input_ids": np.resize(f["input_ids"], (2, 8)), "attention_mask": np.ones((2, 8), np.int64)}
    pre.update({k: v[:, :, :0] for k, v in f.items() if k.startswith("past_key_values.")})
    present = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, pre)))
    np.testing.assert_array_equal(f["past_key_values.1.value"], present["present.1.value"])

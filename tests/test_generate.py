"""The generation runtime: greedy parity with transformers, batches, sampling, the KV cache, the signature."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import load_models_module
from graphopt.errors import UsageError
from graphopt.generate.batch import Batch
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import Decoder, generate, open_decoder
from graphopt.generate.sampling import Sampler, Sampling
from graphopt.generate.signature import read_signature

pytest.importorskip("onnxruntime")
FAMILIES = ["llama", "gpt2"]
EOS = 2  # models/tiny.py: eos_token_id
PROMPTS = [[5, 17, 99, 3, 250, 7], [901, 44, 12], [1, 600, 601, 602, 603, 604, 605, 606, 607]]


@pytest.fixture(scope="module")
def tiny():
    return load_models_module("tiny")


@pytest.fixture(scope="module", params=FAMILIES)
def decoder(request, tiny):
    """(family, Decoder over the family's causal-lm-with-past export)."""
    return request.param, open_decoder(tiny.build(request.param, "causal-lm-with-past"))


def _hf_greedy(folder, prompt, max_new, *, ignore_eos):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    kwargs = {"min_new_tokens": max_new} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0, **kwargs)
    new = out[0, len(prompt):].tolist()
    return new[:new.index(EOS) + 1] if EOS in new else new


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_tokens_equal_transformers_generate(tiny, decoder, ignore_eos):
    pytest.importorskip("torch")
    family, dec = decoder
    folder = tiny.build_folder(family, "causal-lm-with-past")
    sampling = Sampling().masking([EOS]) if ignore_eos else Sampling()
    for prompt in PROMPTS:
        got = generate(dec, prompt, max_new_tokens=20, sampling=sampling, stop_ids=[] if ignore_eos else [EOS])
        want = _hf_greedy(folder, prompt, 20, ignore_eos=ignore_eos)
        assert got.token_ids == want, (family, prompt)
        if ignore_eos:
            assert len(got.token_ids) == 20 and got.finish == "length"


def test_batch_rows_equal_alone(decoder):
    _, dec = decoder
    alone = [generate(dec, p, max_new_tokens=16, stop_ids=[EOS]).token_ids for p in PROMPTS]
    batched = generate(dec, PROMPTS, max_new_tokens=16, stop_ids=[EOS])
    assert batched.rows == alone
    assert batched.prompt_ids == PROMPTS and len(batched.finish) == 3


def test_equal_length_rows_share_one_run(decoder):
    _, dec = decoder
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14]]
    assert Batch.of(prompts).groups(dec.sig.has_position_ids) == [[0, 1], [2]]
    alone = [generate(dec, p, max_new_tokens=8).token_ids for p in prompts]
    assert generate(dec, prompts, max_new_tokens=8).rows == alone


def test_batch_left_padding_and_positions():
    b = Batch.of([[5, 6, 7], [8]], pad_id=0)
    assert b.input_ids().tolist() == [[5, 6, 7], [0, 0, 8]]
    assert b.attention_mask().tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b.position_ids().tolist() == [[0, 1, 2], [0, 0, 0]]
    assert b.groups(True) == [[0, 1]] and b.groups(False) == [[0], [1]]
    with pytest.raises(UsageError, match="empty"):
        Batch.of([[1], []])


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(decoder):
    _, dec = decoder
    prompt = PROMPTS[0]
    s = Sampling(temperature=1.0, top_p=0.95, seed=7)
    a = generate(dec, prompt, max_new_tokens=16, sampling=s).token_ids
    assert generate(dec, prompt, max_new_tokens=16, sampling=s).token_ids == a
    others = [generate(dec, prompt, max_new_tokens=16, sampling=Sampling(temperature=1.0, seed=k)).token_ids
              for k in range(3)]
    assert len({tuple(o) for o in others}) > 1  # the seed matters
    greedy = generate(dec, prompt, max_new_tokens=16).token_ids
    top1 = generate(dec, prompt, max_new_tokens=16, sampling=Sampling(temperature=1.5, top_k=1, seed=3)).token_ids
    assert top1 == greedy


def test_sampler_masks_and_truncates():
    logits = np.array([[0.0, 5.0, 4.9, -1.0]])
    assert Sampler(Sampling())(logits).tolist() == [1]
    assert Sampler(Sampling(masked=frozenset({1})))(logits).tolist() == [2]
    draws = Sampler(Sampling(temperature=1.0, top_k=2, seed=0))
    assert {int(draws(logits)[0]) for _ in range(200)} == {1, 2}
    assert {int(Sampler(Sampling(temperature=1.0, top_p=1e-6, seed=s))(logits)[0]) for s in range(20)} == {1}
    with pytest.raises(UsageError, match="every token is masked"):
        Sampler(Sampling(masked=frozenset(range(4))))(logits)
    with pytest.raises(UsageError, match="top-p"):
        Sampling(top_p=0)


def test_cache_rolls_back_by_length_and_redecodes_the_same_tokens(decoder):
    _, dec = decoder
    prompt = np.array([PROMPTS[2]], np.int64)
    n, steps = prompt.shape[1], 8
    cache = KVCache(dec.sig, 1, n + steps + 1)
    mask = np.ones((1, n), np.int64)

    def pos(length, new):
        return np.arange(length, length + new, dtype=np.int64)[None, :]

    tokens = [int(np.argmax(dec.step(cache, prompt, mask, pos(0, n))))]
    kept = None
    for _ in range(steps):
        if cache.length == n + 3:
            kept = {k: v.copy() for k, v in cache.past().items()}
        mask = np.ones((1, cache.length + 1), np.int64)
        tokens.append(int(np.argmax(dec.step(cache, np.array([[tokens[-1]]]), mask, pos(cache.length, 1)))))
    assert cache.length == n + steps
    cache.rollback(n + 3)
    assert cache.length == n + 3
    for k, v in cache.past().items():
        np.testing.assert_array_equal(v, kept[k])
    again = tokens[:4]
    while len(again) < len(tokens):
        mask = np.ones((1, cache.length + 1), np.int64)
        again.append(int(np.argmax(dec.step(cache, np.array([[again[-1]]]), mask, pos(cache.length, 1)))))
    assert again == tokens
    with pytest.raises(UsageError, match="cannot roll"):
        cache.rollback(cache.length + 1)
    with pytest.raises(UsageError, match="do not fit"):
        cache.bind(dec.session.io_binding(), cache.free + 1)


def test_a_multi_token_step_checks_drafts_and_rolls_back(decoder):
    """Speculative decoding's verify step: the drafted tokens in one step give the greedy tokens at every
    position; the rejected tail is rolled back and decoding goes on as before."""
    _, dec = decoder
    prompt = PROMPTS[0]
    greedy = generate(dec, prompt, max_new_tokens=8).token_ids
    n = len(prompt)
    cache = KVCache(dec.sig, 1, n + 8)
    ids = np.array([prompt], np.int64)
    first = int(np.argmax(dec.step(cache, ids, np.ones((1, n), np.int64), np.arange(n)[None])))
    drafts = [first, *greedy[1:4]]
    logits = dec.step(cache, np.array([drafts]), np.ones((1, n + 4), np.int64), np.arange(n, n + 4)[None],
                      all_positions=True)
    assert logits.shape[:2] == (1, 4) and np.argmax(logits[0], axis=-1).tolist() == greedy[1:5]
    cache.rollback(n + 2)  # keep the prompt and two drafts: the next input is the third
    nxt = dec.step(cache, np.array([[drafts[2]]]), np.ones((1, n + 3), np.int64), np.array([[n + 2]]))
    assert int(np.argmax(nxt)) == greedy[3]


def test_generation_stops_at_stop_ids_and_the_model_maximum(decoder):
    _, dec = decoder
    prompt = PROMPTS[0]
    free = generate(dec, prompt, max_new_tokens=16).token_ids
    stop = generate(dec, prompt, max_new_tokens=16, stop_ids=[free[3]])
    assert stop.token_ids == free[:free.index(free[3]) + 1] and stop.finish == "stop"
    capped = generate(dec, prompt, max_new_tokens=16, max_length=len(prompt) + 5)
    assert capped.token_ids == free[:5]  # as transformers: prompt and new tokens within max_length
    with pytest.raises(UsageError, match="takes at most 4"):
        generate(dec, prompt, max_new_tokens=4, max_length=4)
    with pytest.raises(UsageError, match="vocabulary"):
        generate(dec, [5, 10**6], max_new_tokens=4)


def test_timings(decoder):
    _, dec = decoder
    g = generate(dec, PROMPTS[0], max_new_tokens=10, sampling=Sampling().masking([EOS]))
    assert g.prefill_ms > 0 and g.decode_tokens_per_s > 0
    assert set(g.as_dict()) == {"prompt_ids", "token_ids", "finish", "prefill_ms", "decode_tokens_per_s"}
    assert generate(dec, PROMPTS[0], max_new_tokens=1).decode_tokens_per_s is None


def test_signature_of_the_exports(tiny):
    sig = read_signature(open_decoder(tiny.build("llama", "causal-lm-with-past")).session)
    assert (sig.layers, sig.kv_heads, sig.head_dim, sig.dtype) == (2, 2, 16, np.float32)
    assert sig.past_names[1] == ("past_key_values.1.key", "past_key_values.1.value")
    assert sig.present_names[0] == ("present.0.key", "present.0.value")
    assert not sig.has_position_ids and sig.logits_all_positions and sig.vocab == 1000


def test_signature_refuses_a_decoder_without_past(tiny):
    import onnxruntime as ort

    path = tiny.build("llama", "causal-lm")
    with pytest.raises(UsageError, match="not a decoder with past: no past_key_values"):
        Decoder(ort.InferenceSession(str(path)), name=str(path))
    with pytest.raises(UsageError, match="no such file"):
        generate(path.parent / "missing.onnx", [1], max_new_tokens=1)


class _Arg:
    def __init__(self, name, shape, type_="tensor(float)"):
        self.name, self.shape, self.type = name, shape, type_


def _io(*, logits=("batch", "sequence", 1000), kv=(2, 16), ids="tensor(int64)", present=True, extra=()):
    ins = [_Arg("input_ids", ["batch", "sequence"], ids), _Arg("attention_mask", ["batch", "total"], "tensor(int64)"),
           _Arg("past_key_values.0.key", ["batch", kv[0], "past", kv[1]]),
           _Arg("past_key_values.0.value", ["batch", kv[0], "past", kv[1]]), *extra]
    outs = [_Arg("logits", list(logits)), _Arg("present.0.key", ["batch", kv[0], "total", kv[1]])]
    if present:
        outs.append(_Arg("present.0.value", ["batch", kv[0], "total", kv[1]]))
    return ins, outs


@pytest.mark.parametrize("kwargs, why", [
    ({"present": False}, "input 'past_key_values.0.value' has no output 'present.0.value'"),
    ({"kv": ("kv_heads", 16)}, "kv_heads and head_dim must be static"),
    ({"ids": "tensor(int32)"}, "'input_ids' is tensor(int32)"),
    ({"extra": [_Arg("token_type_ids", ["batch", "sequence"], "tensor(int64)")]}, "unexpected input 'token_type_ids'"),
    ({"logits": ("batch",)}, "'logits' has rank 1"),
])
def test_signature_refusals(kwargs, why):
    with pytest.raises(UsageError, match="not a decoder with past: " + re.escape(why)):
        read_signature(*_io(**kwargs))


def test_signature_logits_last_only_and_position_ids():
    sig = read_signature(*_io(logits=("batch", 1, 1000), extra=[_Arg("position_ids", ["batch", "sequence"],
                                                                     "tensor(int64)")]))
    assert not sig.logits_all_positions and sig.has_position_ids and sig.vocab == 1000
    assert not read_signature(*_io(logits=("batch", "vocab"))).logits_all_positions

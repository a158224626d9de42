"""Speculative decoding: greedy tokens = plain decoding (plain export and the decoder recipe's GroupQueryAttention
graph) whatever the draft proposes, the draft's figures, prompt lookup, rejection sampling keeps the
distribution, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.errors import UsageError
from graphopt.generate.lookup import Draft, PromptLookup
from graphopt.generate.loop import generate, open_decoder
from graphopt.generate.sampling import Sampler, Sampling
from graphopt.generate.speculative import speculative_generate, verify_greedy, verify_sampled

pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny models are exported with torch")

EOS = 2
# a prompt that repeats (lookup drafts from it), one that does not, one token
PROMPTS = [[5, 17, 99, 3, 250, 7, 5, 17, 99, 3, 250, 7, 5, 17], [901, 44, 12, 600, 31], [8]]


@pytest.fixture(scope="module")
def tiny():
    return load_models_module("tiny")


@pytest.fixture(scope="module", params=["export", "decoder-recipe"])
def dec(request, tiny, tmp_path_factory):
    src = tiny.build("llama", "causal-lm-with-past")
    if request.param == "export":
        return open_decoder(src)
    out = tmp_path_factory.mktemp("spec") / "llama.gqa.onnx"
    io.save(optimize(src, OptimizeOptions()).model, out)
    d = open_decoder(out)
    assert d.sig.shared_buffer
    return d


class Fixed(Draft):
    """Proposes what a function of the context says (an oracle, or garbage)."""

    name = "fixed"

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def propose(self, context, k):
        self.calls += 1
        return list(self.fn(context, k))[:k]


def test_greedy_equals_plain_with_lookup_oracle_and_garbage_drafts(dec):
    masked = Sampling().masking([EOS])
    for prompt in PROMPTS:
        plain = generate(dec, prompt, max_new_tokens=40, sampling=masked).token_ids
        full = list(prompt) + plain

        def oracle(ctx, k, full=full):
            return full[len(ctx):len(ctx) + k]

        def half(ctx, k, full=full):  # right for two tokens, then wrong
            good = full[len(ctx):len(ctx) + 2]
            return good + [(t + 1) % 1000 for t in full[len(ctx) + 2:len(ctx) + k]]

        for draft in ("lookup", Fixed(oracle), Fixed(half), Fixed(lambda c, k: [3] * k)):
            got = speculative_generate(dec, prompt, max_new_tokens=40, draft=draft, sampling=masked)
            assert got.token_ids == plain, (prompt, getattr(draft, "name", draft))
            assert len(got.token_ids) == 40 and got.finish == "length"
        oracle_run = speculative_generate(dec, prompt, max_new_tokens=40, draft=Fixed(oracle), sampling=masked)
        # every drafted token is kept: far fewer forwards than the 39 plain decode steps
        assert oracle_run.accepted == oracle_run.drafted and oracle_run.steps <= 8
        assert oracle_run.accepted_per_step > 3 and oracle_run.as_dict()["accepted_per_step"] > 3
        garbage = speculative_generate(dec, prompt, max_new_tokens=40, draft=Fixed(lambda c, k: [3] * k),
                                       sampling=masked)
        assert garbage.steps >= 39 - garbage.accepted


def test_stops_at_a_stop_id_like_plain(dec):
    for prompt in PROMPTS:
        plain = generate(dec, prompt, max_new_tokens=30, stop_ids=[EOS])
        full = list(prompt) + plain.token_ids
        spec = speculative_generate(dec, prompt, max_new_tokens=30, stop_ids=[EOS],
                                    draft=Fixed(lambda c, k, full=full: full[len(c):len(c) + k] + [EOS] * k))
        assert spec.token_ids == plain.token_ids and spec.finish == plain.finish


def test_prompt_lookup_copies_what_followed_the_last_ngram():
    look = PromptLookup(max_ngram=3)
    assert look.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]  # "2 3" seen before, followed by 4 5
    assert look.propose([1, 2, 3, 7, 1, 2, 3, 8, 0, 2, 3], 4) == [8, 0, 2, 3]  # the latest occurrence
    assert look.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert look.propose([5, 5], 3) == [5]
    assert PromptLookup(min_ngram=2).propose([1, 2, 9, 2], 3) == []  # a 1-gram match is not enough


def test_lookup_drafts_on_a_repeating_prompt(dec):
    masked = Sampling().masking([EOS])
    got = speculative_generate(dec, PROMPTS[0] * 3, max_new_tokens=24, sampling=masked)
    assert got.drafted > 0 and got.draft == "lookup"
    assert got.token_ids == generate(dec, PROMPTS[0] * 3, max_new_tokens=24, sampling=masked).token_ids


def test_verify_greedy_keeps_the_agreeing_prefix():
    logits = np.eye(5)[[1, 2, 4, 0]] * 3.0  # the model chooses 1, 2, 4, 0
    s = Sampler(Sampling())
    assert verify_greedy(s, logits, [1, 2, 3]) == ([1, 2, 4], 2)
    assert verify_greedy(s, logits, [1, 2, 4]) == ([1, 2, 4, 0], 3)
    assert verify_greedy(s, logits[:1], []) == ([1], 0)


@pytest.mark.parametrize("setting", [Sampling(temperature=1.0, seed=0), Sampling(temperature=0.7, top_k=3, seed=1),
                                     Sampling(temperature=1.0, top_p=0.8, seed=2)])
def test_rejection_sampling_keeps_the_distribution(setting):
    """The first new token of a verifying step is distributed as plain sampling's, for a draft the model likes,
    one it dislikes and one outside its top-k; the second, given the first draft was kept, as the second row's."""
    logits = np.random.default_rng(5).standard_normal((3, 6)) * 1.5
    plain = Sampler(setting)
    want = np.zeros((2, 6))
    for row in (0, 1):
        ids, p = plain.distribution(plain._masked(logits[row:row + 1])[0])
        want[row, ids] = p
    for draft in (int(np.argmax(logits[0])), int(np.argmin(logits[0])), 3):
        s = Sampler(setting)
        first, second = np.zeros(6), np.zeros(6)
        for _ in range(4000):
            out, _ = verify_sampled(s, logits, [draft, int(np.argmax(logits[1]))])
            first[out[0]] += 1
            if out[0] == draft:
                second[out[1]] += 1
        assert 0.5 * np.abs(first / first.sum() - want[0]).sum() < 0.05, (draft, first, want[0])
        if second.sum() >= 1000:
            assert 0.5 * np.abs(second / second.sum() - want[1]).sum() < 0.07, (draft, second, want[1])


def test_sampled_speculative_run_is_seeded_and_distributed_like_plain(dec):
    """End to end on the tiny model: a seed reproduces a run; the second token's frequencies over many runs
    match plain sampling's (total variation within sampling noise)."""
    s = Sampling(temperature=1.0, top_k=4, seed=3)
    prompt = PROMPTS[0]
    a = speculative_generate(dec, prompt, max_new_tokens=12, sampling=s).token_ids
    assert speculative_generate(dec, prompt, max_new_tokens=12, sampling=s).token_ids == a
    plain_first = generate(dec, prompt, max_new_tokens=1).token_ids[0]
    full = list(prompt) + [plain_first]
    runs = 200
    spec2, plain2 = {}, {}
    greedy_next = generate(dec, full, max_new_tokens=1).token_ids[0]
    for seed in range(runs):
        st = Sampling(temperature=1.0, top_k=4, seed=seed)
        x = speculative_generate(dec, full, max_new_tokens=2, sampling=st, draft=Fixed(lambda c, k: [greedy_next] * k))
        y = generate(dec, full, max_new_tokens=2, sampling=Sampling(temperature=1.0, top_k=4, seed=10_000 + seed))
        spec2[x.token_ids[1]] = spec2.get(x.token_ids[1], 0) + 1
        plain2[y.token_ids[1]] = plain2.get(y.token_ids[1], 0) + 1
    keys = set(spec2) | set(plain2)
    tv = 0.5 * sum(abs(spec2.get(t, 0) - plain2.get(t, 0)) for t in keys) / runs
    assert tv < 0.15, (spec2, plain2)


def test_refusals(dec, tmp_path):
    with pytest.raises(UsageError, match="one prompt at a time"):
        speculative_generate(dec, [[1, 2], [3, 4]], max_new_tokens=4)
    with pytest.raises(UsageError, match="unknown mode"):
        speculative_generate(dec, [1, 2], max_new_tokens=4, draft="medusa-ish")
    with pytest.raises(UsageError, match="max_draft >= 1"):
        speculative_generate(dec, [1, 2], max_new_tokens=4, max_draft=0)
    off = speculative_generate(dec, [1, 2, 3], max_new_tokens=5, draft="off")
    assert off.token_ids == generate(dec, [1, 2, 3], max_new_tokens=5).token_ids


def test_draft_policy_learns_acceptance_and_cost():
    from graphopt.generate.draft_policy import DraftPolicy

    p = DraftPolicy(limit=12)
    assert 0 < p.length("k", 12) < 12  # priors: half the drafts kept, a wide forward dearer
    for _ in range(20):  # drafts always right, wide forwards as cheap as one token
        p.observe("k", [1, 2, 3, 4], [1, 2, 3, 4, 5], 5, 0.010)
        p.observe("k", [], [7], 1, 0.010)
    assert p.length("k", 12) == 12
    for _ in range(20):  # a key whose guesses always miss (scored even when not fed) stops drafting once a
        p.observe("bad", [9, 9], [1], 1, 0.010)  # wide forward costs 1.3x
        p.observe("k", [1, 2, 3, 4], [1, 2, 3, 4, 5], 5, 0.013)
    assert p.alpha("bad") < 0.1 and p.length("bad", 12) == 0 and p.length("k", 12) == 12
    q = DraftPolicy(limit=12)
    for _ in range(20):  # 80% kept, but any forward of 2+ tokens costs 4x: not worth it
        q.observe("k", [1, 2, 3, 4, 5], [1, 2, 3, 4, 0], 5, 0.040)
        q.observe("k", [1], [1, 5], 2, 0.040)
        q.observe("k", [], [7], 1, 0.010)
    assert q.alpha("k") > 0.75 and q.length("k", 4) == 0


def test_policy_rates_a_free_guess_against_a_costly_draft():
    """``best`` gives each source's count and its expected tokens per step's time, so lookup (free) and a draft
    model (a forward per token) compare: a sure free guess beats a dear model; a poor one loses to a good model."""
    from graphopt.generate.draft_policy import DraftPolicy

    p = DraftPolicy(limit=8, prior={"lookup3": 0.9, "lookup1": 0.2, "model": 0.95})
    for _ in range(5):
        p.observe("model", [], [7], 1, 0.010)  # a plain step: 10 ms
        p.observe("model", [1, 2, 3], [1, 2, 3, 4], 4, 0.012)  # a 4-token forward: 1.2x
    free_sure, free_poor = p.best("lookup3", 8), p.best("lookup1", 8)
    model = p.best("model", 8, draft_seconds=0.004)  # a draft forward costs 0.4 of a step
    assert free_sure[0] > 0 and model[0] > 0
    assert free_sure[1] > model[1] > free_poor[1]
    assert p.best("model", 8, draft_seconds=0.012) == (0, 1.0)  # dearer than a step: plain


def test_lookup_first_equals_plain_with_a_right_or_wrong_model_draft(dec):
    """LookupFirst: lookup's guess where the context repeats, the model draft elsewhere; either way the tokens are
    plain decoding's, and the model drafts where lookup has no guess."""
    from graphopt.generate.draft_model import LookupFirst

    class Model:  # stands in for a ModelDraft: the model's own continuation (right) or garbage (wrong)
        name, priors = "model", {"model": 0.9}

        def __init__(self, plain, prompt, right):
            self.plain, self.n, self.right, self.calls = plain, len(prompt), right, 0
            self.seconds_per_token = None

        def attach(self, cache):
            pass

        def reset(self):
            pass

        def propose(self, context, k):
            self.calls += 1
            i = len(context) - self.n
            return self.plain[i:i + k] if self.right else [(t + 1) % 200 for t in self.plain[i:i + k]]

    for prompt in PROMPTS[:2]:
        plain = generate(dec, prompt, max_new_tokens=16).token_ids
        for right in (True, False):
            model = Model(plain + [0] * 16, prompt, right)
            got = speculative_generate(dec, prompt, max_new_tokens=16, draft=LookupFirst(model))
            assert got.token_ids == plain and got.draft == "lookup+model"
            assert model.calls > 0
            if right:
                assert got.accepted > 0

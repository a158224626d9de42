"""Speculative decoding: draft several tokens, check them in one forward with the KV cache, keep what agrees.

    prompt ──prefill──▶ token 1
    step:  [last token, d1 .. dk] ──one forward (past = cache, all positions)──▶ logits of k + 1 positions
           accept d1 .. da while each equals the model's own choice there; then the model's token after da
           ──▶ a + 1 new tokens; the cache rolls back (by length) to the last token and da

Greedy: the model's choice is its argmax (after masking), so the tokens are exactly plain decoding's, whatever
the draft proposes. Sampling (temperature, top-k, top-p): rejection sampling against the draft's point mass
(``verify_sampled``): draft token d at a position whose distribution is p is kept with probability p(d); on
rejection the token is drawn from p with d removed (renormalised): each new token has plain sampling's
distribution (Leviathan et al. 2023, with q a point mass). The random stream differs from plain sampling's, so a
seed reproduces a speculative run but not the plain run of the same seed.

The graph must return the logits of every position (``Decoder.step(..., all_positions=True)``); a plain export
and a ``decoder``-recipe graph (GroupQueryAttention on one shared KV buffer: a chunk of tokens on top of a past
gives, within 2e-7, the logits of feeding them one at a time, and ``KVCache.rollback`` only moves the length)
both do. Batch 1.

How many tokens to check per step (at most ``max_draft``): ``draft_policy.DraftPolicy``, from the acceptance
and the forward's cost per width measured as it goes (a draft that keeps missing, or a graph whose wide forwards
cost much, falls back to plain steps); a draft with no guess costs a plain step. A draft that is a model (the
layer-skip draft, ``--draft``: ``draft_model.ModelDraft``) costs a forward per drafted token: the policy decides
the count before it drafts, charging that cost, and a draft it has stopped using still drafts one token every
``PROBE_EVERY`` steps (every step until its first few tokens were judged) so its acceptance stays measured; the
acceptance it reached is the next generation's prior. ``--draft`` with ``--speculative lookup``
(``draft_model.LookupFirst``) checks prompt lookup's free guess first and drafts with the model where lookup has
none, or one that promises fewer tokens per second (``DraftPolicy.best``); a guess not checked is still judged.
Timings as ``loop.generate``; ``accepted_per_step`` is the mean number of draft tokens kept per verifying forward
(``tokens_per_step``: new tokens per decode forward, at least 1).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.cache import KVCache
from graphopt.generate.draft_model import LookupFirst, open_draft
from graphopt.generate.draft_policy import DraftPolicy
from graphopt.generate.layer_skip import LayerSkipDraft, carries_layer_skip
from graphopt.generate.lookup import Draft, PromptLookup
from graphopt.generate.loop import Generation, OnToken, check_prompt, generate, open_decoder
from graphopt.generate.medusa import MedusaDraft, heads_of
from graphopt.generate.multirow import multirow_warning
from graphopt.generate.sampling import GREEDY, Sampler, Sampling
from graphopt.runtime.ort_compat import model_path

#: the draft sources ``--speculative`` names (``auto``: the draft decoder saved beside the model
#: (``sibling_draft``), with prompt lookup first where the text repeats; else the graph's Medusa heads when it
#: carries them (``speculative-heads`` pass), else its layer-skip draft (``layer-skip-draft`` pass), else prompt
#: lookup; ``heads``: the Medusa heads, ``medusa.py``; ``layer-skip``: ``layer_skip.py``); a separate draft model:
#: ``draft_model=`` (``--draft``)
MODES = ("auto", "heads", "layer-skip", "lookup", "off")
#: ``NAME.onnx``'s draft decoder, found by ``auto``: ``NAME`` + this (e.g. its ``int4`` build, written there by
#: ``graphopt optimize SRC -o NAME.draft.onnx --recipe int4``)
DRAFT_SUFFIX = ".draft.onnx"
#: a costly draft (a model) that chose no drafts for this many steps drafts one token, to keep judging it;
#: every step while fewer than ``WARM_CHECKS`` of its tokens were checked (a first judgement comes quickly)
PROBE_EVERY, WARM_CHECKS = 8, 4


@dataclasses.dataclass
class SpeculativeGeneration(Generation):
    """A Generation with the draft's figures: verifying forwards, tokens drafted and accepted."""

    draft: str = "lookup"
    #: why the tokens may differ from plain decoding's (a graph that computes a multi-token chunk differently)
    warning: str | None = None
    steps: int = 0  # decode forwards (each checks the drafted tokens, or is a plain step when none were)
    drafted: int = 0
    accepted: int = 0

    @property
    def accepted_per_step(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        made = sum(len(r) for r in self.rows) - 1
        return made / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update(speculative=self.draft, speculative_warning=self.warning, steps=self.steps, drafted=self.drafted, accepted=self.accepted,
                 accepted_per_step=round(self.accepted_per_step, 3), tokens_per_step=round(self.tokens_per_step, 3))
        return d


def sibling_draft(decoder) -> Path | None:
    """The draft decoder saved beside ``decoder``'s file: ``NAME.draft.onnx`` for ``NAME.onnx`` (None: there is
    none, the model was not loaded from a file, or it is itself a draft)."""
    path = model_path(decoder.session) if decoder is not None else None
    if path is None or Path(path).name.endswith(DRAFT_SUFFIX):
        return None
    found = Path(path).with_name(Path(path).stem + DRAFT_SUFFIX)
    return found if found.is_file() else None


def make_draft(mode: str | Draft, decoder=None, draft_model=None) -> Draft | None:
    """The draft of a ``--speculative`` mode (None: ``off``); ``draft_model``: a draft decoder file (``--draft``)."""
    if isinstance(mode, Draft):
        return mode
    if draft_model is None and mode == "auto":
        draft_model = sibling_draft(decoder)
        mode = "lookup" if draft_model is not None else mode  # measured best: lookup where it repeats, else the model
    if draft_model is not None:
        if decoder is None:
            raise UsageError("--draft: the draft model is checked against the model; no decoder was given")
        if mode not in ("auto", "lookup", "off"):
            raise UsageError(f"--draft drafts with a model; --speculative {mode} names another draft",
                             hint="give --speculative lookup (lookup where the text repeats, the model elsewhere) "
                                  "or leave it out")
        threads = decoder.session.get_session_options().intra_op_num_threads or None
        model = open_draft(draft_model, decoder, threads=threads)
        return LookupFirst(model) if mode == "lookup" else model
    if mode not in MODES:
        raise UsageError(f"--speculative: unknown mode {mode!r}", hint=f"use {'|'.join(MODES)}")
    if mode == "off":
        return None
    if mode == "heads" or (mode == "auto" and decoder is not None and heads_of(decoder.session)):
        if decoder is None:
            raise UsageError("--speculative heads reads the graph's Medusa heads; no decoder was given")
        return MedusaDraft(decoder)
    if mode == "layer-skip" or (mode == "auto" and decoder is not None and carries_layer_skip(decoder.session)):
        if decoder is None:
            raise UsageError("--speculative layer-skip reads the graph's layer-skip draft; no decoder was given")
        return LayerSkipDraft(decoder)
    return PromptLookup()


def verify_greedy(sampler: Sampler, logits: np.ndarray, drafts: Sequence[int]) -> tuple[list[int], int]:
    """(new tokens, drafts accepted) of one step: ``logits`` [len(drafts) + 1, vocab], position i choosing the
    token after draft i - 1 (position 0: after the last token)."""
    choice = sampler(logits).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == choice[a]:
        a += 1
    return list(drafts[:a]) + [choice[a]], a


def verify_sampled(sampler: Sampler, logits: np.ndarray, drafts: Sequence[int]) -> tuple[list[int], int]:
    """As ``verify_greedy`` under sampling: draft i is kept with probability p_i(draft i); the first rejected
    one is replaced by a draw from p_i without it; after all are kept, one more token is drawn from the last row."""
    x = sampler._masked(logits)
    out: list[int] = []
    for i, d in enumerate(drafts):
        ids, p = sampler.distribution(x[i])
        hit = np.flatnonzero(ids == d)
        pd = float(p[hit[0]]) if hit.size else 0.0
        if pd > 0 and sampler.rng.random() < pd:
            out.append(int(d))
            continue
        if hit.size:
            p = p.copy()
            p[hit[0]] = 0.0
            p /= p.sum()
        out.append(int(ids[sampler.rng.choice(len(p), p=p)]))
        return out, i
    ids, p = sampler.distribution(x[len(drafts)])
    out.append(int(ids[sampler.rng.choice(len(p), p=p)]))
    return out, len(drafts)


def speculative_generate(
    session_or_path,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    draft: str | Draft = "lookup",
    sampling: Sampling = GREEDY,
    stop_ids: Iterable[int] = (),
    on_token: OnToken | None = None,
    max_length: int | None = None,
    threads: int | None = None,
    max_draft: int = 12,
    policy: DraftPolicy | None = None,
    draft_model=None,
) -> Generation:
    """``loop.generate`` for one prompt, with up to ``max_draft`` ``draft`` tokens checked per forward (how many:
    ``policy``, a new DraftPolicy by default); ``draft`` "off" runs plain ``generate``; ``draft_model``: a
    separate draft decoder (a path or Decoder with the model's vocabulary; ``draft`` is then ignored). Returns a
    SpeculativeGeneration."""
    if len(prompt) and np.ndim(prompt[0]) != 0:
        if len(prompt) != 1:
            raise UsageError(f"speculative decoding runs one prompt at a time (got a batch of {len(prompt)})",
                             hint="run the prompts one by one, or use --speculative off for a batch")
        prompt = prompt[0]
    prompt = [int(t) for t in prompt]
    dec = open_decoder(session_or_path, threads=threads)
    src = make_draft(draft, dec, draft_model)
    if src is None:
        return generate(dec, prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                        on_token=on_token, max_length=max_length, threads=threads)
    if max_draft < 1:
        raise UsageError(f"speculative decoding needs max_draft >= 1 (got {max_draft})")
    if not dec.sig.logits_all_positions:
        raise UsageError("speculative decoding checks drafts with the logits of every position; this graph returns "
                         "the last position's only", hint="use a graph with logits [batch, sequence, vocab], or "
                         "--speculative off")
    if dec.sig.kivi is not None:
        raise UsageError("speculative decoding rolls the KV cache back; a KIVI-form cache quantizes keys in groups "
                         "and is not rolled back", hint="use --speculative off with this graph")
    max_new_tokens = check_prompt(dec, [prompt], len(prompt), max_new_tokens, max_length)
    src.reset()
    sampler = Sampler(sampling)
    verify = verify_greedy if sampling.greedy or sampling.top_k == 1 else verify_sampled
    stops = frozenset(int(t) for t in stop_ids)
    policy = policy or DraftPolicy(max_draft, prior=src.priors)
    capacity = len(prompt) + max_new_tokens + max_draft
    if dec.sig.shared_buffer and dec.sig.max_positions is not None:
        capacity = min(capacity, dec.sig.max_positions)
    cache = KVCache(dec.sig, 1, capacity)
    costly = getattr(src, "costly", False)
    if costly:
        src.attach(cache)
    idle = 0
    context = list(prompt)
    out: list[int] = []
    result = SpeculativeGeneration([prompt], [out], ["length"], 0.0, None, batched=False, draft=src.name,
                                   warning=multirow_warning(dec))

    def emit(tokens: Sequence[int]) -> bool:
        """Append new tokens; True when the generation is over."""
        for tok in tokens:
            out.append(tok)
            context.append(tok)
            if on_token is not None:
                on_token(0, tok)
            if tok in stops:
                result.finishes[0] = "stop"
                return True
            if len(out) >= max_new_tokens:
                return True
        return False

    t0 = time.perf_counter()
    n = len(prompt)
    # the prefill: the last position's logits only (a graph with logits_to_keep runs its head on that one)
    logits = dec.step(cache, np.asarray([prompt], np.int64), np.ones((1, n), np.int64),
                      np.arange(n, dtype=np.int64)[None])
    first = sampler(logits).tolist()
    t_first = t_last = time.perf_counter()
    done = emit(first)
    while not done:
        past = cache.length  # every token but the last is in the cache
        room = min(max_new_tokens - len(out) - 1, cache.free - 1, max_draft, getattr(src, "max_draft", max_draft))
        drafts: list[int] = []
        free = getattr(src, "free_guess", None) if costly else src.propose_keyed
        rate, guess = 1.0, None
        if free is not None:  # a guess that costs no forward (prompt lookup), checked where it is likely kept
            key, proposal = free(context, room) if room > 0 else (None, [])
            count, rate = policy.best(key, len(proposal))
            drafts = proposal[:count]
        # drafting with a model costs forwards: decide how many first (the first step is plain: it times width 1);
        # with a free guess too (LookupFirst), the model drafts where it promises more tokens per second
        model = policy.best(src.name, room, src.seconds_per_token) if costly else (0, 1.0)
        if costly and (not drafts or model[1] > rate):
            if free is not None and proposal:
                guess = (key, proposal)  # not checked: judged against the tokens made all the same
            key, drafts = src.name, []
            want = model[0] if result.steps else 0
            idle = 0 if want else idle + 1
            every = PROBE_EVERY if policy.checked(key) >= WARM_CHECKS else 1
            if result.steps and room > 0 and not want and idle >= every:
                want, idle = 1, 0
            proposal = drafts = src.propose(context, want) if want else []
        feed = np.asarray([[context[-1], *drafts]], np.int64)
        width = feed.shape[1]
        t = time.perf_counter()
        logits = dec.step(cache, feed, np.ones((1, past + width), np.int64),
                          np.arange(past, past + width, dtype=np.int64)[None], all_positions=True)[0]
        seconds = time.perf_counter() - t
        new, accepted = verify(sampler, logits, drafts)
        cache.rollback(past + 1 + accepted)
        policy.observe(key, proposal, new, width, seconds)
        if guess is not None:
            policy.judge(*guess, new)
        result.steps += 1
        result.drafted += len(drafts)
        result.accepted += accepted
        done = emit(new)
        t_last = time.perf_counter()
    if costly and policy.checked(src.name) >= WARM_CHECKS:
        src.priors[src.name] = policy.alpha(src.name)  # the next generation with this draft starts from it
    result.prefill_ms = (t_first - t0) * 1e3
    made = len(out) - 1
    result.decode_tokens_per_s = made / (t_last - t_first) if made > 0 and t_last > t_first else None
    return result

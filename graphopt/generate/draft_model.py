"""A draft decoder: a smaller model with the target's vocabulary drafts greedily, the target verifies.

``graphopt generate --draft SMALL.onnx`` (any decoder with past whose token ids mean the same: the same
tokenizer) and the layer-skip draft (``layer_skip.py``: the target's first layers and a fitted exit head) both
run through ``ModelDraft``::

    context c1 .. cn (the target's tokens)   draft cache holds c1 .. cp (p: the prefix it saw that still holds)
    ──draft forward [c(p+1) .. cn]──▶ d1 ──[d1]──▶ d2 .. ──▶ dk           (k draft forwards, argmax each)

Its own KV cache: after a step the target kept a prefix of the drafts; the draft cache rolls back (by length) to
the longest prefix of what it fed that is still the context and feeds the rest as one chunk. A draft that shares
the target's cache (``cache.SharedLayers``: the layer-skip draft on a shared-buffer graph, and a draft model of
the target's own shape, e.g. the ``int4`` build of the same decoder, whose cache is the target's buffers) has
nothing to prefill or catch up: the target wrote every position but the newest token's, exactly, and the draft's
guesses at the drafted positions are overwritten by the target's verifying forward. Drafting costs forwards,
unlike prompt lookup: ``seconds_per_token`` (a decayed mean of one- or two-token forwards) is what the speculative
loop's policy charges per drafted token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.cache import KVCache, SharedLayers
from graphopt.generate.lookup import Draft, PromptLookup
from graphopt.generate.loop import Decoder, open_decoder

#: a draft forward of at most this many tokens is timed as a drafted token's cost: while drafting goes on, each
#: step feeds the token the model chose after the kept drafts (and the last kept draft, when all were kept)
CATCH_UP = 2
#: LookupFirst: the prior acceptance of a prompt-lookup guess (by matched n-gram length) beside a draft model
LOOKUP_PRIOR = 0.1


class ModelDraft(Draft):
    """Greedy drafts of a decoder, with its own KV cache or (``share``) the target's first layers'."""

    name = "draft-model"
    costly = True  # each drafted token is a forward of the draft: the policy charges it

    def __init__(self, decoder: Decoder, *, share: bool = False, name: str | None = None,
                 priors: dict | None = None):
        self.decoder, self.share = decoder, share
        if name:
            self.name = name
        self.priors = dict(priors or {self.name: 0.5})
        self.cache: KVCache | SharedLayers | None = None
        self.fed: list[int] = []
        self.seconds_per_token: float | None = None

    def attach(self, target: KVCache) -> None:
        """Called by the speculative loop with the target's cache, before the first proposal."""
        if self.share and SharedLayers.fits(target, self.decoder.sig):
            self.cache = SharedLayers(target, self.decoder.sig)
        else:
            self.cache = KVCache(self.decoder.sig, 1, target.max_length)
        self.fed = []

    def reset(self) -> None:
        self.fed = []
        if self.cache is not None:
            self.cache.reset()

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        cache = self.cache
        if k < 1 or cache is None or not context:
            return []
        context = list(context)
        if isinstance(cache, SharedLayers):
            p = min(cache.sync(), len(context) - 1)
            cache.rollback(p)
        else:
            p = 0
            limit = min(len(self.fed), len(context) - 1)
            while p < limit and self.fed[p] == context[p]:
                p += 1
            cache.rollback(p)
        feed = context[p:]
        k = min(k, cache.free - len(feed) + 1)
        if k < 1:
            return []
        dec = self.decoder
        out: list[int] = []
        times: list[float] = []  # seconds of the forwards of one or two tokens (a drafting step's own cost)
        for i in range(k):
            n = len(feed)
            t = time.perf_counter()
            logits = dec.step(cache, np.asarray([feed], np.int64), np.ones((1, cache.length + n), np.int64),
                              np.arange(cache.length, cache.length + n, dtype=np.int64)[None])
            if n <= CATCH_UP:
                times.append(time.perf_counter() - t)
            out.append(int(np.argmax(logits[0])))
            if i + 1 < k:
                feed = out[-1:]
        if times:  # a long catch-up chunk (after steps that drafted nothing) is not what a drafted token costs
            seconds = sum(times) / len(times)
            prev = self.seconds_per_token
            self.seconds_per_token = seconds if prev is None else 0.8 * prev + 0.2 * seconds
        self.fed = context + out[:-1]
        return out


class LookupFirst(Draft):
    """Prompt lookup where the context repeats (free drafts), the draft model elsewhere (``--draft`` with
    ``--speculative lookup``). The loop asks ``free_guess`` first and drafts with the model where lookup has no
    guess, or one that promises fewer tokens per second than the model's drafts (``DraftPolicy.best``, from each
    source's measured acceptance and cost); on a shared cache the model has nothing to catch up after lookup steps."""

    costly = True

    def __init__(self, model: ModelDraft, lookup: PromptLookup | None = None):
        self.model, self.lookup = model, lookup or PromptLookup()
        self.name = f"lookup+{model.name}"
        # lookup's guesses start doubted: each is judged against the tokens made even when the model drafted
        # instead, so a kind of match that keeps proving right takes over at no cost (on chat, short matches
        # mostly miss, and lookup's own priors would let them displace a draft model that is mostly right)
        self.priors = {**{key: LOOKUP_PRIOR for key in self.lookup.priors}, self.name: model.priors.get(model.name, 0.5)}

    @property
    def seconds_per_token(self) -> float | None:
        return self.model.seconds_per_token

    def free_guess(self, context: Sequence[int], k: int) -> tuple[object, list[int]]:
        return self.lookup.propose_keyed(context, k)

    def attach(self, target) -> None:
        self.model.attach(target)

    def reset(self) -> None:
        self.model.reset()

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return self.model.propose(context, k)


def open_draft(path, target: Decoder, *, threads: int | None = None) -> ModelDraft:
    """A ModelDraft of the decoder file ``path``, checked against ``target`` (the same vocabulary)."""
    dec = open_decoder(path, threads=threads)
    dv, tv = dec.sig.vocab, target.sig.vocab
    if dv is not None and tv is not None and dv != tv:
        raise UsageError(f"{path}: the draft's vocabulary is {dv} tokens, the model's {tv}",
                         hint="a draft model must share the model's tokenizer")
    # a draft of the target's own shape (its int4 build, say) runs on the target's cache buffers where they fit:
    # it reads the exact K/V the target wrote, so it never prefills the prompt nor catches up (attach decides)
    return ModelDraft(dec, share=True, name="draft-model")

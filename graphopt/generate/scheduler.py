"""Continuous batching: requests join the running decode batch at any step and leave it when they finish.

A GroupQueryAttention graph (``sig.shared_buffer``) reads and writes one cache buffer per tensor,
``[slots, kv_heads, context, head_dim]``, each row at its own length (``sum(mask) - 1``). A row of that buffer
is a *slot*; a request holds one from its prefill to its last token::

    step:  admit   waiting requests into free slots (up to ``prefill_tokens`` prompt tokens to run, at least one)
                   ──prefilled together: right-padded rows of one forward──▶ token 1 of each
           decode  every running slot ──one batched run over buffer[:top+1], one token per row──▶ token t+1
           evict   rows that chose a stop id, reached their max_new or were cancelled free their slot

Newcomers of one step are prefilled as one batch (``KVCache.rows``), each row a prefix of ones in the mask: the
graph's first-prompt run puts every row at positions ``0 .. n - 1`` and reads its logits at ``n - 1``, the same
numbers as the prompt run alone (bit for bit on SmolLM2 int4). Rows of unequal length are padded to the
longest, and the padding is work: newcomers are grouped by length (longest first) so that a group's padded
tokens stay within ``pad_waste`` (``PAD_WASTE``) of its prompt tokens, each group one forward (a negative
``pad_waste``: one forward each). A group whose slots are consecutive runs in place over them; others run in a
staging cache and each row's positions are copied into its slot (``KVCache.copy_row``).

In the decode run row ``b``'s mask is a prefix of ones of its own length plus one, right-padded to the widest
row, so each row attends to its own positions only and its tokens equal the same request run alone (greedy).
Free slots below the highest running one run as one-token dummy rows (the lowest free slot is taken first,
so under load there are none). A request's sampler is its own (seeded per request).

A newcomer whose prompt begins with at least ``MIN_PREFIX`` tokens of a recent prompt (a chat template's system
prompt, a shared instruction) reuses them (``prefix_cache`` entries, ``PrefixStore``): those positions are copied
from the store into its slot and only the rest of the prompt runs, as one forward over the cached past. Each
prefilled prompt's positions go into the store (least recently used entry out). At least two prompt tokens
always run, so the forward is a multi-row one as a first-prompt run is; the rows' keys, values and logits are the
numbers of the prompt run from its start (checked bit for bit on SmolLM2, ``tests/test_serve_generate.py`` on a
tiny decoder).

Other graphs (two cache buffers, rows of equal length): one slot, a request at a time, each with its own
``KVCache`` (the fallback is serial; requests still queue and stream).

``Scheduler.step`` is synchronous and not thread-safe: one thread drives it (``graphopt.serve``'s engine).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import Decoder
from graphopt.generate.sampling import GREEDY, Sampler, Sampling

_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request: its prompt, limits, sampler, and the tokens chosen so far."""

    prompt: list[int]
    max_new: int
    sampling: Sampling = GREEDY
    stop_ids: frozenset[int] = frozenset()
    tag: object = None  # the caller's handle (the server's stream)
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None  # "stop", "length" or "cancelled" once done
    slot: int | None = None
    length: int = 0  # positions of this row in the cache
    cancelled: bool = False

    def __post_init__(self):
        self.sampler = Sampler(self.sampling)


#: (sequence, token id, finish reason or None): what ``step`` reports for each token chosen
Event = tuple[Sequence, int, str | None]


#: most padding a batched prefill takes on, as a fraction of its prompt tokens (more: another forward)
PAD_WASTE = 0.1
#: shortest common beginning with a stored prompt that a newcomer reuses instead of prefilling it
MIN_PREFIX = 16
#: prompts kept for reuse, and the most positions of one kept
PREFIX_ENTRIES = 4
PREFIX_POSITIONS = 512


class PrefixStore:
    """The KV positions of recent prompts (one cache row each, up to ``positions``), for newcomers that begin
    with the same tokens; least recently used out."""

    def __init__(self, sig, entries: int, positions: int):
        self.cache = KVCache(sig, entries, positions)
        self.tokens: list[np.ndarray | None] = [None] * entries
        self._used = [0] * entries
        self._clock = itertools.count(1)
        self.hits = 0
        self.reused = 0  # prompt positions taken from the store instead of prefilled

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(entry, length) of the stored prompt sharing the longest beginning with ``prompt`` ((-1, 0): none)."""
        p = np.asarray(prompt, np.int64)
        best = (-1, 0)
        for i, t in enumerate(self.tokens):
            if t is None:
                continue
            n = min(len(t), len(p))
            differ = np.flatnonzero(t[:n] != p[:n])
            m = int(differ[0]) if len(differ) else n
            if m > best[1]:
                best = (i, m)
        return best

    def take(self, entry: int, pool: KVCache, row: int, length: int) -> None:
        """Positions ``0 .. length - 1`` of ``entry`` into ``pool``'s row ``row``."""
        pool.copy_row(self.cache, entry, row, length)
        self._used[entry] = next(self._clock)
        self.hits += 1
        self.reused += length

    def keep(self, pool: KVCache, row: int, prompt: list[int]) -> None:
        """``prompt``'s positions (prefilled in ``pool``'s row ``row``) into the store."""
        n = min(len(prompt), self.cache.max_length)
        if n < MIN_PREFIX:
            return
        head = np.asarray(prompt[:n], np.int64)
        for i, t in enumerate(self.tokens):
            if t is not None and len(t) >= n and np.array_equal(t[:n], head):
                self._used[i] = next(self._clock)  # already held
                return
        free = [i for i, t in enumerate(self.tokens) if t is None]
        entry = free[0] if free else int(np.argmin(self._used))
        self.cache.copy_row(pool, row, entry, n)
        self.tokens[entry], self._used[entry] = head, next(self._clock)


def prefill_groups(lengths: list[int], waste: float = PAD_WASTE) -> list[list[int]]:
    """Indices of ``lengths`` run as one right-padded prefill each: longest first, a group grows while its
    padded tokens (``len(group) * longest``) stay within ``1 + waste`` times its real ones."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * lengths[g[0]] <= (1 + waste) * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


class Scheduler:
    """Continuous batching of ``Sequence``s over ``decoder``: ``add`` queues, ``step`` admits, decodes, evicts.

    ``slots``: most requests decoding at once (1 on graphs without a shared buffer). ``context``: most
    positions of one request, prompt and new tokens (the cache holds ``slots * context`` positions).
    ``prefill_tokens``: prompt tokens prefilled per step before the decode run (at least one request), so
    that a burst of newcomers delays the running rows' next token by a bounded time. ``pad_waste``: most
    padding of a shared prefill, as a fraction of its prompt tokens (negative: every newcomer alone).
    ``prefix_cache``: recent prompts kept for newcomers that begin with the same tokens (0: none).
    """

    def __init__(self, decoder: Decoder, *, slots: int = 8, context: int = 2048, pad_id: int = 0,
                 prefill_tokens: int = 512, pad_waste: float = PAD_WASTE, prefix_cache: int = PREFIX_ENTRIES):
        sig = decoder.sig
        if sig.kivi is not None:
            raise UsageError("continuous batching keeps one request per row of a shared buffer; a KIVI-form KV "
                             "cache has none", hint="serve the graph before kivi-kv-cache")
        if slots < 1 or context < 2:
            raise UsageError(f"continuous batching needs slots >= 1 and context >= 2 (got {slots}, {context})")
        if sig.max_positions is not None and context > sig.max_positions:
            raise UsageError(f"the graph takes at most {sig.max_positions} positions; a context of {context} was "
                             "asked for", hint=f"use a context of at most {sig.max_positions}")
        self.decoder, self.sig, self.context, self.pad_id = decoder, sig, context, pad_id
        self.prefill_tokens, self.pad_waste = prefill_tokens, pad_waste
        #: rows share one buffer and decode together (GroupQueryAttention); else one request at a time
        self.batched = sig.shared_buffer and sig.logits_all_positions
        self.slots = slots if self.batched else 1
        self._pool = KVCache(sig, self.slots, context) if self.batched else None
        self._serial: KVCache | None = None
        if prefix_cache < 0:
            raise UsageError(f"prefix_cache must be >= 0 (got {prefix_cache})")
        self.prefixes = (PrefixStore(sig, prefix_cache, min(context, PREFIX_POSITIONS))
                         if self.batched and prefix_cache else None)
        self.running: list[Sequence | None] = [None] * self.slots
        self.waiting: collections.deque[Sequence] = collections.deque()
        #: decode runs and the rows they carried (real requests), for the server's statistics
        self.decode_runs = 0
        self.decode_rows = 0
        self.prefills = 0
        self.prefill_runs = 0  # forwards that prefilled them (fewer when newcomers share one)
        self.decode_seconds = 0.0  # in decode runs (decode_rows / decode_seconds: the decode tokens/s)
        self.prefill_seconds = 0.0

    # -- admission ---------------------------------------------------------------------------------------
    def check(self, prompt: list[int], max_new: int) -> int:
        """``max_new`` within the context (prompt and new tokens together, as transformers); UsageError for
        an empty prompt, one that fills the context, or ids outside the vocabulary."""
        if not prompt:
            raise UsageError("the prompt is empty: generation needs at least one prompt token")
        if len(prompt) >= self.context:
            raise UsageError(f"the prompt is {len(prompt)} tokens; the model takes at most {self.context} in all "
                             "(prompt and new tokens)", hint="shorten the prompt")
        vocab = self.sig.vocab
        if vocab is not None:
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise UsageError(f"token id {bad[0]} is outside the model's vocabulary of {vocab}")
        if max_new < 1:
            raise UsageError(f"max_new_tokens must be >= 1 (got {max_new})")
        return min(max_new, self.context - len(prompt))

    def add(self, seq: Sequence) -> Sequence:
        seq.max_new = self.check(seq.prompt, seq.max_new)
        self.waiting.append(seq)
        return seq

    @staticmethod
    def cancel(seq: Sequence) -> None:
        """Stop ``seq`` at the next step (its slot is freed then; no more events for it)."""
        seq.cancelled = True

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.running)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    # -- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Evict cancelled rows, admit waiting requests into free slots (a prefill each), then one decode run
        over the running rows; the tokens chosen, each with its finish reason when it is the last."""
        events: list[Event] = []
        for i, s in enumerate(self.running):
            if s is not None and s.cancelled:
                self._evict(i, "cancelled")
        fresh: dict[int, Sequence] = {}
        reuse: dict[int, tuple[int, int]] = {}  # per newcomer: (prefix store entry, positions taken from it)
        budget = self.prefill_tokens
        while self.waiting and None in self.running:
            seq = self.waiting[0]
            entry, m = self._reusable(seq.prompt)
            if fresh and len(seq.prompt) - m > budget:
                break
            self.waiting.popleft()
            if seq.cancelled:
                seq.finish = "cancelled"
                continue
            budget -= len(seq.prompt) - m
            slot = self.running.index(None)
            self.running[slot], seq.slot = seq, slot
            fresh[seq.id], reuse[seq.id] = seq, (entry, m)
        if fresh:
            events += self._prefill(list(fresh.values()), reuse)
        rows = [s for s in self.running if s is not None and s.id not in fresh]
        if rows:
            events += self._decode()
        return events

    def _reusable(self, prompt: list[int]) -> tuple[int, int]:
        """(store entry, positions) of ``prompt`` taken from the prefix store ((-1, 0): none)."""
        entry, m = self.prefixes.match(prompt) if self.prefixes is not None else (-1, 0)
        m = min(m, len(prompt) - 2)  # at least two positions run: a multi-row forward, as a first-prompt run
        return (entry, m) if m >= MIN_PREFIX else (-1, 0)

    def _emit(self, seq: Sequence, logits: np.ndarray) -> Event:
        tok = int(seq.sampler(logits[None, :])[0])
        seq.tokens.append(tok)
        if tok in seq.stop_ids:
            seq.finish = "stop"
        elif len(seq.tokens) >= seq.max_new:
            seq.finish = "length"
        if seq.finish is not None:
            self._evict(seq.slot, seq.finish)
        return seq, tok, seq.finish

    def _evict(self, slot: int, why: str) -> None:
        seq = self.running[slot]
        if seq.finish is None:
            seq.finish = why
        self.running[slot] = None
        seq.slot = None

    def _prefill(self, seqs: list[Sequence], reuse: dict[int, tuple[int, int]]) -> list[Event]:
        """Prefill newcomers (already in their slots): those with positions in the prefix store (``reuse``, by
        id: entry and positions, read at admission) continue from them, the rest one forward per length group,
        or one each on graphs without a shared buffer; the first token of each, in admission order."""
        if not self.batched:
            return [self._prefill_serial(seq) for seq in seqs]
        logits: dict[int, np.ndarray] = {}
        fresh = []
        for seq in seqs:
            entry, m = reuse[seq.id]
            if m:
                logits[seq.id] = self._prefill_continued(seq, entry, m)
            else:
                fresh.append(seq)
        for group in prefill_groups([len(s.prompt) for s in fresh], self.pad_waste):
            rows = [fresh[i] for i in group]
            for seq, row in zip(rows, self._prefill_rows(rows)):
                logits[seq.id] = row
        if self.prefixes is not None:
            for seq in seqs:
                self.prefixes.keep(self._pool, seq.slot, seq.prompt)
        return [self._emit(seq, logits[seq.id]) for seq in seqs]

    def _prefill_continued(self, seq: Sequence, entry: int, m: int) -> np.ndarray:
        """``seq``'s first ``m`` positions from the prefix store, the rest of its prompt as one forward over
        them; the logits of its last prompt position."""
        n = len(seq.prompt)
        t0 = time.perf_counter()
        self.prefixes.take(entry, self._pool, seq.slot, m)
        logits = self.decoder.step(self._pool.rows(seq.slot, 1), np.array([seq.prompt[m:]], np.int64),
                                   np.ones((1, n), np.int64), np.arange(m, n, dtype=np.int64)[None, :],
                                   rows_last=np.array([n - m - 1]))
        self.prefill_seconds += time.perf_counter() - t0
        seq.length = n
        self.prefills += 1
        self.prefill_runs += 1
        return logits[0]

    def _prefill_rows(self, seqs: list[Sequence]) -> np.ndarray:
        """One right-padded first-prompt forward over ``seqs``; their last prompt positions' logits."""
        lengths = np.array([len(s.prompt) for s in seqs], np.int64)
        width = int(lengths.max())
        ids = np.full((len(seqs), width), self.pad_id, np.int64)
        for i, s in enumerate(seqs):
            ids[i, :len(s.prompt)] = s.prompt
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), ids.shape)
        slots = [s.slot for s in seqs]
        in_place = slots == list(range(slots[0], slots[0] + len(slots)))
        stage = None if in_place else KVCache(self.sig, len(seqs), width)
        cache = self._pool.rows(slots[0], len(slots)) if in_place else stage
        t0 = time.perf_counter()
        logits = self.decoder.step(cache, ids, mask, positions, rows_last=lengths - 1)
        if stage is not None:
            for i, s in enumerate(seqs):
                self._pool.copy_row(stage, i, s.slot, len(s.prompt))
        self.prefill_seconds += time.perf_counter() - t0
        for s in seqs:
            s.length = len(s.prompt)
        self.prefills += len(seqs)
        self.prefill_runs += 1
        return logits

    def _prefill_serial(self, seq: Sequence) -> Event:
        n = len(seq.prompt)
        self._serial = cache = KVCache(self.sig, 1, max(n + seq.max_new - 1, 1))
        t0 = time.perf_counter()
        logits = self.decoder.step(cache, np.array([seq.prompt], np.int64), np.ones((1, n), np.int64),
                                   np.arange(n, dtype=np.int64)[None, :], rows_last=np.array([n - 1]))
        self.prefill_seconds += time.perf_counter() - t0
        seq.length = n
        self.prefills += 1
        self.prefill_runs += 1
        return self._emit(seq, logits[0])

    def _decode(self) -> list[Event]:
        top = max(i for i, s in enumerate(self.running) if s is not None)
        width = top + 1
        lengths = np.array([s.length if s is not None else 0 for s in self.running[:width]], np.int64)
        feed = np.array([[s.tokens[-1] if s is not None else self.pad_id] for s in self.running[:width]], np.int64)
        cols = int(lengths.max()) + 1
        mask = (np.arange(cols)[None, :] <= lengths[:, None]).astype(np.int64)
        positions = lengths[:, None].copy()
        if self.batched:
            cache = self._pool.rows(0, width)
        else:
            cache = self._serial
        t0 = time.perf_counter()
        logits = self.decoder.step(cache, feed, mask, positions)
        self.decode_seconds += time.perf_counter() - t0
        self.decode_runs += 1
        events = []
        for i in range(width):
            s = self.running[i]
            if s is None:
                continue
            self.decode_rows += 1
            s.length += 1
            events.append(self._emit(s, logits[i]))
        return events

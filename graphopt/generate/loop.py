"""``generate``: prefill then one decode step per token, with streaming callbacks and timings.

    prompt ──prefill (all prompt tokens, empty past)──▶ logits ─sample─▶ token 1      (prefill_ms ends here)
    token t ──decode (one token, past = cache)──▶ logits ─sample─▶ token t+1        (until a stop id or the limit)

The session's IO binding feeds the cache (``cache.KVCache``) in place; only the logits are allocated per step.
Timings: ``prefill_ms`` is prompt in to first new token out; ``decode_tokens_per_s`` is the new tokens after
the first over the time from the first to the last (None when fewer than two were generated).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from graphopt.errors import MissingFileError, UsageError
from graphopt.generate.batch import Batch
from graphopt.generate.cache import KVCache, new_cache
from graphopt.generate.sampling import GREEDY, Sampler, Sampling
from graphopt.generate.signature import LOGITS_TO_KEEP, DecoderSignature, last_logits, read_signature
from graphopt.runtime.session import make_session

#: ``on_token(row, token_id)``: called as each new token is chosen (row: the prompt's index in the batch)
OnToken = Callable[[int, int], None]


@dataclasses.dataclass
class Generation:
    """What ``generate`` returns: the new tokens per row (stop token included, as transformers), timings."""

    prompt_ids: list[list[int]]
    rows: list[list[int]]
    finishes: list[str]  # per row: "stop" (a stop id) or "length" (max_new_tokens or the model's maximum)
    prefill_ms: float
    decode_tokens_per_s: float | None
    batched: bool = True  # False: generate was given one prompt; token_ids is then that prompt's list

    @property
    def token_ids(self) -> list[int] | list[list[int]]:
        return self.rows if self.batched else self.rows[0]

    @property
    def finish(self) -> str | list[str]:
        return self.finishes if self.batched else self.finishes[0]

    def as_dict(self) -> dict:
        return {"prompt_ids": self.prompt_ids if self.batched else self.prompt_ids[0], "token_ids": self.token_ids,
                "finish": self.finish, "prefill_ms": self.prefill_ms,
                "decode_tokens_per_s": self.decode_tokens_per_s}


class Decoder:
    """An ORT session driven through one IO binding: ``step`` runs new tokens against a cache."""

    def __init__(self, session, sig: DecoderSignature | None = None, *, name: str = "model"):
        self.session = session
        self.sig = sig or read_signature(session, name=name)
        self._binding = session.io_binding()
        #: more outputs ``step`` fetches (a speculative draft's, e.g. ``medusa_logits``), by name into ``extras``
        self.extra_outputs: tuple[str, ...] = ()
        self.extras: dict[str, np.ndarray] = {}
        self._keeps: dict[int, object] = {}  # logits_to_keep count -> its OrtValue

    def step(self, cache: KVCache, input_ids: np.ndarray, attention_mask: np.ndarray,
             position_ids: np.ndarray | None, *, all_positions: bool = False,
             rows_last: np.ndarray | None = None) -> np.ndarray:
        """[batch, vocab] logits of the last position (``rows_last``: of position ``rows_last[b]`` in row ``b``,
        for right-padded rows; ``all_positions``: [batch, sequence, vocab], to check several drafted tokens in
        one step); the cache grows by ``input_ids``' length."""
        if all_positions and not self.sig.logits_all_positions:
            raise UsageError("the graph returns the last position's logits only; all positions were asked for")
        b = self._binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        b.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        b.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, np.int64))
        if self.sig.has_position_ids:
            b.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, np.int64))
        n = input_ids.shape[1]
        offset = 0  # positions before the first one the logits cover
        if self.sig.logits_to_keep:
            keep = 0 if all_positions else n - int(np.min(rows_last)) if rows_last is not None else 1
            keep = 0 if keep >= n else keep
            offset = n - keep if keep else 0
            if keep not in self._keeps:  # made once per count; alive while the binding may read it
                import onnxruntime as ort

                self._keeps[keep] = ort.OrtValue.ortvalue_from_numpy(np.array(keep, np.int64))
            b.bind_ortvalue_input(LOGITS_TO_KEEP, self._keeps[keep])
        b.bind_output("logits")
        for name in self.extra_outputs:
            b.bind_output(name)
        cache.bind(b, input_ids.shape[1])
        self.session.run_with_iobinding(b)
        got = b.get_outputs()
        logits = got[0].numpy()
        self.extras = {name: got[1 + i].numpy() for i, name in enumerate(self.extra_outputs)}
        cache.advance(input_ids.shape[1])
        if rows_last is not None and logits.ndim == 3:
            return logits[np.arange(logits.shape[0]), np.asarray(rows_last) - offset]
        return logits if all_positions else last_logits(logits)


def decoder_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path; MissingFileError (one line, exit 2) when it is missing or a folder."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such file" if not path.exists() else f"{path}: is a folder, not an ONNX file")
    return path


def open_decoder(session_or_path, *, threads: int | None = None) -> Decoder:
    """A Decoder over a session, or over a new CPU session of an ONNX file."""
    if isinstance(session_or_path, Decoder):
        return session_or_path
    if isinstance(session_or_path, (str, os.PathLike)):
        path = decoder_file(session_or_path)
        return Decoder(make_session(path, threads=threads), name=str(path))
    return Decoder(session_or_path)


def check_prompt(dec: Decoder, rows: Sequence[Sequence[int]], width: int, max_new_tokens: int,
                 max_length: int | None) -> int:
    """The checks every generation makes of its prompt rows (``width``: the longest); returns ``max_new_tokens``
    cut to what fits. ``max_length``: prompt and new tokens together stay within it, as in transformers; the
    graph's ``max_positions``: the last new token is never fed back, so one more fits. UsageError (one line)
    for no new tokens, an empty prompt, a prompt that fills a limit, a token id outside the vocabulary."""
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    if width < 1:
        raise UsageError("the prompt is empty")
    if max_length is not None:
        if width >= max_length:
            raise UsageError(f"the prompt is {width} tokens; the model takes at most {max_length} in all "
                             "(prompt and new tokens)", hint="shorten the prompt")
        max_new_tokens = min(max_new_tokens, max_length - width)
    if dec.sig.max_positions is not None:
        if width >= dec.sig.max_positions:
            raise UsageError(f"the prompt is {width} tokens; the graph takes at most {dec.sig.max_positions} "
                             "positions", hint="shorten the prompt")
        max_new_tokens = min(max_new_tokens, dec.sig.max_positions - width + 1)
    if dec.sig.vocab is not None:
        bad = [t for r in rows for t in r if not 0 <= t < dec.sig.vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the model's vocabulary of {dec.sig.vocab}")
    return max_new_tokens


@dataclasses.dataclass
class _Clock:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0


def generate(
    session_or_path,
    prompt: Sequence[int] | Sequence[Sequence[int]] | Batch,
    *,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    stop_ids: Iterable[int] = (),
    on_token: OnToken | None = None,
    max_length: int | None = None,
    pad_id: int = 0,
    threads: int | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` for a prompt (token ids), several prompts, or a Batch.

    ``stop_ids``: a row stops after choosing one (it is kept in its tokens). ``max_length``: the model's
    maximum positions: prompt and new tokens together stay within it, as in transformers (a prompt that fills
    it is a UsageError). ``pad_id`` pads batches.
    """
    single = not isinstance(prompt, Batch) and (len(prompt) == 0 or np.ndim(prompt[0]) == 0)
    batch = prompt if isinstance(prompt, Batch) else Batch.of([prompt] if single else prompt, pad_id)
    dec = open_decoder(session_or_path, threads=threads)
    max_new_tokens = check_prompt(dec, batch.rows, batch.width, max_new_tokens, max_length)
    sampler = Sampler(sampling)
    stops = frozenset(int(t) for t in stop_ids)
    rows: list[list[int]] = [[] for _ in batch.rows]
    finish = ["length"] * batch.size
    clock = _Clock()
    # GroupQueryAttention graphs: one right-padded batch, rows of any length (batch.py)
    right = dec.sig.shared_buffer and dec.sig.logits_all_positions
    # a KIVI-form cache quantizes by position (sink, key groups): padding would shift them, so rows of one
    # length run together
    for group in batch.groups((dec.sig.has_position_ids and dec.sig.kivi is None) or right):
        _run_group(dec, batch.select(group), group, max_new_tokens, sampler, stops, on_token,
                   rows, finish, clock, right=right)
    rate = clock.decode_tokens / clock.decode_s if clock.decode_tokens and clock.decode_s > 0 else None
    return Generation([list(r) for r in batch.rows], rows, finish, clock.prefill_s * 1e3, rate, batched=not single)


def _run_group(dec: Decoder, batch: Batch, index: list[int], max_new: int,
               sampler: Sampler, stops: frozenset[int], on_token: OnToken | None,
               rows: list[list[int]], finish: list[str], clock: _Clock, right: bool = False) -> None:
    """Prefill and decode one group of rows (``index``: their places in the caller's batch; ``right``:
    right-padded rows, each read at its own last position)."""
    capacity = max(batch.width + max_new - 1, 1)  # the last new token is never fed back
    cache = new_cache(dec.sig, batch.size, capacity)
    mask = batch.attention_mask(right)
    positions = batch.position_ids()
    last = batch.lengths - 1 if right else None
    done = np.zeros(batch.size, bool)
    t0 = time.perf_counter()
    tokens = sampler(dec.step(cache, batch.input_ids(right), mask, positions, rows_last=last))
    t_first = t_last = time.perf_counter()
    clock.prefill_s += t_first - t0
    made = 0
    step = 0
    while True:
        for j, tok in enumerate(tokens.tolist()):
            if done[j]:
                continue
            rows[index[j]].append(tok)
            if step:
                made += 1
            if on_token is not None:
                on_token(index[j], tok)
            if tok in stops:
                done[j] = True
                finish[index[j]] = "stop"
        step += 1
        if done.all() or step >= max_new:
            break
        feed = np.where(done, batch.pad_id, tokens)[:, None]
        mask = (batch.attention_mask(True, step) if right
                else np.concatenate([mask, np.ones((batch.size, 1), np.int64)], axis=1))
        positions = positions[:, -1:] + 1
        tokens = sampler(dec.step(cache, feed, mask, positions))
        t_last = time.perf_counter()
    clock.decode_s += t_last - t_first
    clock.decode_tokens += made

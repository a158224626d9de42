"""A decoder served for generation: its tokenizer, limits and engine, the request parameters, and ``run``.

``DecoderService.load(path)`` opens the decoder (.onnx) with the tokenizer, ``config.json`` and
``generation_config.json`` beside it (or in ``tokenizer``), as ``graphopt generate`` does, and builds the
continuous-batching engine: ``slots`` requests decode at once, each within ``context`` positions (default: the
model's maximum, at most 2048). ``run`` streams one request as ``Chunk``s (text deltas, then the finish);
leaving its loop early (a client went away) cancels the request.

Parameters (``Params.parse``, the same names in both protocols): ``max_tokens`` (>= 1), ``temperature``
(0 greedy .. 2), ``top_p`` (0, 1], ``seed`` (int), ``stop`` (a string or up to 4), ``ignore_eos``. A bad one is
an ``ApiError`` (400) naming the parameter.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

from graphopt import io
from graphopt.errors import UsageError
from graphopt.generate import chat as tokens
from graphopt.generate.loop import open_decoder
from graphopt.generate.sampling import Sampling
from graphopt.generate.scheduler import PREFIX_ENTRIES, Scheduler
from graphopt.serve.engine import Engine
from graphopt.serve.textstream import TextStream

MAX_STOP = 4
DEFAULT_CONTEXT = 2048


class ApiError(Exception):
    """A request the server refuses: the HTTP status, one line, and the parameter at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def _number(body: dict, key: str, default, *, lo: float, hi: float, lo_open: bool = False, integer: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(f"'{key}' must be {kind} (got {value!r})", param=key)
    if value < lo or (lo_open and value == lo) or value > hi:
        low = f"> {lo}" if lo_open else f">= {lo}"
        raise ApiError(f"'{key}' must be {low} and <= {hi} (got {value!r})", param=key)
    return value


@dataclasses.dataclass(frozen=True)
class Params:
    max_tokens: int | None  # None: up to the context
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool = False

    @classmethod
    def parse(cls, body: dict, *, max_tokens: int | None, temperature: float, context: int) -> Params:
        """Parameters from a request body (``max_tokens`` / ``temperature``: the protocol's defaults);
        ``max_completion_tokens`` is taken for ``max_tokens`` (the newer chat name)."""
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        n = _number(body, "max_tokens", max_tokens, lo=1, hi=context, integer=True)
        t = float(_number(body, "temperature", temperature, lo=0, hi=2))
        p = float(_number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True))
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(f"'seed' must be an integer (got {seed!r})", param="seed")
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
            raise ApiError(f"'stop' must be a string or a list of at most {MAX_STOP} strings (got {body.get('stop')!r})",
                           param="stop")
        ignore = body.get("ignore_eos", False)
        if not isinstance(ignore, bool):
            raise ApiError(f"'ignore_eos' must be true or false (got {ignore!r})", param="ignore_eos")
        return cls(n, t, p, seed, tuple(stop), ignore)

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed)


@dataclasses.dataclass
class Chunk:
    """New text of a request; on the last one, ``finish`` ("stop" / "length") and the token counts."""

    text: str
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None  # seconds from submission to the first token (on the last chunk)


class DecoderService:
    """A decoder, its tokenizer and its engine, by name."""

    def __init__(self, name: str, path: Path, tokenizer, engine: Engine, stop_ids: list[int]):
        self.name, self.path, self.tokenizer, self.engine, self.stop_ids = name, path, tokenizer, engine, stop_ids
        self.context = engine.scheduler.context
        self.created = int(time.time())

    @classmethod
    def load(cls, path: str | Path, *, name: str | None = None, tokenizer: str | Path | None = None,
             slots: int = 8, context: int | None = None, max_queue: int = 64, prefill_tokens: int = 512,
             prefix_cache: int = PREFIX_ENTRIES, threads: int | None = None) -> DecoderService:
        path = Path(path)
        folder = tokens.tokenizer_folder(path, tokenizer)
        tok = tokens.load_tokenizer(folder)
        decoder = open_decoder(path, threads=threads)
        folders = (folder, path.parent)
        limits = [x for x in (tokens.max_positions(tok, *folders), decoder.sig.max_positions) if x]
        limit = min(limits) if limits else None
        if context is None:
            context = min(limit or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
        elif limit is not None and context > limit:
            raise UsageError(f"--context {context} is over the model's maximum of {limit} positions")
        sched = Scheduler(decoder, slots=slots, context=context, pad_id=tokens.pad_id(tok),
                          prefill_tokens=prefill_tokens, prefix_cache=prefix_cache)
        return cls(name or path.name.split(".")[0], path, tok, Engine(sched, max_queue=max_queue),
                   tokens.stop_ids(tok, *folders))

    # -- prompts ---------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return tokens.encode(self.tokenizer, text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The messages through the tokenizer's chat template, with the generation prompt."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError("the model's tokenizer has no chat template: use /v1/completions", param="messages")
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise ApiError(f"the chat template does not render these messages: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}", param="messages") from None
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    # -- one request -----------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: Params):
        """Queue the request (ApiError 400 for a prompt over the context; Busy / Closing)."""
        sampling = params.sampling()
        stops = self.stop_ids
        if params.ignore_eos:
            sampling, stops = sampling.masking(stops), []
        max_new = params.max_tokens if params.max_tokens is not None else self.context
        try:
            return self.engine.submit(prompt, max_new, sampling, stops)
        except UsageError as e:
            code = "context_length_exceeded" if "at most" in str(e) else None
            raise ApiError(str(e), param="prompt" if code else None, code=code) from None

    async def run(self, stream, params: Params) -> AsyncIterator[Chunk]:
        """The request's text as it is generated; the last Chunk has ``finish``. Cancels it when left early
        or when a stop string ends it."""
        text = TextStream(self.tokenizer, params.stop)
        seq = stream.seq
        finish = None
        first = None
        try:
            while finish is None:
                tok, finish = await stream.next()
                if first is None:
                    first = time.perf_counter() - stream.submitted
                delta = text.push(tok)
                if text.stopped:
                    finish = "stop"
                elif finish is not None:
                    delta += text.flush()
                if finish is None and delta:
                    yield Chunk(delta)
            yield Chunk(delta, finish, len(seq.prompt), len(seq.tokens), first)
        finally:
            if seq.finish is None:
                self.engine.cancel(stream)


def is_decoder(path: str | Path) -> bool:
    """Whether ``path`` is an .onnx file with past KV inputs (a decoder served for generation)."""
    path = Path(path)
    if not path.is_file():
        return False
    model = io.load(path, check_external=False)
    return any(v.name.startswith("past_key_values.") for v in model.graph.inputs)

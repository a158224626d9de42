"""Decoders under one interface for ``bench --generate``: graphopt's runtime and the PyTorch reference.

Every variant takes the same prompt token ids and generates greedily with the end-of-sequence ids masked (so
it always makes ``max_new`` tokens), and reports its clocks the way ``graphopt.generate.loop`` does::

    prefill_s   prompt in -> first new token chosen
    decode_s    first new token -> last new token (``max_new - 1`` decode steps)

``window_logits(ids)`` is the [len(ids), vocab] logits of a whole window fed from an empty cache (perplexity).
``kv_bytes_per_token`` is what one more position costs in the variant's KV cache. The ONNX Runtime GenAI and
llama.cpp variants are in :mod:`graphopt.bench.peers`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.cache import new_cache
from graphopt.generate.loop import Decoder, generate
from graphopt.generate.sampling import GREEDY
from graphopt.generate.speculative import make_draft, speculative_generate
from graphopt.runtime.session import make_session


@dataclasses.dataclass
class Run:
    """One generation: its new tokens and clocks (seconds)."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    accepted_per_step: float | None = None  # speculative decoding: draft tokens kept per verifying forward

    @property
    def decode_tokens_per_s(self) -> float | None:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None


class Variant:
    """What the benchmark drives: a name, the file it runs, its thread count, and three calls."""

    kind = "variant"
    name: str
    model: str | None
    threads: int
    kv_bytes_per_token: int | None = None

    def generate(self, prompt: Sequence[int], max_new: int) -> Run:
        raise NotImplementedError

    def window_logits(self, ids: Sequence[int]) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        """Drop the model (its memory goes back before the next thread count loads)."""


def masked_argmax(logits: np.ndarray, stops: Iterable[int]) -> int:
    """The greedy token of one row of logits with the stop ids masked."""
    x = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
    idx = [s for s in stops if 0 <= s < x.size]
    if idx:
        x[idx] = -np.inf
    return int(np.argmax(x))


class GraphoptVariant(Variant):
    """A graphopt ONNX decoder on ``graphopt.generate`` (one session, intra-op spinning off)."""

    kind = "graphopt"

    def __init__(self, path: str | Path, *, name: str, threads: int, stop_ids: Sequence[int],
                 speculative: str = "off", draft: str | None = None):
        self.name, self.model, self.threads, self.speculative = name, str(path), threads, speculative
        self.decoder = Decoder(make_session(path, threads=threads, spinning=False), name=str(path))
        # the draft made once (a draft model loads once and carries its measured acceptance from one generation to
        # the next); "lookup+draft": prompt lookup where the text repeats, the draft model elsewhere
        mode = {"draft": "off", "lookup+draft": "lookup"}.get(speculative, speculative)
        self.draft = make_draft(mode, self.decoder, draft) if speculative != "off" else None
        self.sampling = GREEDY.masking(list(stop_ids))
        sig = self.decoder.sig
        self.kv_bytes_per_token = 2 * sig.layers * sig.kv_heads * sig.head_dim * np.dtype(sig.dtype).itemsize

    def generate(self, prompt: Sequence[int], max_new: int) -> Run:
        if self.speculative != "off":
            g = speculative_generate(self.decoder, list(prompt), max_new_tokens=max_new, sampling=self.sampling,
                                     draft=self.draft)
        else:
            g = generate(self.decoder, list(prompt), max_new_tokens=max_new, sampling=self.sampling)
        tokens = list(g.token_ids)
        rate = g.decode_tokens_per_s
        return Run(tokens, g.prefill_ms / 1e3, (len(tokens) - 1) / rate if rate else 0.0,
                   getattr(g, "accepted_per_step", None))

    def window_logits(self, ids: Sequence[int]) -> np.ndarray:
        dec, n = self.decoder, len(ids)
        cache = new_cache(dec.sig, 1, n)
        arr = np.asarray([ids], np.int64)
        pos = np.arange(n, dtype=np.int64)[None]
        if dec.sig.logits_all_positions:
            return dec.step(cache, arr, np.ones((1, n), np.int64), pos, all_positions=True)[0]
        rows = [dec.step(cache, arr[:, i:i + 1], np.ones((1, i + 1), np.int64), pos[:, i:i + 1])[0] for i in range(n)]
        return np.stack(rows)

    def close(self) -> None:
        self.decoder = self.draft = None


class _Stamps:
    """A transformers streamer that only records when each put came (the prompt first, then each new token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TorchVariant(Variant):
    """PyTorch eager fp32 on the Hugging Face folder: transformers ``generate``, greedy, ``min_new_tokens``
    (transformers masks the end-of-sequence ids until then)."""

    kind = "pytorch"

    def __init__(self, folder: str | Path, *, name: str = "pytorch-fp32", threads: int, stop_ids: Sequence[int],
                 pad_id: int = 0):
        import torch
        import transformers

        self.name, self.model, self.threads = name, str(folder), threads
        self.stops, self.pad_id = [int(s) for s in stop_ids], pad_id
        torch.set_num_threads(threads)
        transformers.utils.logging.disable_progress_bar()
        try:
            self.net = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        except Exception as e:
            raise UsageError(f"{folder}: transformers cannot load the Hugging Face folder: {type(e).__name__}: {e}"
                             .splitlines()[0]) from e
        cfg = self.net.config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv * head_dim * 4

    def generate(self, prompt: Sequence[int], max_new: int) -> Run:
        import torch

        torch.set_num_threads(self.threads)  # process-wide: set before every run
        stamps = _Stamps()
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                    min_new_tokens=max_new, do_sample=False, eos_token_id=self.stops or None,
                                    pad_token_id=self.pad_id, streamer=stamps)
        tokens = out[0, len(prompt):].tolist()
        t = stamps.times  # t[0]: the prompt, t[1]: the first new token, t[-1]: the last
        return Run(tokens, t[1] - t0, t[-1] - t[1])

    def window_logits(self, ids: Sequence[int]) -> np.ndarray:
        import torch

        torch.set_num_threads(self.threads)
        with torch.no_grad():
            return self.net(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()

    def close(self) -> None:
        self.net = None

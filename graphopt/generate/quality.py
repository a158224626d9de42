"""Decoder quality on text: the ``ppl_ratio`` and ``greedy_match`` budget metrics.

Text (a file given with ``--calib FILE.txt``, else :data:`graphopt.data.heldout.TEXT`) is tokenized with the
tokenizer beside the model (no tokenizer files there: its UTF-8 bytes, each byte one token id modulo the
vocabulary) and cut into non-overlapping windows of ``window`` tokens. Windows alternate between the
calibration rows (even windows) and the held-back rows (odd windows), so the two never share a token::

    tokens  | w0 calib | w1 held | w2 calib | w3 held | ...
    prompt  |p0..      |p1..     |p2..      |p3..     |        (the first prompt_tokens of a window)

- ``ppl_ratio``: perplexity of the candidate over the reference's on the same windows. Each window is one
  teacher-forced forward with an empty past (all positions' logits in one run; a graph that returns only the
  last position's logits is fed one token at a time), ``ppl = exp(mean NLL of tokens 1..L-1)``.
- ``greedy_match``: each window's first ``prompt_tokens`` are a prompt; both models generate ``new_tokens``
  greedy tokens (``loop.generate``, no stop tokens). A prompt's match is the length of the common prefix of
  the two token lists over ``new_tokens``; ``greedy_match`` is the mean over prompts. A common prefix, not a
  position-wise count: after the first different token the two continue from different texts, and agreement
  there says nothing about the candidate. 1 means identical greedy output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from graphopt.data import heldout
from graphopt.errors import UsageError
from graphopt.generate import chat
from graphopt.generate.cache import new_cache
from graphopt.generate.loop import Decoder, generate, open_decoder

CALIB, HELD = "calib", "held"


@dataclasses.dataclass(frozen=True)
class TextRows:
    """Token windows and greedy prompts of the calibration and the held-back rows (disjoint)."""

    windows: dict[str, tuple[tuple[int, ...], ...]]
    prompts: dict[str, tuple[tuple[int, ...], ...]]
    #: (start, end) of each window in the token stream, per part
    spans: dict[str, tuple[tuple[int, int], ...]]
    new_tokens: int
    source: str = "text"

    def describe(self) -> str:
        w = {p: len(v) for p, v in self.windows.items()}
        size = len(self.windows[CALIB][0])
        return (f"{self.source}: {w[CALIB]} calibration + {w[HELD]} held-back windows of {size} tokens; "
                f"{len(self.prompts[HELD])} held-back prompts x {self.new_tokens} greedy tokens")


def split_tokens(ids: Sequence[int], *, window: int = 64, prompt_tokens: int = 16, new_tokens: int = 32,
                 max_windows: int = 16, prompts: int = 4, source: str = "text") -> TextRows:
    """Cut ``ids`` into alternating calibration / held-back windows (see the module docstring)."""
    if window < 2 or not 1 <= prompt_tokens < window or new_tokens < 1:
        raise UsageError(f"text windows need window >= 2, 1 <= prompt_tokens < window and new_tokens >= 1 "
                         f"(got {window}, {prompt_tokens}, {new_tokens})")
    n = min(len(ids) // window, 2 * max_windows)
    if n < 2:
        raise UsageError(f"{source}: {len(ids)} tokens; the decoder metrics need at least {2 * window} "
                         f"(a calibration and a held-back window of {window})", hint="give a longer text")
    spans: dict[str, list[tuple[int, int]]] = {CALIB: [], HELD: []}
    for i in range(n):
        spans[CALIB if i % 2 == 0 else HELD].append((i * window, (i + 1) * window))
    wins = {p: tuple(tuple(int(t) for t in ids[a:b]) for a, b in s) for p, s in spans.items()}
    proms = {p: tuple(w[:prompt_tokens] for w in ws[:prompts]) for p, ws in wins.items()}
    return TextRows(wins, proms, {p: tuple(s) for p, s in spans.items()}, new_tokens, source)


def text_ids(text: str, tokenizer_dir: str | Path | None, vocab: int | None) -> list[int]:
    """Token ids of ``text``: the tokenizer in ``tokenizer_dir``, else UTF-8 bytes modulo ``vocab``."""
    if tokenizer_dir is not None:
        tok = chat.load_tokenizer(tokenizer_dir)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    v = vocab or 256
    return [b % v for b in text.encode("utf-8")]


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(text, where it came from): the file ``path`` (UTF-8), else the default held-out text."""
    if path is None:
        return heldout.TEXT, "default held-out text"
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p}: no such text file", hint="give a UTF-8 text file, e.g. --calib text.txt")
    try:
        return p.read_text(encoding="utf-8"), str(p)
    except UnicodeDecodeError as e:
        raise UsageError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _tokenizer_beside(model_path: str | Path | None, tokenizer: str | Path | None) -> Path | None:
    if tokenizer is not None:
        return chat.tokenizer_folder(model_path or tokenizer, tokenizer)
    if model_path is None:
        return None
    folder = Path(model_path).parent
    return folder if any((folder / f).is_file() for f in chat.TOKENIZER_FILES) else None


def nll(logits: np.ndarray, targets: Sequence[int]) -> float:
    """Sum of -log p(target) over rows of ``logits`` [n, vocab] (float64 log-softmax)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x).sum(axis=-1))
    return float(np.sum(lse - x[np.arange(len(targets)), np.asarray(targets)]))


def perplexity(decoder: Decoder, windows: Sequence[Sequence[int]], chunk: int | None = None) -> float:
    """Teacher-forced perplexity over ``windows`` (each from an empty past); ``chunk``: each window fed in steps of
    that many positions, each reading the cache as the runtime holds it (a quantized cache's loss at length)."""
    total, count = 0.0, 0
    for w in windows:
        ids = np.asarray(w, np.int64)[None, :]
        n = ids.shape[1]
        cache = new_cache(decoder.sig, 1, n)
        pos = np.arange(n, dtype=np.int64)[None, :]
        count += n - 1
        if chunk and decoder.sig.logits_all_positions:  # scored chunk by chunk: a long window's logits are GBs
            for a in range(0, n, chunk):
                b = min(a + chunk, n)
                logits = decoder.step(cache, ids[:, a:b], np.ones((1, b), np.int64), pos[:, a:b], all_positions=True)[0]
                last = min(b, n - 1)  # logits at position i predict token i + 1
                if last > a:
                    total += nll(logits[:last - a], w[a + 1:last + 1])
            continue
        if decoder.sig.logits_all_positions:
            logits = decoder.step(cache, ids, np.ones((1, n), np.int64), pos, all_positions=True)[0]
        else:  # last-position logits only: one token at a time
            logits = np.stack([decoder.step(cache, ids[:, i:i + 1], np.ones((1, i + 1), np.int64), pos[:, i:i + 1])[0]
                               for i in range(n)])
        total += nll(logits[:-1], w[1:])
    return math.exp(total / count)


def greedy(decoder: Decoder, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """``new_tokens`` greedy tokens after each prompt (no stop tokens)."""
    return [list(r) for r in generate(decoder, [list(p) for p in prompts], max_new_tokens=new_tokens).rows]


def common_prefix_fraction(got: Sequence[Sequence[int]], ref: Sequence[Sequence[int]], new_tokens: int) -> float:
    """Mean over rows of the common prefix of ``got[i]`` and ``ref[i]`` over ``new_tokens``."""
    fr = []
    for g, r in zip(got, ref, strict=True):
        k = 0
        while k < min(len(g), len(r)) and g[k] == r[k]:
            k += 1
        fr.append(k / new_tokens)
    return float(np.mean(fr)) if fr else 1.0


@dataclasses.dataclass
class DecoderCheck:
    """The reference decoder's perplexity and greedy tokens on both parts of ``rows``, computed once;
    :meth:`measure` scores a candidate against them."""

    rows: TextRows
    ref_ppl: dict[str, float]
    ref_greedy: dict[str, list[list[int]]]

    @classmethod
    def of(cls, reference, rows: TextRows) -> DecoderCheck:
        """``reference``: an ORT session, a Decoder or an ONNX path."""
        dec = open_decoder(reference, threads=1)
        return cls(rows, {p: perplexity(dec, rows.windows[p]) for p in (CALIB, HELD)},
                   {p: greedy(dec, rows.prompts[p], rows.new_tokens) for p in (CALIB, HELD)})

    def measure(self, candidate, part: str = HELD) -> dict[str, float]:
        """``ppl_ratio``, ``greedy_match`` (and ``ppl``, ``ppl_reference``) of ``candidate`` (a session, a
        Decoder or an ONNX path) on ``part``'s rows."""
        dec = open_decoder(candidate, threads=1)
        ppl = perplexity(dec, self.rows.windows[part])
        got = greedy(dec, self.rows.prompts[part], self.rows.new_tokens)
        return {"ppl_ratio": ppl / self.ref_ppl[part],
                "greedy_match": common_prefix_fraction(got, self.ref_greedy[part], self.rows.new_tokens),
                "ppl": ppl, "ppl_reference": self.ref_ppl[part]}


def decoder_check(reference, *, model_path: str | Path | None = None, text: str | Path | None = None,
                  tokenizer: str | Path | None = None, **split) -> DecoderCheck:
    """A :class:`DecoderCheck` of ``reference`` (session, Decoder or path) on ``text`` (a file; None: the
    default held-out text), tokenized with the tokenizer beside ``model_path`` (or ``tokenizer``)."""
    dec = open_decoder(reference, threads=1)  # a UsageError in one line when it is not a decoder with past
    body, where = read_text(text)
    tok = _tokenizer_beside(model_path if model_path is not None else
                            (reference if isinstance(reference, (str, Path)) else None), tokenizer)
    ids = text_ids(body, tok, dec.sig.vocab)
    src = f"{where} ({'tokenizer ' + str(tok) if tok else 'UTF-8 bytes as token ids'})"
    return DecoderCheck.of(dec, split_tokens(ids, source=src, **split))

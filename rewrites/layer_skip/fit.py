"""Data, fitting and measuring of ``layer-skip-draft``: the model's greedy text, a least-squares exit head,
the draft's acceptance, and what each forward costs.

Collection: each prompt is continued greedily by the model, then run once teacher-forced with the hidden
states entering the candidate layers and the LM head's input (the final normed hidden state) as extra outputs.
The exit head of layer L is a least-squares fit (closed form, numpy, float64) of ``rms(h_L) @ A + c`` to
``h_final`` over the calibration positions: per-dimension scale and shift, plus a ridge-regressed full
correction (a full map alone fits the calibration text and misses held-out text). Acceptance is measured by the draft graph
itself (cut out of the model, ORT) teacher-forced on held-out continuations: at generated position t the draft
is kept when its argmax is the model's; ``chain[j]`` = P(the first j drafts from a position are all kept).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from graphopt.generate.cache import KVCache
from graphopt.generate.layer_skip import rms_normalise
from graphopt.generate.loop import Decoder, generate


@dataclasses.dataclass
class Texts:
    """Greedy sequences, each one's prompt length, the model's choice per position, and hidden states by name."""

    seqs: list[list[int]]
    starts: list[int]
    choices: list[np.ndarray]
    hidden: dict[str, list[np.ndarray]]


def _forward(dec: Decoder, seq: Sequence[int]) -> np.ndarray:
    n = len(seq)
    cache = KVCache(dec.sig, 1, n)
    return dec.step(cache, np.asarray([seq], np.int64), np.ones((1, n), np.int64),
                    np.arange(n, dtype=np.int64)[None], all_positions=True)[0]


def collect(dec: Decoder, names: Sequence[str], prompts: Sequence[Sequence[int]], new_tokens: int) -> Texts:
    """Greedy continuations of ``prompts`` and, teacher-forced, the model's choices and the values ``names``."""
    out = Texts([], [], [], {n: [] for n in names})
    for prompt in prompts:
        dec.extra_outputs = ()
        seq = list(prompt) + list(generate(dec, list(prompt), max_new_tokens=new_tokens).token_ids)
        dec.extra_outputs = tuple(names)
        out.choices.append(_forward(dec, seq).argmax(-1))
        for n in names:
            out.hidden[n].append(dec.extras[n][0].astype(np.float32))
        out.seqs.append(seq)
        out.starts.append(len(prompt))
    dec.extra_outputs = ()
    return out


def fit_map(x: np.ndarray, y: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """(A [hidden, hidden], c [hidden]) with ``rms(x) A + c ~ y``: a per-dimension scale and shift (least
    squares per dimension), plus a full correction fitted to what it leaves by ridge regression (penalty
    ``ridge`` times the number of rows): a full map alone overfits a few thousand positions."""
    xn = rms_normalise(x)
    y = y.astype(np.float64)
    xm, ym = xn.mean(0), y.mean(0)
    scale = ((xn - xm) * (y - ym)).sum(0) / (((xn - xm) ** 2).sum(0) + 1e-12)
    shift = ym - scale * xm
    x1 = np.concatenate([xn, np.ones((len(xn), 1))], axis=1)
    gram = x1.T @ x1
    gram[np.diag_indices(len(gram))] += ridge * len(xn)
    sol = np.linalg.solve(gram, x1.T @ (y - (xn * scale + shift)))
    return (np.diag(scale) + sol[:-1]).astype(np.float32), (shift + sol[-1]).astype(np.float32)


def chain_table(draft: Decoder, texts: Texts, drafts: int) -> list[float]:
    """P(the first j drafts are kept), j = 1 .. ``drafts``, over the generated positions of ``texts``."""
    runs = []
    for seq, start, choice in zip(texts.seqs, texts.starts, texts.choices):
        hit = (_forward(draft, seq).argmax(-1) == choice)[start - 1:-1]
        for t in range(len(hit) - drafts + 1):
            runs.append(np.cumprod(hit[t:t + drafts]))
    return [float(v) for v in np.mean(runs, axis=0)] if runs else [0.0] * drafts


def forward_seconds(decs: Sequence[tuple[Decoder, Sequence[int]]], past: int, repeats: int) -> list[dict[int, float]]:
    """Median seconds of a forward of each width on a ``past``-token cache, per decoder (interleaved)."""
    seconds: list[dict[int, list[float]]] = [{} for _ in decs]
    for _ in range(repeats):
        for i, (dec, widths) in enumerate(decs):
            for w in widths:
                cache = KVCache(dec.sig, 1, past + w)
                dec.step(cache, np.ones((1, past), np.int64), np.ones((1, past), np.int64),
                         np.arange(past, dtype=np.int64)[None])
                t = time.perf_counter()
                dec.step(cache, np.ones((1, w), np.int64), np.ones((1, past + w), np.int64),
                         np.arange(past, past + w, dtype=np.int64)[None], all_positions=w > 1)
                seconds[i].setdefault(w, []).append(time.perf_counter() - t)
    return [{w: float(np.median(v)) for w, v in s.items()} for s in seconds]


def best_drafts(chain: Sequence[float], ratio: Sequence[float], draft_cost: float) -> tuple[int, float]:
    """(drafts per step, expected tokens/s over plain decoding): a step of k drafts makes ``1 + chain[0] + ..
    + chain[k-1]`` tokens in ``k`` draft forwards (``draft_cost`` each, over a plain one) and a verifying
    forward of width k + 1 (``ratio[k]``, over a plain one)."""
    best, expected = (0, 1.0), 1.0
    for k, p in enumerate(chain, 1):
        expected += p
        gain = expected / (ratio[k] + k * draft_cost)
        if gain > best[1]:
            best = (k, gain)
    return best

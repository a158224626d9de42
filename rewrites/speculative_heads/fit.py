"""Data and fitting of ``speculative-heads``: the model's own greedy text, its hidden states, Medusa-1 heads.

Self-distillation: each prompt is continued greedily by the model; the whole sequence is then run once
(teacher-forced) with the LM head's input ``h`` as an extra output. Head k (k = 0 .. K-1) at position t is
fitted to the model's own choice at position t + k + 1 (the token at t + k + 2), through the shared LM head::

    head_k(h) = W_lm · (h + SiLU(h W_k + b_k))        W_k, b_k start at 0 (head_k = the LM head)

Cross-entropy, Adam, minibatches, in torch on CPU. Acceptance (``chain_table``) is what the speculative loop
keeps: the drafts of position t are accepted up to the first head that misses.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from graphopt.generate.cache import KVCache
from graphopt.generate.loop import Decoder, generate


@dataclasses.dataclass
class Rows:
    """Hidden states [N, hidden] and each position's targets [N, K] (-1: past the sequence's end)."""

    hidden: np.ndarray
    targets: np.ndarray


def collect(dec: Decoder, hidden_name: str, prompts: Sequence[Sequence[int]], new_tokens: int, k: int) -> Rows:
    """Greedy continuations of ``prompts``, then one teacher-forced forward each: ``h`` and the model's choices."""
    dec.extra_outputs = (hidden_name,)
    hs, ts = [], []
    for prompt in prompts:
        g = generate(dec, list(prompt), max_new_tokens=new_tokens)
        seq = list(prompt) + list(g.token_ids)
        n = len(seq)
        cache = KVCache(dec.sig, 1, n)
        logits = dec.step(cache, np.asarray([seq], np.int64), np.ones((1, n), np.int64),
                          np.arange(n, dtype=np.int64)[None], all_positions=True)[0]
        choice = logits.argmax(-1)
        targets = np.full((n, k), -1, np.int64)
        for j in range(k):
            targets[: n - j - 1, j] = choice[j + 1:]
        hs.append(dec.extras[hidden_name][0].astype(np.float32))
        ts.append(targets)
    dec.extra_outputs = ()
    return Rows(np.concatenate(hs), np.concatenate(ts))


def fit_heads(rows: Rows, lm_head: np.ndarray, *, epochs: int, lr: float, batch: int, seed: int,
              seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """(W [K, hidden, hidden], b [K, hidden]) fitted on ``rows`` (stops early after ``seconds``)."""
    import torch

    torch.manual_seed(seed)
    k = rows.targets.shape[1]
    hidden = rows.hidden.shape[1]
    h = torch.from_numpy(rows.hidden)
    t = torch.from_numpy(rows.targets)
    lm = torch.from_numpy(np.array(lm_head, np.float32))
    w = torch.zeros(k, hidden, hidden, requires_grad=True)
    b = torch.zeros(k, hidden, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=lr)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(h))
        for i in range(0, len(order), batch):
            idx = torch.from_numpy(order[i:i + batch])
            x, y = h[idx], t[idx]
            r = x[:, None, :] + torch.nn.functional.silu(torch.einsum("nh,khj->nkj", x, w) + b)
            logits = r @ lm
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, lm.shape[1]), y.reshape(-1), ignore_index=-1)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if time.perf_counter() - start > seconds:
            break
    return w.detach().numpy().copy(), b.detach().numpy().copy()


def head_choices(rows: Rows, lm_head: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N, K] top-1 of each head (numpy, the graph's arithmetic)."""
    out = np.empty(rows.targets.shape, np.int64)
    for j in range(w.shape[0]):
        z = rows.hidden @ w[j] + b[j]
        r = rows.hidden + z / (1.0 + np.exp(-z))
        for i in range(0, len(r), 512):
            out[i:i + 512, j] = (r[i:i + 512] @ lm_head).argmax(-1)
    return out


def chain_table(rows: Rows, choices: np.ndarray) -> list[float]:
    """P(the first j drafts are all accepted), j = 1 .. K, over the positions with K targets."""
    valid = (rows.targets >= 0).all(axis=1)
    hit = (choices == rows.targets)[valid]
    run = np.cumprod(hit, axis=1)
    return [float(x) for x in run.mean(axis=0)] if len(run) else [0.0] * choices.shape[1]


def best_gain(chain: Sequence[float], ratio: Sequence[float]) -> tuple[int, float]:
    """(drafts per step, expected tokens per second over plain decoding): ``ratio[w - 1]`` the cost of a width-w
    forward of the graph with heads over a one-token forward of the graph without."""
    best = (0, 1.0)  # no drafts: plain decoding on the graph without heads
    expected = 1.0
    for j, p in enumerate(chain, 1):
        expected += p
        gain = expected / ratio[j]
        if gain > best[1]:
            best = (j, gain)
    return best


def forward_ratios(plain: Decoder, heads: Decoder, width: int, past: int, repeats: int) -> list[float]:
    """Median seconds of a forward of width 1 .. ``width`` on a ``past``-token cache with heads, over a plain
    one-token forward without them (interleaved, medians)."""
    seconds: dict[tuple[int, int], list[float]] = {}
    for _ in range(repeats):
        for which, dec in ((0, plain), (1, heads)):
            for w in ([1] if which == 0 else range(1, width + 1)):
                cache = KVCache(dec.sig, 1, past + w)
                ids = np.ones((1, past), np.int64)
                dec.step(cache, ids, np.ones((1, past), np.int64), np.arange(past, dtype=np.int64)[None],
                         all_positions=True)
                feed = np.ones((1, w), np.int64)
                t = time.perf_counter()
                dec.step(cache, feed, np.ones((1, past + w), np.int64),
                         np.arange(past, past + w, dtype=np.int64)[None], all_positions=True)
                seconds.setdefault((which, w), []).append(time.perf_counter() - t)
    one = float(np.median(seconds[(0, 1)]))
    return [float(np.median(seconds[(1, w)])) / one for w in range(1, width + 1)]

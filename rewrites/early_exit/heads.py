"""``early-exit``: pooled features and exit heads in numpy (fitted by self-distillation to the final logits).

Heads: ``linear`` (ridge regression), ``logistic`` (soft-target multinomial regression), ``mlp`` (one tanh
hidden layer, soft targets); each with a softmax temperature fitted on rows it was not fitted on.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def pool_features(h: np.ndarray, mask: np.ndarray | None, pool: str) -> np.ndarray:
    """Pooled ``[batch, F]`` features of hidden states ``[batch, seq, H]`` (as the graph computes them):
    ``cls`` (first token), ``mean`` (masked mean), ``max`` (over real tokens), ``last`` (last real token,
    right padding), or ``cls+mean`` (both concatenated)."""
    parts = []
    m = np.ones(h.shape[:2], np.float32) if mask is None else mask.astype(np.float32)
    if "cls" in pool:
        parts.append(h[:, 0, :])
    if "mean" in pool:
        num = (h * m[:, :, None]).sum(1)
        parts.append(num / np.maximum(m.sum(1, keepdims=True), 1.0))
    if "max" in pool:
        parts.append((h + ((1.0 - m) * -1e9)[:, :, None]).max(1))
    if "last" in pool:
        last = np.maximum(m.sum(1).astype(np.int64) - 1, 0)
        parts.append(h[np.arange(h.shape[0]), last, :])
    return np.concatenate(parts, axis=1).astype(np.float32)


@dataclasses.dataclass
class Head:
    """An exit head: standardise, optional tanh hidden layer, linear output; ``temperature`` for the criterion."""

    kind: str
    mean: np.ndarray
    scale: np.ndarray
    layers: list[tuple[np.ndarray, np.ndarray]]
    temperature: float = 1.0

    def logits(self, x: np.ndarray) -> np.ndarray:
        z = (x - self.mean) * self.scale
        for i, (w, b) in enumerate(self.layers):
            z = z @ w + b
            if i + 1 < len(self.layers):
                z = np.tanh(z)
        return z.astype(np.float32)

    def folded(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Layers with the standardisation folded into the first one (what the graph holds)."""
        (w0, b0), rest = self.layers[0], self.layers[1:]
        w = (self.scale[:, None] * w0).astype(np.float32)
        b = (b0 - (self.mean * self.scale) @ w0).astype(np.float32)
        return [(w, b)] + [(a.astype(np.float32), c.astype(np.float32)) for a, c in rest]


def _adam_fit(x: np.ndarray, p: np.ndarray, hidden: int, l2: float, steps: int, seed: int) -> list:
    """Soft-target cross-entropy fit of a linear (hidden=0) or one-hidden-layer tanh network."""
    rng = np.random.default_rng(seed)
    f, c = x.shape[1], p.shape[1]
    dims = [f, hidden, c] if hidden else [f, c]
    params = []
    for a, b in zip(dims[:-1], dims[1:]):
        params += [rng.normal(0, 1 / math.sqrt(a), (a, b)).astype(np.float32), np.zeros(b, np.float32)]
    m = [np.zeros_like(q) for q in params]
    v = [np.zeros_like(q) for q in params]
    lr, b1, b2 = 0.02, 0.9, 0.999
    x, p = x.astype(np.float32), p.astype(np.float32)
    n = x.shape[0]
    for t in range(1, steps + 1):
        acts = [x]
        z = x
        for i in range(0, len(params), 2):
            z = z @ params[i] + params[i + 1]
            if i + 2 < len(params):
                z = np.tanh(z)
            acts.append(z)
        g = (softmax(z) - p) / n
        grads = [None] * len(params)
        for i in range(len(params) - 2, -1, -2):
            grads[i] = acts[i // 2].T @ g + l2 * params[i]
            grads[i + 1] = g.sum(0)
            if i:
                g = (g @ params[i].T) * (1 - acts[i // 2] ** 2)
        for i, gr in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * gr
            v[i] = b2 * v[i] + (1 - b2) * gr * gr
            params[i] -= lr * (m[i] / (1 - b1**t)) / (np.sqrt(v[i] / (1 - b2**t)) + 1e-8)
    return [(params[i], params[i + 1]) for i in range(0, len(params), 2)]


def fit_head(kind: str, x: np.ndarray, z: np.ndarray, seed: int = 0) -> Head:
    """Fit an exit head of ``kind`` on features ``x`` to the teacher logits ``z``."""
    mean = x.mean(0)
    scale = 1.0 / (x.std(0) + 1e-6)
    xs = ((x - mean) * scale).astype(np.float64)
    if kind == "linear":
        lam = 1.0 * xs.shape[0]
        xa = np.concatenate([xs, np.ones((xs.shape[0], 1))], 1)
        reg = lam * np.eye(xa.shape[1])
        reg[-1, -1] = 0.0
        wb = np.linalg.solve(xa.T @ xa + reg, xa.T @ z.astype(np.float64))
        layers = [(wb[:-1], wb[-1])]
    elif kind == "logistic":
        layers = _adam_fit(xs, softmax(z.astype(np.float64)), 0, 1e-3, 150, seed)
    elif kind == "mlp":
        layers = _adam_fit(xs, softmax(z.astype(np.float64)), 32, 1e-3, 200, seed)
    else:
        raise ValueError(kind)
    return Head(kind, mean.astype(np.float32), scale.astype(np.float32), layers)


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """Softmax temperature minimising the negative log-likelihood of ``labels`` (grid search)."""
    best, best_t = np.inf, 1.0
    for t in np.exp(np.linspace(np.log(0.05), np.log(20.0), 60)):
        lp = np.log(softmax(logits / t) + 1e-12)
        nll = -lp[np.arange(len(labels)), labels].mean()
        if nll < best:
            best, best_t = nll, float(t)
    return best_t

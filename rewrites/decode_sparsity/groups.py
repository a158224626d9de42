"""Calibration of ``decode-sparsity`` in numpy: neuron groups, the router, the local error of a keep level.

For one gated FFN and its input rows ``X`` (calibration tokens), the neurons are cut into units (one neuron
for float weights, one 4-bit block of 32 for MatMulNBits: the down projection is cut along K in whole
blocks) and each unit's output contribution ``‖a_u W_down[u]‖`` per token is computed. Units that matter for
the same tokens are clustered into ``G`` groups of equal size (balanced spherical k-means on the
per-token contribution profiles), so that a token needs few groups. The router is a least-squares linear map
from ``[X, 1]`` to each group's contribution norm ``‖Σ_{u∈g} a_u W_down[u]‖``; a token runs the ``k`` groups
it scores highest.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from graphopt.rewrites.common.gated_ffn import GatedFFN


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def balanced_clusters(profiles: np.ndarray, n_groups: int, *, iters: int = 12, seed: int = 0) -> list[np.ndarray]:
    """Rows of ``profiles`` [U, T] into ``n_groups`` groups of ``U / n_groups`` rows (sorted index arrays),
    by cosine similarity to the group centres, each row to its most similar centre with room left."""
    u = profiles.shape[0]
    cap = u // n_groups
    p = profiles / np.maximum(np.linalg.norm(profiles, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(seed)
    centres = p[rng.choice(u, n_groups, replace=False)]
    assign = np.zeros(u, np.int64)
    for _ in range(iters):
        sim = p @ centres.T  # [U, G]
        order = np.argsort(-sim, axis=None)
        assign[:] = -1
        room = np.full(n_groups, cap)
        for flat in order:
            i, g = divmod(int(flat), n_groups)
            if assign[i] < 0 and room[g] > 0:
                assign[i], room[g] = g, room[g] - 1
        new = np.stack([p[assign == g].mean(axis=0) for g in range(n_groups)])
        new /= np.maximum(np.linalg.norm(new, axis=1, keepdims=True), 1e-12)
        if np.allclose(new, centres):
            break
        centres = new
    return [np.flatnonzero(assign == g) for g in range(n_groups)]


@dataclasses.dataclass
class Calibrated:
    """Groups (neuron indices), router and the per-token group outputs of one FFN on calibration tokens."""

    groups: list[np.ndarray]
    router: tuple[np.ndarray, np.ndarray]
    #: [T, G, H] each group's output per calibration token, and the router's scores [T, G]
    outputs: np.ndarray
    scores: np.ndarray

    #: keep groups -> relative FFN output error when each token keeps its own top neurons by contribution
    #: (the same count of neurons, any set): what the grouping costs over neuron-level sparsity
    neuron_error: dict[int, float] = dataclasses.field(default_factory=dict)

    def local(self, keep_groups: int, oracle: bool = False) -> tuple[float, float]:
        """(relative FFN output error, recall of the router's picks vs the oracle top groups) at
        ``keep_groups`` groups per token (``oracle``: the true top groups picked)."""
        g = len(self.groups)
        if keep_groups >= g:
            return 0.0, 1.0
        scores = np.linalg.norm(self.outputs, axis=2) if oracle else self.scores
        pick = np.argpartition(-scores, keep_groups - 1, axis=1)[:, :keep_groups]
        mask = np.zeros(self.scores.shape, bool)
        np.put_along_axis(mask, pick, True, axis=1)
        full = self.outputs.sum(axis=1)
        got = (self.outputs * mask[..., None]).sum(axis=1)
        err = float(np.linalg.norm(got - full) / max(np.linalg.norm(full), 1e-12))
        norms = np.linalg.norm(self.outputs, axis=2)
        oracle = np.argpartition(-norms, keep_groups - 1, axis=1)[:, :keep_groups]
        return err, float(np.take_along_axis(mask, oracle, axis=1).mean())


def calibrate(f: GatedFFN, x: np.ndarray, n_groups: int, *, ridge: float = 1e-3, seed: int = 0) -> Calibrated:
    """Groups and router of ``f`` from its input rows ``x`` [T, H]."""
    x = x.astype(np.float32)
    wg, wu, wd = f.gate.dense(), f.up.dense(), f.down.dense()
    a = _silu(x @ wg) * (x @ wu)  # [T, F]
    unit = f.down.unit
    n_units = f.width // unit
    # per-token contribution of each unit: [T, U, H] -> its norm [T, U]
    contrib = np.einsum("tuk,ukh->tuh", a.reshape(len(x), n_units, unit), wd.reshape(n_units, unit, -1))
    units = balanced_clusters(np.linalg.norm(contrib, axis=2).T, n_groups, seed=seed)
    groups = [np.sort((u[:, None] * unit + np.arange(unit)).reshape(-1)) for u in units]
    outputs = np.stack([contrib[:, u].sum(axis=1) for u in units], axis=1)  # [T, G, H]
    target = np.linalg.norm(outputs, axis=2)  # [T, G]
    xa = np.concatenate([x, np.ones((len(x), 1), np.float32)], axis=1).astype(np.float64)
    gram = xa.T @ xa
    gram[np.diag_indices_from(gram)] += ridge * float(np.diag(gram).mean())
    coef = np.linalg.solve(gram, xa.T @ target)  # [H + 1, G]
    router = (coef[:-1].astype(np.float32), coef[-1].astype(np.float32))
    full = a @ wd
    size = np.linalg.norm(wd, axis=1)  # [F]
    neuron = {}
    for k in range(1, n_groups):
        keep = np.argpartition(-np.abs(a) * size, k * f.width // n_groups - 1, axis=1)[:, :k * f.width // n_groups]
        mask = np.zeros(a.shape, bool)
        np.put_along_axis(mask, keep, True, axis=1)
        neuron[k] = float(np.linalg.norm((a * mask) @ wd - full) / max(np.linalg.norm(full), 1e-12))
    return Calibrated(groups, router, outputs.astype(np.float32), (xa @ coef).astype(np.float32), neuron)

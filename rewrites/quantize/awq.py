"""Activation-aware scaling (AWQ, Lin et al. 2023) before 4-bit quantization, and the per-weight error that ranks
projections for 8 bits.

A group is the constant-weight MatMuls reading one activation ``x [.., K]`` whose producer can take a factor per
channel exactly::

    SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization / LayerNormalization / SkipLayerNormalization
        output 0 = norm(x)·gamma (+ beta)          gamma, beta /= s
    Mul(a, c), c a constant over the last axis     c /= s
    Mul(a, u), u = MatMul(h, W_up) (+ bias)         the columns of W_up (and the bias) /= s   (the gated FFN)

and every reader of ``x`` is one of the group's MatMuls, each the only reader of its weight. Then
``x·W = (x/s)·(s·W)``: the graph computes the same function in fp32 (up to rounding), and the 4-bit grid of
``s·W`` gives the channels with large activations finer steps. ``s = mean|x|^α`` (normalised by
``sqrt(max·min)``), ``α`` searched on a grid per group to minimise ``Σ ‖X·(Q(s·W)/s − W)‖²`` over the sampled
calibration rows ``X``; ``α = 0`` (no scaling) is a candidate, so a group's local error never grows.

:func:`relative_error` is ``‖X·(Q(W) − W)‖² / ‖X·W‖²`` of one weight: ``quantize-int4`` promotes the projections
with the largest to 8 bits (or leaves them float) when 4 bits everywhere miss the budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from graphopt.rewrites.quantize.int4 import pack_int4
from graphopt.rewrites.quantize.nbits import Blocks

#: the α grid of the scale search
ALPHAS = tuple(i / 20 for i in range(21))

_NORMS = {"SimplifiedLayerNormalization": (1, None), "SkipSimplifiedLayerNormalization": (2, None),
          "LayerNormalization": (1, 2), "SkipLayerNormalization": (2, 3)}


@dataclasses.dataclass(frozen=True)
class Group:
    """MatMuls (graph positions) reading one activation, and where that activation can absorb ``1/s``."""

    act: str
    matmuls: tuple[int, ...]
    producer: int  # graph position of the producer
    kind: str  # "norm" | "const" | "up"
    index: tuple[int, ...]  # norm: input slots to divide; const: the constant's slot; up: the up MatMul's position
    k: int


def _const(v: ir.Value | None) -> np.ndarray | None:
    if v is None or v.const_value is None or v.const_value.dtype != ir.DataType.FLOAT:
        return None
    return v.const_value.numpy()


def _only(v: ir.Value | None, node: ir.Node) -> bool:
    return v is not None and not v.is_graph_output() and all(u.node is node for u in v.uses())


def _weight_ok(node: ir.Node) -> bool:
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return False
    w = _const(node.inputs[1])
    return w is not None and w.ndim == 2 and len(node.inputs[1].uses()) == 1 and not node.inputs[1].is_graph_output()


def groups(model: ir.Model, wanted: set[int]) -> list[Group]:
    """The groups whose MatMuls (positions in graph order) are all in ``wanted``."""
    nodes = list(model.graph)
    pos = {id(n): i for i, n in enumerate(nodes)}
    by_act: dict[int, list[int]] = {}
    for i in sorted(wanted):
        n = nodes[i]
        if _weight_ok(n) and n.inputs[0] is not None and n.inputs[0].producer() is not None:
            by_act.setdefault(id(n.inputs[0]), []).append(i)
    out = []
    for idx in by_act.values():
        x = nodes[idx[0]].inputs[0]
        readers = {pos.get(id(u.node)) for u in x.uses()}
        if x.is_graph_output() or readers != set(idx):
            continue
        k = nodes[idx[0]].inputs[1].const_value.shape[0]
        prod = x.producer()
        found = _absorber(prod, x, k, pos)
        if found is not None:
            out.append(Group(x.name, tuple(idx), pos[id(prod)], found[0], found[1], k))
    return out


def _absorber(prod: ir.Node, x: ir.Value, k: int, pos: dict[int, int]) -> tuple[str, tuple[int, ...]] | None:
    if prod.domain in ("", "ai.onnx", "com.microsoft") and prod.op_type in _NORMS:
        if prod.outputs[0] is not x:
            return None
        slots = tuple(j for j in _NORMS[prod.op_type] if j is not None and j < len(prod.inputs)
                      and prod.inputs[j] is not None)
        for j in slots:
            c = _const(prod.inputs[j])
            if c is None or c.shape != (k,) or not _only(prod.inputs[j], prod):
                return None
        return ("norm", slots) if slots else None
    if prod.op_type != "Mul" or prod.domain not in ("", "ai.onnx") or len(prod.inputs) != 2:
        return None
    for j in (0, 1):
        c = _const(prod.inputs[j])
        if c is not None:
            ok = c.size == k and c.shape[-1:] == (k,) and _only(prod.inputs[j], prod)
            return ("const", (j,)) if ok else None
    for j in (0, 1):
        u = prod.inputs[j]
        up = u.producer() if u is not None else None
        if up is not None and _weight_ok(up) and _only(u, prod) and up.inputs[1].const_value.shape[1] == k:
            return "up", (pos[id(up)],)
    return None


def _set(v: ir.Value, arr: np.ndarray) -> None:
    v.const_value = ir.tensor(np.ascontiguousarray(arr, np.float32), name=v.name)


def apply(model: ir.Model, group: Group, s: np.ndarray) -> None:
    """Scale the group's weight rows by ``s`` and its producer's output by ``1/s`` (in place)."""
    nodes = list(model.graph)
    for i in group.matmuls:
        w = nodes[i].inputs[1]
        _set(w, w.const_value.numpy() * s[:, None])
    prod = nodes[group.producer]
    if group.kind == "norm":
        for j in group.index:
            _set(prod.inputs[j], prod.inputs[j].const_value.numpy() / s)
    elif group.kind == "const":
        c = prod.inputs[group.index[0]]
        arr = c.const_value.numpy()
        _set(c, (arr.reshape(-1) / s).reshape(arr.shape))
    else:
        w = nodes[group.index[0]].inputs[1]
        _set(w, w.const_value.numpy() / s[None, :])


def scale_groups(src: ir.Model, gs: list[Group], stats: dict[str, list], qdq) -> tuple[list, float, float, list]:
    """:func:`search` and :func:`apply` for each group of ``gs`` whose activation has sampled rows in ``stats``
    (``{name: [rows, XᵀX or None]}``, updated to the scaled activation). Returns ([(group, s)] of the groups
    scaled, the summed error without scaling, with it, the α chosen)."""
    nodes = list(src.graph)
    out, before, after, alphas = [], 0.0, 0.0, []
    for g in gs:
        st = stats.get(g.act)
        if st is None:
            continue
        scale, alpha, err, err0 = search(st[0], [nodes[i].inputs[1].const_value.numpy() for i in g.matmuls], qdq)
        before, after = before + err0, after + err
        if alpha > 0:
            apply(src, g, scale)
            out.append((g, scale))
            alphas.append(alpha)
            st[0] = st[0] / scale
            if st[1] is not None:
                st[1] = st[1] / np.outer(scale, scale)
    return out, before, after, alphas


def search(x: np.ndarray, weights: list[np.ndarray], qdq: Callable[[np.ndarray], np.ndarray],
           alphas=ALPHAS) -> tuple[np.ndarray, float, float, float]:
    """The scale for the activation rows ``x [n, K]`` read by ``weights`` ([K, N] each) under the quantizer
    ``qdq`` (weight -> its dequantized blocks): (s, α, error with s, error without), errors summed over the
    weights as ``‖X·Ŵ − X·W‖²``."""
    x = x.astype(np.float32)
    a = np.maximum(np.abs(x).mean(axis=0), 1e-8).astype(np.float64)
    refs = [x @ w for w in weights]
    best = None
    base = None
    for alpha in alphas:
        s = a ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        xs = x / s
        err = float(sum(np.square(xs @ qdq(w * s[:, None]) - r).sum() for w, r in zip(weights, refs)))
        if alpha == 0:
            base = err
        if best is None or err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], best[2], base if base is not None else best[2]


def relative_error(x: np.ndarray, w: np.ndarray, wq: np.ndarray) -> float:
    """``‖X·(Ŵ − W)‖² / ‖X·W‖²``."""
    x = x.astype(np.float32)
    ref = x @ w
    return float(np.square(x @ wq - ref).sum() / max(float(np.square(ref).sum()), 1e-30))


#: the clipping ratios of :func:`clipped_blocks` (1.0: the block's own range)
CLIPS = tuple(1.0 - i / 20 for i in range(10))


def clipped_blocks(w: np.ndarray, x: np.ndarray, block: int, symmetric: bool, ratios=CLIPS):
    """4-bit RTN blocks of a [K, N] weight whose range is clipped per block and output column to the ratio of
    ``ratios`` that minimises ``δᵀ·(X_bᵀX_b)·δ`` (δ the block's rounding error, ``X_b`` the block's rows of the
    calibration inputs ``x [n, K]``): AWQ's clipping search. Returns :class:`.nbits.Blocks`."""
    k, n = w.shape
    kp = -(-k // block) * block
    nb = kp // block
    wp = np.zeros((kp, n), np.float64)
    wp[:k] = w
    xp = np.zeros((x.shape[0], kp), np.float64)
    xp[:, :k] = x
    wb = wp.reshape(nb, block, n)
    xb = xp.reshape(-1, nb, block).transpose(1, 0, 2)  # [nb, rows, block]
    h = np.einsum("brk,brl->bkl", xb, xb)
    best_err = np.full((nb, n), np.inf)
    best = None
    for r in ratios:
        q, d, z = _rtn(wb, r, symmetric)
        delta = (q - z[:, None, :]) * d[:, None, :] - wb
        err = np.einsum("bkn,bkl,bln->bn", delta, h, delta)
        if best is None:
            best = [q, d, z]
        take = err < best_err
        best_err = np.where(take, err, best_err)
        for j, new in enumerate((q, d, z)):
            best[j] = np.where(take[:, None, :], new, best[j]) if new.ndim == 3 else np.where(take, new, best[j])
    q, d, z = best
    q = q.reshape(kp, n).astype(np.uint8)
    packed = pack_int4(q, block)
    scales = np.ascontiguousarray(d.T, np.float32)
    if symmetric:
        return Blocks(packed, scales, None, block)
    zt = z.T.astype(np.uint8)  # [N, nb]
    if nb % 2:
        zt = np.concatenate([zt, np.zeros((n, 1), np.uint8)], axis=1)
    zp = (zt[:, 0::2] | (zt[:, 1::2] << 4)).astype(np.uint8)
    return Blocks(packed, scales, zp, block)


def _rtn(wb: np.ndarray, r: float, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RTN of blocks ``wb [nb, block, N]`` with the range scaled by ``r``: (q 0..15, d [nb, N], zero points)."""
    if symmetric:  # ONNX Runtime's form: the block's largest-magnitude value maps to -8 (d may be negative)
        idx = np.abs(wb).argmax(axis=1)
        m = np.take_along_axis(wb, idx[:, None, :], axis=1)[:, 0, :] * r
        d = np.where(m != 0, m / -8.0, 1.0)
        z = np.full(d.shape, 8.0)
    else:
        lo, hi = np.minimum(wb.min(axis=1), 0.0) * r, np.maximum(wb.max(axis=1), 0.0) * r
        d = np.where(hi > lo, (hi - lo) / 15.0, 1.0)
        z = np.clip(np.rint(-lo / d), 0, 15)
    q = np.clip(np.rint(wb / d[:, None, :]) + z[:, None, :], 0, 15)
    return q, d, z

"""8-bit ``MatMulNBits`` forms of what a 4-bit GGUF decoder still computes slowly: Q4_1 block minimums and the LM head.

Two graph rewrites ``quantize-int4`` applies as budgeted stages (they only pay off at ``accuracy_level`` 4: ONNX
Runtime 1.32's 8-bit kernel at level 1 measured ~30x slower than the fp32 MatMul):

1. :func:`fold_minimums`: the exact Q4_1 form ``MatMulNBits(x, q, d, zero points 0) + ReduceSum(Reshape(x, [.., K/32,
   32])) @ m`` (four nodes beside each projection, ~a quarter of a decode step) becomes one 8-bit ``MatMulNBits``
   with uint8 zero points. Per block ``w = d·q + m`` is rewritten ``w' = d'·(q' - z')`` with ``d' = d/s``,
   ``q' = s·q + c``, ``c - z' = round(s·m/d)``, the largest ``s <= 16`` for which ``q'`` and ``z'`` stay in 0..255
   (``s = 16`` unless a block's minimum lies far above zero)::

       x ─┬─ MatMulNBits(q, d, 0) ──────────────────────┐
          └─ Reshape ─ ReduceSum ─ MatMul(m) ─────────── Add ─▶ y    ==>   x ── MatMulNBits(q', d', z'; bits 8) ─▶ y

   ``|w' - w| <= d/(2s)``: a constant shift of at most 1/32 of the block's 4-bit step (the largest is reported).
   Blocks that no ``s`` fits are quantized with 8-bit RTN over their range including 0.

2. :func:`head_blocks8`: the LM head (a MatMul whose N is the vocabulary) reading a constant ``[K, V]`` or, for tied
   embeddings, ``Transpose`` of the embedding table becomes ``MatMulNBits(bits=8, block 32)``: a Q8_0 table
   (``Reshape(Mul(Cast(int8 codes), Cast(scales)))``, :mod:`exporters.gguf_blocks`) exactly, its codes + 128 with
   the implied zero point 128; any other float table by symmetric 8-bit RTN (``d = max|w|/127`` per block of 32:
   exact again for a dequantized Q8_0 table). The embedding ``Gather`` keeps reading the float table. 113 MB of
   fp32 read per token become 28 MB.

3. ``rewrites.common.q41_chain.drop_zero_points``: the exact chain read with ONNX Runtime's implied zero point 8 instead of zero points 0,
   the minimums shifted by ``8·d`` (``d·q + m = d·(q - 8) + (m + 8d)``): exact with fp32 activations (the
   ``implied-zero-points`` pass); at ``accuracy_level`` 4 it is the more accurate form (the int8 activations
   multiply the centred ``q - 8``, the ``8d`` part is summed in fp32), so ``quantize-int4`` uses it there.

The first two return what they changed (counts and the largest weight error in units of the block's step); nothing else
in the graph moves. Refusals (a chain not in these forms, a value read elsewhere) leave that node as it is.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common.q8_table import add_initializer as _init
from graphopt.rewrites.common.q8_table import const as _const
from graphopt.rewrites.common.q8_table import prune_unread as _prune
from graphopt.rewrites.common.q8_table import q8_codes as _q8_codes
from graphopt.rewrites.common.q41_chain import _only_use
from graphopt.rewrites.common.q41_chain import minimum_chain as _minimum_chain


@dataclasses.dataclass
class Changed:
    """What one rewrite did."""

    count: int = 0
    #: the largest |w' - w| over the rewritten weights, in units of each block's step (4-bit d; 8-bit d')
    max_error: float = 0.0
    #: blocks that no exact-offset form fits (8-bit RTN over their range)
    rtn_blocks: int = 0
    #: how the LM head's table was read ("Q8_0 codes" / "float table")
    source: str = ""


def unpack4(packed: np.ndarray) -> np.ndarray:
    """uint8 [N, blocks, block/2] (two 4-bit values a byte, low nibble first) -> [N, blocks, block]."""
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], packed.shape[1], -1)


def affine_to_u8(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """``w = d·q + m`` (``q`` [N, blocks, block] in 0..15, ``d``, ``m`` [N, blocks]) as 8-bit ``d'·(q' - z')``:
    (q' uint8 [N, blocks, block], d' float32 [N, blocks], z' uint8 [N, blocks], the largest error in units of
    ``d`` over the blocks an offset form fits, the number of the other blocks, quantized by RTN)."""
    d = d.astype(np.float64)
    m = m.astype(np.float64)
    pos = d > 0
    r = np.where(pos, m / np.where(pos, d, 1.0), 0.0)
    s = np.zeros(d.shape)
    for cand in range(16, 0, -1):
        t = np.rint(cand * r)
        s = np.where((s == 0) & pos & (t >= -255) & (t <= 255 - 15 * cand), cand, s)
    fit = s > 0
    t = np.rint(s * r)
    c = np.maximum(t, 0.0)
    z = c - t
    qf = s[..., None] * q + c[..., None]
    dn = np.where(fit, d / np.where(fit, s, 1.0), 1.0)
    w = d[..., None] * q + m[..., None]
    # the rest (a constant block, or one whose minimum no s reaches): 8-bit RTN over [min(w, 0), max(w, 0)]
    rest = ~fit
    if rest.any():
        lo = np.minimum(w.min(axis=-1), 0.0)
        hi = np.maximum(w.max(axis=-1), 0.0)
        step = np.where(hi > lo, (hi - lo) / 255.0, 1.0)
        zr = np.clip(np.rint(-lo / step), 0, 255)
        qr = np.clip(np.rint(w / step[..., None] + zr[..., None]), 0, 255)
        dn = np.where(rest, step, dn)
        z = np.where(rest, zr, z)
        qf = np.where(rest[..., None], qr, qf)
    back = dn[..., None] * (qf - z[..., None])
    err = float((np.abs(back - w)[fit] / d[fit][..., None]).max()) if fit.any() else 0.0
    return qf.astype(np.uint8), dn.astype(np.float32), z.astype(np.uint8), err, int(rest.sum())


def fold_minimums(model: ir.Model) -> Changed:
    """Every exact Q4_1 chain (MatMulNBits + block-sum x minimum correction) to one 8-bit MatMulNBits."""
    g = model.graph
    out = Changed()
    for add in list(g):
        chain = _minimum_chain(add)
        if chain is None:
            continue
        nb, rh, rs, corr = chain
        n = nb.attributes.get_int("N")
        q = unpack4(_const(nb.inputs[1]))
        d = _const(nb.inputs[2]).reshape(n, -1)
        m = _const(corr.inputs[1]).T
        if len(nb.inputs) == 3:  # implied zero point 8: the correction holds m + 8·d
            m = m - np.float32(8) * d
        q8, d8, z8, err, rest = affine_to_u8(q.astype(np.float64), d, m)
        stem = nb.name or nb.inputs[1].name
        attrs = {a.name: a.value for a in nb.attributes.values()}
        attrs["bits"] = 8
        new = ir.node("MatMulNBits", [nb.inputs[0], _init(g, f"{stem}.q8", q8), _init(g, f"{stem}.scales8", d8.reshape(-1)),
                                      _init(g, f"{stem}.zero_points8", z8.reshape(-1))],
                      attrs, domain=MS_DOMAIN, name=f"{stem}_8bit")
        y = add.outputs[0]
        new.outputs[0].shape, new.outputs[0].type = y.shape, y.type
        olds = [nb, corr, add]
        freed = [v for o in olds for v in o.inputs]
        ir.convenience.replace_nodes_and_values(g, add, olds, [new], [y], [new.outputs[0]])
        # the block sums may be shared by merged siblings: they go only when nothing else reads them
        _prune(g, freed)
        out.count += 1
        out.max_error = max(out.max_error, err)
        out.rtn_blocks += rest
    return out


def _table(v: ir.Value) -> np.ndarray | None:
    """The float value of ``v``: a constant, or the Q8_0 chain of constants."""
    c = _const(v)
    if c is not None:
        return c
    q8 = _q8_codes(v)
    if q8 is None:
        return None
    codes, scales = q8
    return (codes.astype(np.float32) * scales[..., None]).reshape(codes.shape[0], -1)


def rtn8(table: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray, float]:
    """Symmetric 8-bit blocks of a [V, K] table along K: (uint8 [V, blocks, block] = q + 128, scales [V, blocks],
    the largest error in units of the scale)."""
    v, k = table.shape
    kp = -(-k // block) * block
    t = np.zeros((v, kp), np.float64)
    t[:, :k] = table
    t = t.reshape(v, kp // block, block)
    d = np.abs(t).max(axis=-1) / 127.0
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint(t / safe[..., None]), -127, 127)
    err = float((np.abs(q * safe[..., None] - t) / safe[..., None]).max())
    return (q + 128).astype(np.uint8), d.astype(np.float32), err


def head_blocks8(model: ir.Model, vocab: int | None, *, level: int = 4, block: int = 32) -> Changed:
    """The LM head MatMul (N = ``vocab``) to an 8-bit MatMulNBits at ``level``."""
    g = model.graph
    out = Changed()
    if vocab is None:
        return out
    for node in list(g):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        w = node.inputs[1]
        tr = w.producer()
        if tr is not None and tr.op_type == "Transpose" and list(tr.attributes.get_ints("perm", [1, 0])) == [1, 0] \
                and _only_use(w, node):
            rows = tr.inputs[0]  # [V, K]
        elif w.const_value is not None and len(w.const_value.shape) == 2:
            rows, tr = None, None
        else:
            continue
        dims = rows.shape if rows is not None else w.const_value.shape[::-1]
        q8 = _q8_codes(rows) if rows is not None and block == 32 else None
        if q8 is not None:
            dims = (q8[0].shape[0], None)
        if dims is None or len(dims) != 2 or dims[0] != vocab:
            continue
        if q8 is None:
            table = _table(rows) if rows is not None else _const(w).T
        if q8 is None and (table is None or table.ndim != 2):
            continue
        if q8 is not None:
            codes, scales = q8
            packed, err, out.source = (codes.astype(np.int16) + 128).astype(np.uint8), 0.0, "Q8_0 codes"
            k = int(codes.shape[1] * codes.shape[2])
        else:
            packed, scales, err = rtn8(np.asarray(table, np.float32), block)
            out.source, k = "float table", int(table.shape[1])
        n = int(packed.shape[0])
        x_k = node.inputs[0].shape[-1] if node.inputs[0].shape is not None else None
        if n != vocab or (isinstance(x_k, int) and x_k != k):
            continue
        stem = node.name or "lm_head"
        new = ir.node("MatMulNBits", [node.inputs[0], _init(g, f"{stem}.q8", packed),
                                      _init(g, f"{stem}.scales8", np.ascontiguousarray(scales, np.float32).reshape(-1))],
                      {"K": k, "N": n, "bits": 8, "block_size": block, "accuracy_level": level}, domain=MS_DOMAIN,
                      name=f"{stem}_8bit")
        y = node.outputs[0]
        new.outputs[0].shape, new.outputs[0].type = y.shape, y.type
        freed = list(node.inputs)
        ir.convenience.replace_nodes_and_values(g, node, [node], [new], [y], [new.outputs[0]])
        _prune(g, freed)
        out.count += 1
        out.max_error = max(out.max_error, err)
    if out.count:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return out

"""The exact Q4_1 chain ``MatMulNBits(x, q, d[, zero points 0]) + ReduceSum(Reshape(x, [.., K/32, 32])) @ m`` (as
``exporters.gguf_blocks`` writes it): finding it, and reading it with ONNX Runtime's implied zero point 8."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common.q8_table import add_initializer as _init
from graphopt.rewrites.common.q8_table import const as _const
from graphopt.rewrites.common.q8_table import prune_unread as _prune


def _only_use(v: ir.Value, node: ir.Node) -> bool:
    return not v.is_graph_output() and all(u.node is node for u in v.uses())


def _block_sums_of(corr: ir.Node) -> ir.Value | None:
    """``x`` of a correction ``MatMul(ReduceSum(Reshape(x)), m)``, or None."""
    rs = corr.inputs[0].producer() if corr.inputs[0] is not None else None
    rh = rs.inputs[0].producer() if rs is not None and rs.op_type == "ReduceSum" and rs.inputs[0] is not None \
        else None
    return rh.inputs[0] if rh is not None and rh.op_type == "Reshape" else None


def minimum_chain(add: ir.Node):
    """(MatMulNBits, Reshape, ReduceSum, MatMul) of ``Add(MatMulNBits(x, q, d, 0), ReduceSum(Reshape(x)) @ m)``
    or of the implied-zero-point form ``Add(MatMulNBits(x, q, d), ReduceSum(Reshape(x)) @ (m + 8·d))``
    (``implied-zero-points``), or None."""
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    for a, c in (add.inputs, add.inputs[::-1]):
        nb, corr = (a.producer() if a is not None else None), (c.producer() if c is not None else None)
        if nb is None or corr is None or nb.op_type != "MatMulNBits" or nb.domain != MS_DOMAIN \
                or corr.op_type != "MatMul" or corr.domain not in ("", "ai.onnx"):
            continue
        ins = list(nb.inputs)
        if len(ins) not in (3, 4) or nb.attributes.get_int("bits", 4) != 4 or any(_const(v) is None for v in ins[1:]):
            continue
        if not (_only_use(a, add) and _only_use(c, add)) or _const(corr.inputs[1]) is None:
            continue
        if _block_sums_of(corr) is not ins[0]:
            continue
        rs = corr.inputs[0].producer()
        rh = rs.inputs[0].producer()
        n, bs = nb.attributes.get_int("N"), nb.attributes.get_int("block_size")
        mins = _const(corr.inputs[1])
        if mins.shape != (-(-nb.attributes.get_int("K") // bs), n) or (len(ins) == 4 and np.any(_const(ins[3]))):
            continue
        return nb, rh, rs, corr
    return None


def _split_slice(add: ir.Node):
    """(MatMulNBits, correction MatMul, first column) of ``Add(MatMulNBits(x, q, d, 0), Split(bs @ M)[i])``: the
    minimum corrections of sibling projections merged into one MatMul (``merge-projections``) while their
    MatMulNBits stayed apart; or None."""
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    for a, c in (add.inputs, add.inputs[::-1]):
        nb, sp = (a.producer() if a is not None else None), (c.producer() if c is not None else None)
        if nb is None or sp is None or nb.op_type != "MatMulNBits" or sp.op_type != "Split" or len(nb.inputs) != 4:
            continue
        if nb.attributes.get_int("bits", 4) != 4 or any(_const(v) is None for v in nb.inputs[1:]) \
                or np.any(_const(nb.inputs[3])) or len(a.uses()) != 1 or a.is_graph_output():
            continue
        corr = sp.inputs[0].producer() if sp.inputs[0] is not None else None
        if corr is None or corr.op_type != "MatMul" or _const(corr.inputs[1]) is None or len(corr.outputs[0].uses()) != 1:
            continue
        if _block_sums_of(corr) is not nb.inputs[0]:
            continue
        sizes = _const(sp.inputs[1]) if len(sp.inputs) > 1 and sp.inputs[1] is not None else None
        mins = _const(corr.inputs[1])
        if sizes is None or sp.attributes.get_int("axis", 0) not in (-1, len(c.shape or ()) - 1) \
                or mins.shape[0] != -(-nb.attributes.get_int("K") // nb.attributes.get_int("block_size")):
            continue
        idx = list(sp.outputs).index(c)
        start = int(np.sum(sizes[:idx]))
        if int(sizes[idx]) != nb.attributes.get_int("N") or int(np.sum(sizes)) != mins.shape[1]:
            continue
        return nb, corr, start
    return None


def drop_zero_points(model: ir.Model, levels: tuple[int, ...] = (0, 1)) -> int:
    """Every exact Q4_1 chain with zero points 0 whose MatMulNBits runs at one of ``levels`` (default: the
    fp32-activation ones, where this is exact) to the implied zero point 8 (minimums + 8·d); returns how many."""
    g = model.graph
    count = 0
    for add in list(g):
        chain = minimum_chain(add)
        if chain is not None and len(chain[0].inputs) == 4:
            nb, corr, start = chain[0], chain[3], 0
        else:
            hit = _split_slice(add)
            if hit is None:
                continue
            nb, corr, start = hit
        if nb.attributes.get_int("accuracy_level", 0) not in levels:
            continue
        n = nb.attributes.get_int("N")
        d = _const(nb.inputs[2]).astype(np.float32).reshape(n, -1)
        shifted = _const(corr.inputs[1]).astype(np.float32).copy()
        shifted[:, start:start + n] += np.float32(8) * d.T
        freed = [corr.inputs[1], nb.inputs[3]]
        corr.replace_input_with(1, _init(g, f"{corr.inputs[1].name or 'mins'}_z8", shifted))
        nb.resize_inputs(3)
        _prune(g, freed)
        count += 1
    return count

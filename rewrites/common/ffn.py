"""Transformer FFN blocks with constant weights, shared by ``sparsify`` and ``contextual-sparsity``.

    X ──MatMul(W1[H, F])──▶ (Add b1) ──▶ Gelu | com.microsoft BiasGelu(·, b1) | FastGelu(·, b1?) ──▶ A
    A ──MatMul(W2[F, H])──▶ …

Found on unfused exports (dynamo: MatMul → Add → Gelu → MatMul; TorchScript: the GELU written out as
``z * 0.5 * (1 + Erf(z / √2))``, five elementwise nodes with scalar constants, see :func:`erf_gelu`),
fused graphs (MatMul → BiasGelu → MatMul) and after ``remove-padding`` (packed tokens ``[N, H]``). Every
intermediate value must be read only inside the block (nothing else sees the F-wide activations), else the
block is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.opsets import node_domain
from graphopt.rewrites.common import activations as calib_mod

ACTIVATIONS = {("", "Gelu"), ("com.microsoft", "BiasGelu"), ("com.microsoft", "FastGelu")}


@dataclasses.dataclass
class FFN:
    """One FFN block: its nodes, constant weights and the activations around it."""

    mm1: ir.Node
    add1: ir.Node | None
    act: ir.Node
    mm2: ir.Node
    bias: ir.Value | None  # the constant b1 (an Add input or the activation's second input)
    #: every node of the activation, in graph order, ``act`` last: ``(act,)`` for one op, five for the Erf form
    act_nodes: tuple[ir.Node, ...] = ()

    def __post_init__(self) -> None:
        if not self.act_nodes:
            self.act_nodes = (self.act,)

    @property
    def key(self) -> str:
        return self.mm1.name or self.mm1.outputs[0].name

    @property
    def x(self) -> ir.Value:
        return self.mm1.inputs[0]

    @property
    def a(self) -> ir.Value:
        return self.act.outputs[0]

    @property
    def w1(self) -> np.ndarray:
        return self.mm1.inputs[1].const_value.numpy()

    @property
    def w2(self) -> np.ndarray:
        return self.mm2.inputs[1].const_value.numpy()

    @property
    def b1(self) -> np.ndarray | None:
        return None if self.bias is None else self.bias.const_value.numpy()

    @property
    def width(self) -> int:
        return int(self.w1.shape[1])

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[0])


def _const(v: ir.Value | None, rank: int) -> bool:
    return v is not None and v.const_value is not None and len(v.const_value.shape) == rank


def _only_reader(v: ir.Value) -> ir.Node | None:
    uses = list(v.uses())
    if len(uses) != 1 or v.is_graph_output():
        return None
    return uses[0][0]


#: the note of a pass that found no FFN to work on
NO_FFN_NOTE = "not applied: no FFN block (MatMul → Gelu/BiasGelu/FastGelu → MatMul with constant weights)"


def find(model: ir.Model) -> list[FFN]:
    """Every FFN block of the main graph, in graph order."""
    out = []
    for mm1 in model.graph:
        if mm1.op_type != "MatMul" or node_domain(mm1) != "" or not _const(mm1.inputs[1], 2):
            continue
        nxt = _only_reader(mm1.outputs[0])
        add1 = bias = None
        if nxt is not None and nxt.op_type == "Add" and node_domain(nxt) == "":
            other = nxt.inputs[1] if nxt.inputs[0] is mm1.outputs[0] else nxt.inputs[0]
            if not _const(other, 1):
                continue
            add1, bias = nxt, other
            nxt = _only_reader(nxt.outputs[0])
        z = (add1 or mm1).outputs[0]
        chain = erf_gelu(z) if nxt is None else None
        if chain is not None:
            nxt = chain[-1]
        elif nxt is None or (node_domain(nxt), nxt.op_type) not in ACTIVATIONS or nxt.inputs[0] is not z:
            continue
        act = nxt
        if chain is None and len(act.inputs) > 1 and act.inputs[1] is not None:
            if bias is not None or not _const(act.inputs[1], 1):
                continue
            bias = act.inputs[1]
        mm2 = _only_reader(act.outputs[0])
        if mm2 is None or mm2.op_type != "MatMul" or mm2.inputs[0] is not act.outputs[0] or not _const(
                mm2.inputs[1], 2):
            continue
        f = FFN(mm1, add1, act, mm2, bias, chain or (act,))
        if f.w2.shape[0] != f.width or (f.b1 is not None and f.b1.shape[0] != f.width):
            continue
        out.append(f)
    return out


def _scalar(v: ir.Value | None) -> float | None:
    """The value of a one-element constant (initializer or Constant node output), else None."""
    t = None if v is None else ir.convenience.get_const_tensor(v)
    if t is None:
        return None
    a = t.numpy()
    return float(a.reshape(-1)[0]) if a.size == 1 else None


def _other(node: ir.Node, v: ir.Value) -> ir.Value | None:
    """The other input of a two-input node that reads ``v`` once."""
    ins = list(node.inputs)
    if len(ins) != 2 or ins.count(v) != 1:
        return None
    return ins[1] if ins[0] is v else ins[0]


def erf_gelu(z: ir.Value) -> tuple[ir.Node, ...] | None:
    """The nodes of ``GELU(z)`` written out with Erf (TorchScript exports), in graph order, or None.

    Accepted: ``Erf(z / √2 | z * (1/√2))``, ``+ 1``, and the products with ``z`` and ``0.5`` in either order
    (``(z * (1 + e)) * 0.5`` or ``(z * 0.5) * (1 + e)``); every constant a scalar within 1e-3; ``z`` read
    only by the chain, every value inside it read once (nothing else sees the F-wide activations).
    """
    if z.is_graph_output():
        return None
    readers = [n for n, _ in z.uses()]
    if len(readers) != 2 or any(node_domain(n) != "" for n in readers):
        return None

    def near(v: ir.Value | None, want: float) -> bool:
        c = _scalar(v)
        return c is not None and abs(c - want) <= 1e-3 * abs(want)

    scale = next((n for n in readers if (n.op_type == "Div" and n.inputs[0] is z and near(n.inputs[1], 2 ** 0.5))
                  or (n.op_type == "Mul" and near(_other(n, z), 2 ** -0.5))), None)
    mul_z = next((n for n in readers if n is not scale and n.op_type == "Mul"), None)
    if scale is None or mul_z is None:
        return None
    erf = _only_reader(scale.outputs[0])
    one = None if erf is None or erf.op_type != "Erf" else _only_reader(erf.outputs[0])
    if one is None or one.op_type != "Add" or not near(_other(one, erf.outputs[0]), 1.0):
        return None
    last = _only_reader(mul_z.outputs[0])
    if last is None or last.op_type != "Mul":
        return None
    if _other(mul_z, z) is one.outputs[0]:            # (z * (1 + e)) * 0.5
        ok = _only_reader(one.outputs[0]) is mul_z and near(_other(last, mul_z.outputs[0]), 0.5)
    else:                                              # (z * 0.5) * (1 + e)
        ok = near(_other(mul_z, z), 0.5) and _other(last, mul_z.outputs[0]) is one.outputs[0] and (
            _only_reader(one.outputs[0]) is last)
    if not ok:
        return None
    chain = {scale, erf, one, mul_z, last}
    return tuple(n for n in z.graph if n in chain) if z.graph is not None else None


def gelu(z: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU in numpy."""
    from scipy.special import erf

    return 0.5 * z * (1.0 + erf(z / np.sqrt(2.0)))


def collect(model: ir.Model, ffns: Sequence[FFN], feeds: Sequence[Mapping[str, np.ndarray]], *,
            sample_rows: int = 512) -> dict[str, calib_mod.Stats]:
    """Calibration statistics of each FFN's input X and activation A (rows: tokens, padding masked)."""
    names = [f.x.name for f in ffns] + [f.a.name for f in ffns]
    return calib_mod.collect(model, feeds, names, xtx_for=names, sample_rows=sample_rows)


def set_width(v: ir.Value, width: int) -> None:
    """Make the last dimension of ``v``'s recorded shape ``width`` (after dropping neurons)."""
    if v.shape is not None and len(v.shape):
        v.shape = ir.Shape([*list(v.shape)[:-1], width])


def replace_const(node: ir.Node, index: int, array: np.ndarray, name: str) -> ir.Value:
    """Put a fresh initializer ``array`` in ``node``'s input ``index`` (the old one is dropped if unused)."""
    graph = node.graph
    old = node.inputs[index]
    new = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(array), name=name),
                   shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
    graph.register_initializer(new)
    node.replace_input_with(index, new)
    if old is not None and not list(old.uses()) and old.name in graph.initializers:
        graph.initializers.pop(old.name)
    return new


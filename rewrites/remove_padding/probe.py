"""Dimension probing for ``remove-padding``: which dimension of each value is batch, sequence or fixed.

Run the model (ORT, optimizations off) on two all-ones-mask feeds with different batch/sequence sizes,
every intermediate value as an output, and label each dimension of each value ``Dim.B`` (batch),
``Dim.S`` (sequence), ``Dim.BS`` (their product), an ``int`` (same in both runs) or ``Dim.UNKNOWN``.
This works on any export whatever shape information it carries.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from graphopt.runtime.session import make_session

#: (batch, seq) of the two probe runs: small primes that collide with no model dimension
PROBES = ((3, 7), (5, 11))


class Dim(enum.StrEnum):
    """A probed dimension that is not fixed."""

    B = "B"  # batch
    S = "S"  # sequence
    BS = "BS"  # batch * sequence
    UNKNOWN = "?"


#: dimensions that grow with the batch or the sequence
TOKEN_DIMS = frozenset(Dim)

Label = Dim | int
Labels = tuple[Label, ...]


class DimLabels:
    """Value -> its dimension labels (probed, or the shape of a constant); ``None`` when unknown."""

    def __init__(self, by_name: Mapping[str, Labels]):
        self._by_name = dict(by_name)

    def __call__(self, v: ir.Value | None) -> Labels | None:
        if v is None:
            return None
        if v.const_value is not None and v.name not in self._by_name:
            return tuple(int(d) for d in v.const_value.shape)
        return self._by_name.get(v.name)

    def rank(self, v: ir.Value | None) -> int:
        """Number of labelled dimensions (0 when unknown)."""
        return len(self(v) or ())


def probe_labels(model: ir.Model, mask: ir.Value) -> DimLabels:
    """Dimension labels of every named value, from two runs with different batch/sequence sizes.

    Raises whatever ONNX Runtime raises when the model cannot run (the caller refuses).
    """
    graph = model.graph
    mask_dims = list(mask.shape.dims) if mask.shape is not None else []
    if len(mask_dims) != 2:
        raise ValueError(f"mask {mask.name!r} is not rank 2")
    known = {v.name for v in graph.inputs} | set(graph.initializers) | {v.name for v in graph.outputs}
    # ONNX Runtime accepts graph outputs without a type, so every named intermediate can be one
    extra = [out for node in graph for out in node.outputs if out.name and out.name not in known]
    original_outputs = list(graph.outputs)
    try:
        graph.outputs.extend(extra)
        # make_session takes the onnx_ir model itself (large models go through a temporary file)
        sess = make_session(model, optimize=False, threads=1)
    finally:
        graph.outputs.clear()
        graph.outputs.extend(original_outputs)
    names = [o.name for o in sess.get_outputs()]
    runs = []
    for b, s in PROBES:
        feed = {}
        for v in graph.inputs:
            if v.name in graph.initializers:
                continue
            dims = [] if v.shape is None else list(v.shape.dims)
            shape = []
            for d in dims:
                if isinstance(d, int):
                    shape.append(d)
                elif d == mask_dims[0]:
                    shape.append(b)
                elif d == mask_dims[1]:
                    shape.append(s)
                else:
                    raise ValueError(f"input {v.name!r} has dimension {d} that is neither batch nor sequence")
            dtype = v.dtype.numpy() if v.dtype is not None else np.dtype(np.float32)
            fill = 1 if v is mask else 0
            feed[v.name] = np.full(shape, fill, dtype=dtype)
        outs = sess.run(names, feed)
        shapes = {n: np.shape(o) for n, o in zip(names, outs)}
        for n, a in feed.items():
            shapes[n] = a.shape
        runs.append(shapes)
    labels: dict[str, Labels] = {}
    (b1, s1), (b2, s2) = PROBES
    for n, sh1 in runs[0].items():
        sh2 = runs[1].get(n)
        if sh2 is None or len(sh1) != len(sh2):
            continue
        lab: list[Label] = []
        for d1, d2 in zip(sh1, sh2):
            if d1 == d2:
                lab.append(int(d1))
            elif (d1, d2) == (b1, b2):
                lab.append(Dim.B)
            elif (d1, d2) == (s1, s2):
                lab.append(Dim.S)
            elif (d1, d2) == (b1 * s1, b2 * s2):
                lab.append(Dim.BS)
            else:
                lab.append(Dim.UNKNOWN)
        labels[n] = tuple(lab)
    for name, init in graph.initializers.items():
        if init.const_value is not None:
            labels[name] = tuple(int(d) for d in init.const_value.shape)
    return DimLabels(labels)

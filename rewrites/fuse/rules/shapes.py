"""Shape preparation for the fusion rules: give every value the symbolic shape the rules check.

The attention rules check shapes such as ``query [B, S, H, Dh]`` and ``mask [B|1, 1, S, S]``. The
dynamo exporter writes constant reshape targets, so ONNX shape inference already knows them. The
TorchScript exporter computes targets at run time::

    x ──Shape──Gather(0)──Unsqueeze──┐
    x ──Shape──Gather(1)──Unsqueeze──┼──Concat──▶ Reshape(q, [B, S, -1, 32])
                          [-1], [32]─┘

and ONNX inference leaves ``-1`` and every dimension downstream of the mask unknown. This module
runs ONNX Runtime's symbolic shape inference (which evaluates such shape arithmetic, including
``Range``/``Expand`` of the padding mask) on a copy and writes the shapes it finds back onto the
values. Nothing in the graph changes: only value annotations.

It refuses (leaves the annotations alone, with the reason logged) when symbolic inference fails or
is incomplete, and for models with ``ai.onnx.ml`` ops: symbolic inference gives them shapes ORT's
kernels do not produce (``ArrayFeatureExtractor`` on a 1-D table returns ``[1, N]`` at run time, not
``[N]``), and an identity-reshape drop on such a shape changes the output's rank. Symbolic inference merges two symbolic dimensions where broadcasting requires them
to be equal for the model to run at all (``auto_merge``); that is the only assumption made.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from graphopt.analysis.shapes import proto_without_big_data, symbolic_infer
from graphopt.errors import first_line

logger = logging.getLogger(__name__)


def _dims(vi) -> list[int | str | None] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def annotate_symbolic_shapes(model: ir.Model) -> str | None:
    """Write ONNX Runtime's symbolic shapes onto ``model``'s values; return a reason on failure."""
    ml = sorted({n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain == "ai.onnx.ml"})
    if ml:
        return f"symbolic shape inference does not model ai.onnx.ml ops ({', '.join(ml)})"
    proto = proto_without_big_data(model)  # the weights' shapes, not a second copy of their bytes
    del proto.graph.value_info[:]
    try:
        inferred = symbolic_infer(proto, auto_merge=True, guess_output_rank=False)
    except Exception as e:  # noqa: BLE001 - any failure means: keep ONNX's shapes
        return f"symbolic shape inference failed: {first_line(e)}"
    if inferred is None:
        return "symbolic shape inference returned nothing"
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        dims = _dims(vi)
        if dims is not None:
            shapes[vi.name] = dims
    # graph inputs keep their declared names; map the symbols inference used for them
    updated = 0
    for node in model.graph:
        for out in node.outputs:
            dims = shapes.get(out.name)
            if dims is None:
                continue
            old = out.shape
            if old is not None and len(old) != len(dims):
                continue
            out.shape = ir.Shape(dims)
            updated += 1
    logger.debug("symbolic shapes written on %d values", updated)
    return None

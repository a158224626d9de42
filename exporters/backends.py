"""The two torch exporters, each returning an ``onnx_ir.Model``.

``dynamo``: ``torch.onnx.export(dynamo=True)`` (torch.export + the onnxscript translator); dynamic
axes become named ``torch.export.Dim`` objects, so the graph's symbolic dims carry those names.
``torchscript``: ``torch.onnx.export(dynamo=False)`` with ``dynamic_axes``; written to a temporary
folder (external data when large) and read back lazily, so the folder must outlive the model.
"""

from __future__ import annotations

import contextlib
import io as _io
import logging
import warnings
from pathlib import Path

import onnx_ir as ir

from graphopt import io
from graphopt.exporters.sources import Prepared

logger = logging.getLogger(__name__)

DEFAULT_OPSET = {"dynamo": 20, "torchscript": 17}
EXPORTERS = ("dynamo", "torchscript")


@contextlib.contextmanager
def _quiet():
    """Silence the exporters' warnings and chatter (they go to the log at debug level)."""
    buf = _io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
        warnings.simplefilter("ignore")
        noisy = [logging.getLogger(n) for n in ("torch", "onnx_ir", "onnxscript")]
        levels = [lg.level for lg in noisy]
        for lg in noisy:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(noisy, levels, strict=True):
                lg.setLevel(level)
    if buf.getvalue().strip():
        logger.debug("exporter output:\n%s", buf.getvalue())


def export_dynamo(prep: Prepared, opset: int | None) -> ir.Model:
    """torch.onnx.export(dynamo=True) -> onnx_ir.Model."""
    import torch

    dims: dict[str, object] = {}

    def dim(name: str):
        if prep.dim_hints.get(name) == "dynamic":
            return torch.export.Dim.DYNAMIC
        if name not in dims:
            safe = "".join(c if c.isalnum() else "_" for c in name)
            dims[name] = torch.export.Dim(safe)
        return dims[name]

    shapes = tuple({a: dim(d) for a, d in prep.dynamic_axes.get(n, {}).items()} or None for n in prep.input_names)
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(
            prep.module,
            prep.example,
            dynamo=True,
            input_names=prep.input_names,
            output_names=prep.output_names,
            dynamic_shapes=(shapes,),
            opset_version=opset or DEFAULT_OPSET["dynamo"],
            optimize=True,
            verbose=False,
        )
    model = program.model
    _name_dims(model, prep)
    return model


def export_torchscript(prep: Prepared, opset: int | None, workdir: Path) -> ir.Model:
    """torch.onnx.export(dynamo=False) into ``workdir`` -> onnx_ir.Model (lazy external data)."""
    import torch


    path = workdir / "torchscript.onnx"
    axes = {n: dict(a) for n, a in prep.dynamic_axes.items() if a}
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            prep.module,
            prep.example,
            str(path),
            dynamo=False,
            input_names=prep.input_names,
            output_names=prep.output_names,
            dynamic_axes=axes,
            opset_version=opset or DEFAULT_OPSET["torchscript"],
            do_constant_folding=True,
        )
    return io.load(path)


def _name_dims(model: ir.Model, prep: Prepared) -> None:
    """Give graph input/output dims the declared names (dynamo names some after expressions)."""
    for v in [*model.graph.inputs, *model.graph.outputs]:
        axes = prep.dynamic_axes.get(v.name)
        if not axes or v.shape is None:
            continue
        dims = list(v.shape)
        changed = False
        for a, name in axes.items():
            if a < len(dims) and not isinstance(dims[a], int):
                dims[a] = ir.SymbolicDim(name)
                changed = True
        if changed:
            v.shape = ir.Shape(dims)

"""Opset look-ups shared by passes."""

from __future__ import annotations

import onnx_ir as ir


def default_opset(model: ir.Model) -> int:
    """The model's opset version for the default ONNX domain (0 when it imports none)."""
    imports = model.opset_imports
    return imports.get("", imports.get("ai.onnx", 0))

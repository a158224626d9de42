"""Opset look-ups shared by passes."""

from __future__ import annotations

import onnx_ir as ir

#: ONNX Runtime's contrib-op domain (Attention, SkipLayerNormalization, ...)
MS_DOMAIN = "com.microsoft"
#: domain of onnxscript's intermediate placeholder ops (SDPA, rotary) before they become contrib ops;
#: onnxscript writes it out in its ort_fusions rules (graphopt.onnxscript_compat's test checks it)
FUSION_PLACEHOLDER_DOMAIN = "ai.onnxruntime._fusion"


def node_domain(node: ir.Node) -> str:
    """The node's domain with the default ONNX domain spelled ``""`` (also when written ``ai.onnx``)."""
    return "" if node.domain in ("", "ai.onnx") else node.domain


def default_opset(model: ir.Model) -> int:
    """The model's opset version for the default ONNX domain (0 when it imports none)."""
    imports = model.opset_imports
    return imports.get("", imports.get("ai.onnx", 0))

"""Opset look-ups shared by passes, and op counting (``domain::op_type`` keys) for reports, diffs and FLOPs."""

from __future__ import annotations

import collections

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


def op_histogram(graph_or_model: ir.Model | ir.Graph, recursive: bool = True) -> collections.Counter:
    """``domain::op_type`` (bare op_type for the default domain) -> count, subgraphs included."""
    graph = graph_or_model.graph if isinstance(graph_or_model, ir.Model) else graph_or_model
    nodes = ir.traversal.RecursiveGraphIterator(graph) if recursive else graph
    c: collections.Counter = collections.Counter()
    for n in nodes:
        c[op_key(n)] += 1
    return c


def op_key(node: ir.Node) -> str:
    """``domain::op_type``, or the bare op_type for the default domain."""
    return node.op_type if not node_domain(node) else f"{node.domain}::{node.op_type}"


def count_nodes(model: ir.Model) -> int:
    """Nodes of ``model``, subgraphs included."""
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


def op_delta(before: collections.Counter, after: collections.Counter) -> dict[str, int]:
    """Op key -> change in count from ``before`` to ``after`` (only the keys that changed, sorted)."""
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys) if after.get(k, 0) != before.get(k, 0)}

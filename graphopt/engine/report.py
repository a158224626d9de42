"""The optimization report: per pass what changed, how long it took and how it verified.

Printed as a rich table, saved as JSON (``--report FILE``); ``diff`` and ``bench`` reuse its parts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from typing import Any

import onnx_ir as ir

from graphopt.opsets import node_domain

SCHEMA_VERSION = 1


def op_histogram(graph_or_model: ir.Model | ir.Graph, recursive: bool = True) -> collections.Counter:
    """``domain::op_type`` (bare op_type for the default domain) -> count, subgraphs included."""
    graph = graph_or_model.graph if isinstance(graph_or_model, ir.Model) else graph_or_model
    nodes = ir.traversal.RecursiveGraphIterator(graph) if recursive else graph
    c: collections.Counter = collections.Counter()
    for n in nodes:
        c[op_key(n)] += 1
    return c


def op_key(node: ir.Node) -> str:
    return node.op_type if not node_domain(node) else f"{node.domain}::{node.op_type}"


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


def op_delta(before: collections.Counter, after: collections.Counter) -> dict[str, int]:
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys) if after.get(k, 0) != before.get(k, 0)}


@dataclasses.dataclass
class PassRecord:
    """What one pass did."""

    name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    exact: bool = True
    modified: bool = False
    status: str = "ok"  # ok | rolled-back | error | budget-not-met
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    op_delta: dict[str, int] = dataclasses.field(default_factory=dict)
    rule_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    verification: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    error: str = ""


@dataclasses.dataclass
class Report:
    """The whole run."""

    input: str = ""
    output: str = ""
    recipe: str = ""
    verify: str = "numeric"
    provider: str = "cpu"
    feeds: str = ""
    #: "verified", "unverified: <reason>" (no feed ran the input model: structure checked only),
    #: or "not checked (--verify LEVEL)"
    numerics: str = ""
    budget: str = ""
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: dict[str, int] = dataclasses.field(default_factory=dict)
    ops_after: dict[str, int] = dataclasses.field(default_factory=dict)
    final: dict[str, Any] = dataclasses.field(default_factory=dict)  # vs the input model
    seconds: float = 0.0
    ok: bool = True

    def failed(self) -> list[PassRecord]:
        return [p for p in self.passes if p.status in ("rolled-back", "error", "budget-not-met")]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        return json_safe(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON report to ``path`` atomically (``graphopt.io.write_atomic``)."""
        from graphopt import io

        io.write_atomic(path, self.to_json())

    def render(self, console=None) -> None:
        """Print the per-pass table with rich (headers and pass names never split, see ``graphopt.cli.console``)."""
        from graphopt.cli.console import make_console, table

        console = console or make_console()
        t = table(f"graphopt optimize: {self.input}",
                  [("pass", {"no_wrap": True}), ("status", {"no_wrap": True}), "modified", ("s", {"justify": "right"}), "nodes",
                   "op delta", "verification"])
        for p in self.passes:
            # largest changes first; the domain is dropped for display (the JSON report keeps it)
            top = sorted(p.op_delta.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:4]
            delta = " ".join(f"{k.split('::')[-1]}{v:+d}" for k, v in top)
            if len(p.op_delta) > 4:
                delta += f" …+{len(p.op_delta) - 4}"
            style = {"ok": "green", "rolled-back": "red", "error": "red", "budget-not-met": "red"}.get(p.status, "")
            t.add_row(
                p.name,
                f"[{style}]{p.status}[/]",
                "yes" if p.modified else "no",
                f"{p.seconds:.2f}",
                f"{p.nodes_before} → {p.nodes_after}",
                delta or "-",
                _fmt_verif(p.verification),
            )
        console.print(t)
        for p in self.passes:
            for note in p.notes:
                console.print(f"[dim]{p.name}: {note}[/]", highlight=False)
            if p.rule_counts:
                rc = ", ".join(f"{k}×{v}" for k, v in sorted(p.rule_counts.items()))
                console.print(f"[dim]{p.name} rules: {rc}[/]", highlight=False)
            if p.error:
                console.print(f"[red]{p.name}: {p.error}[/]", highlight=False)
        if self.numerics.startswith("unverified"):
            console.print(f"[yellow]numerics {self.numerics}[/]", highlight=False)
        summary = f"{self.nodes_before} → {self.nodes_after} nodes in {self.seconds:.2f} s"
        if self.final:
            summary += " · vs input: " + _fmt_verif(self.final)
        console.print(summary, highlight=False)


def _fmt_verif(v: dict) -> str:
    if not v:
        return "-"
    if v.get("level") == "off":
        return "off"
    parts = []
    if "max_abs" in v:
        parts.append(f"max_abs {v['max_abs']:.2e}")
    if "cosine_min" in v:
        parts.append(f"cos_min {v['cosine_min']:.6f}")
    if not parts:
        parts.append(v.get("level", ""))
    if v.get("reason"):
        parts.append(v["reason"])
    return " ".join(parts)


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as strings ("nan", "inf", "-inf"), numpy scalars as Python
    numbers, tuples as lists and dict keys as strings, so ``json.dumps`` writes standard JSON."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:  # numpy scalars
        return json_safe(obj.item())
    return obj

"""The optimization report: per pass what changed, how long it took and how it verified.

Saved as JSON (``--report FILE``); printed as a table by ``graphopt.cli.optimize.render``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from graphopt import io

SCHEMA_VERSION = 1


@dataclasses.dataclass
class PassRecord:
    """What one pass did."""

    name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    exact: bool = True
    modified: bool = False
    status: str = "ok"  # ok | rolled-back | error | budget-not-met | slower (rolled back by the speed guard)
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
    #: a decoder's tokenizer and config files copied from the input's folder beside the output
    companions: list[str] = dataclasses.field(default_factory=list)
    recipe: str = ""
    verify: str = "numeric"
    provider: str = "cpu"
    feeds: str = ""
    #: decoder budgets: the text windows the decoder metrics are measured on ("" when none)
    text: str = ""
    #: labels of the edge feeds lossless passes were checked on too (``graphopt.data.feeds.edge``)
    edge_feeds: list[str] = dataclasses.field(default_factory=list)
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
    #: the speed guard (``graphopt.engine.speed_guard``): checked, speedup (median t(input)/t(output)),
    #: rounds, rolled_back (pass names), seconds; or checked False and the reason
    speed: dict[str, Any] = dataclasses.field(default_factory=dict)
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
        io.write_atomic(path, self.to_json())


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

"""``DiffResult``: everything ``graphopt diff`` found, and its JSON form (see docs/diff-json-schema.md)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from graphopt.engine.report import json_safe

#: bump the major number on any incompatible change of the JSON layout
SCHEMA_VERSION = "1.1"


@dataclasses.dataclass
class DiffResult:
    """Structural (and optionally numeric) differences between model A and model B."""

    a: dict[str, Any]  # {"label", "nodes", "opsets"}
    b: dict[str, Any]
    summary: dict[str, Any]
    op_histogram: dict[str, Any]
    regions: list[dict[str, Any]]
    modified: list[dict[str, Any]]
    initializers: dict[str, Any]
    io: dict[str, Any]
    params: dict[str, Any]
    flops: dict[str, Any]
    subgraphs: list[dict[str, Any]]
    graphs: dict[str, list[dict[str, Any]]]  # "a"/"b" -> node records (for HTML and mapping)
    numeric: dict[str, Any] | None = None

    @property
    def identical(self) -> bool:
        """True when no node, initializer or signature changed (numerics not considered)."""
        return bool(self.summary.get("identical"))

    @property
    def drift(self) -> bool:
        """True when ``--numeric`` found a graph output beyond tolerance."""
        return bool(self.numeric and self.numeric.get("outputs_exceeding"))

    def as_dict(self) -> dict[str, Any]:
        d = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            d[f.name] = getattr(self, f.name)
        return json_safe(d)

    def to_json(self, indent: int | None = 2) -> str:
        """The stable JSON form (``schema_version`` first); non-finite floats become strings."""
        return json.dumps(self.as_dict(), indent=indent)

"""Base of the hand-written fusion steps that ``fuse`` runs beside onnxscript's rewrite rules."""

from __future__ import annotations

import onnx_ir as ir


class ReasonedStep:
    """A fusion step that remembers why sites did not match, for ``--explain fuse``.

    Subclasses implement ``apply_to_model(model) -> int`` (sites rewritten) and append one reason per
    refused site to ``self.reasons``.
    """

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def why_not(self, model: ir.Model) -> str | None:
        return self.reasons[0] if self.reasons else None

"""PyTorch and Hugging Face models to ONNX, with a parity gate (installed as ``graphopt.exporters``).

``export(src, output, task=..., exporter=..., attn=..., opset=..., dtype=..., atol=...)`` exports a
Hugging Face model folder or a ``module:function`` and checks the ONNX model against PyTorch before
writing it. Importing this package is cheap: torch and transformers load inside ``export``.
"""

from __future__ import annotations

from graphopt.exporters.export import ExportResult, check_parity, export
from graphopt.exporters.tasks import TASKS

__all__ = ["export", "check_parity", "ExportResult", "TASKS"]

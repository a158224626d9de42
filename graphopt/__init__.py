"""graphopt: an ONNX graph optimizer and export tool for transformer models on ONNX Runtime."""

from __future__ import annotations

__version__ = "0.1.0"

#: node metadata key naming the pass that created a node (read by ``graphopt diff``)
PASS_TAG = "graphopt.pass"

__all__ = ["PASS_TAG", "__version__"]

"""ONNX Runtime's symbolic shape inference, loaded without importing torch.

``onnxruntime.tools/__init__`` imports its PyTorch export helpers (and so torch, ~3 s) whenever torch
is installed; the shape-inference module itself needs only onnx, numpy and sympy. It is loaded here
from its file so that ``graphopt optimize`` does not pay for torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import tempfile
from functools import cache
from pathlib import Path


@cache
def _module():
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("onnxruntime is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "tools" / "symbolic_shape_infer.py"
    name = "graphopt._ort_symbolic_shape_infer"
    mod_spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = mod
    mod_spec.loader.exec_module(mod)
    return mod


def symbolic_infer(proto, **kwargs):
    """``SymbolicShapeInference.infer_shapes(proto, **kwargs)`` run in a scratch folder (it saves a
    temporary model into the current folder when inference is incomplete)."""
    with tempfile.TemporaryDirectory() as d, contextlib.chdir(d):
        return _module().SymbolicShapeInference.infer_shapes(proto, **kwargs)

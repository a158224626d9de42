"""ONNX Runtime's symbolic shape inference, loaded without importing torch.

``onnxruntime.tools/__init__`` imports its PyTorch export helpers (and so torch, ~3 s) whenever torch
is installed; the shape-inference module itself needs only onnx, numpy and sympy. It is loaded here
from its file as a private module object: it is not entered in ``sys.modules``, and the copy's
``onnx`` name is a view of the onnx module whose ``save_model`` writes nothing, because ORT saves
``sym_shape_infer_temp.onnx`` into the current folder when inference is incomplete (graphopt never
changes the process's folder to avoid that file).
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import onnx


class _OnnxWithoutSave:
    """The ``onnx`` module as ORT's loaded copy sees it, except that ``save_model`` is a no-op."""

    def __getattr__(self, name: str):
        return getattr(onnx, name)

    @staticmethod
    def save_model(*args, **kwargs) -> None:
        return None


@cache
def _module():
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("onnxruntime is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "tools" / "symbolic_shape_infer.py"
    mod_spec = importlib.util.spec_from_file_location("graphopt._ort_symbolic_shape_infer", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    mod.onnx = _OnnxWithoutSave()
    return mod


def symbolic_infer(proto, **kwargs):
    """``SymbolicShapeInference.infer_shapes(proto, **kwargs)``; writes no file anywhere."""
    return _module().SymbolicShapeInference.infer_shapes(proto, **kwargs)

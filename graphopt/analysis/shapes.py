"""ONNX Runtime's symbolic shape inference, loaded without importing torch.

``onnxruntime.tools/__init__`` imports its PyTorch export helpers (and so torch, ~3 s) whenever torch
is installed; the shape-inference module itself needs only onnx, numpy and sympy. It is loaded here
from its file as a private module object: it is not entered in ``sys.modules``, and the copy's
``onnx`` name is a view of the onnx module whose ``save_model`` writes nothing, because ORT saves
``sym_shape_infer_temp.onnx`` into the current folder when inference is incomplete (graphopt never
changes the process's folder to avoid that file).

The copy also infers ops its dispatcher lacks (:func:`_add_handlers`): ORT's integer MatMuls
``MatMulIntegerToFloat``, ``DynamicQuantizeMatMul`` and ``QAttention``, and ONNX's ``Attention``
(opset 23), which the table would otherwise send to the com.microsoft ``Attention`` handler.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import onnx
import onnx_ir as ir

from graphopt import protostream


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
    _add_handlers(mod)
    return mod


def _add_handlers(mod) -> None:
    """Register the handlers of the module docstring on the private copy's inference class."""
    cls = mod.SymbolicShapeInference
    init = cls.__init__

    def set_output(self, node, shape, elem_type) -> None:
        vi = self.known_vi_[node.output[0]]
        vi.CopyFrom(mod.helper.make_tensor_value_info(node.output[0], elem_type, shape))

    def elem(self, name: str) -> int:
        return self.known_vi_[name].type.tensor_type.elem_type

    def float_matmul(self, node) -> None:  # MatMulIntegerToFloat, DynamicQuantizeMatMul: a scale's float type
        self._compute_matmul_shape(node, elem(self, node.input[2]))

    def q_attention(self, node) -> None:  # QAttention: [B, S, hidden] like Attention, float (the input scale's)
        shape = self._get_shape(node, 0)
        weights = self._get_shape(node, 1)
        sizes = mod.get_attribute(node, "qkv_hidden_sizes")
        out = sizes[2] if sizes else (weights[1] // 3 if isinstance(weights[1], int) else weights[1])
        set_output(self, node, [*shape[:-1], out], elem(self, node.input[3]))

    def attention(self, node, contrib=cls._infer_Attention) -> None:
        if node.domain not in ("", "ai.onnx"):
            return contrib(self, node)
        q, v = self._get_shape(node, 0), self._get_shape(node, 2)
        if len(q) == 3:  # [B, S, q_heads * v_head]
            qh, kvh = mod.get_attribute(node, "q_num_heads"), mod.get_attribute(node, "kv_num_heads")
            last = v[-1] * qh // kvh if qh and kvh and isinstance(v[-1], int) else q[-1]
            shape = [q[0], q[1], last]
        else:  # [B, q_heads, S, v_head]
            shape = [q[0], q[1], q[2], v[-1]]
        set_output(self, node, shape, elem(self, node.input[0]))
        return None

    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.dispatcher_.update({
            "MatMulIntegerToFloat": lambda node: float_matmul(self, node),
            "DynamicQuantizeMatMul": lambda node: float_matmul(self, node),
            "QAttention": lambda node: q_attention(self, node),
            "Attention": lambda node: attention(self, node),
        })

    cls.__init__ = __init__


def symbolic_infer(proto, **kwargs):
    """``SymbolicShapeInference.infer_shapes(proto, **kwargs)``; writes no file anywhere."""
    return _module().SymbolicShapeInference.infer_shapes(proto, **kwargs)


def proto_without_big_data(model: ir.Model, min_elements: int = 4096) -> onnx.ModelProto:
    """A ModelProto of ``model`` whose initializers of ``min_elements`` or more are graph inputs (shape only).

    Shape inference needs the weights' shapes, not their bytes: serializing them would copy every weight once
    more. Small initializers (shape arithmetic, reshape targets) keep their values. ``model`` is unchanged.
    """
    big = protostream.big_initializers(model, min_elements=min_elements)
    proto = protostream.serialize_without(model, {n for n, _ in big})
    for n, v in big:
        t = v.const_value
        proto.graph.input.append(onnx.helper.make_tensor_value_info(n, ir.DataType(t.dtype).value, list(t.shape)))
    return proto

"""graphopt.analysis.shapes: ORT's symbolic shape inference without side effects on the process."""

from __future__ import annotations

import os
import sys

import pytest
from onnx import TensorProto, helper

from graphopt.analysis.shapes import symbolic_infer


def _model(op: str, domain: str = ""):
    node = helper.make_node(op, ["x"], ["y"], domain=domain)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def test_infers_symbolic_shapes():
    out = symbolic_infer(_model("Relu"), auto_merge=True)
    dims = out.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["B", 4]


def test_incomplete_inference_writes_nothing_and_keeps_the_process_as_it_was(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="Incomplete symbolic shape inference"):
        symbolic_infer(_model("Foo", domain="custom"), auto_merge=True)
    assert os.getcwd() == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # ORT would write sym_shape_infer_temp.onnx here
    assert not any("symbolic_shape_infer" in m for m in sys.modules)

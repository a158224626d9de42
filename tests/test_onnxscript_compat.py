"""onnxscript is used inside the bound pyproject.toml declares, and every compat name resolves.

graphopt.onnxscript_compat is the one module that depends on onnxscript beyond its exported API; a new
onnxscript release should fail here, loudly, rather than in a user's ``fuse`` or ``cleanup``.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import tomllib
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxscript
import onnxscript.rewriter.ort_fusions.sdpa as ort_sdpa

from graphopt import onnxscript_compat as compat

REPO = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _declared_bound() -> tuple[tuple[int, ...], tuple[int, ...]]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"onnxscript\b", d)]
    low = re.search(r">=\s*([\d.]+)", spec)
    high = re.search(r"<\s*([\d.]+)", spec)
    assert low and high, f"pyproject's onnxscript dependency needs a lower and an upper bound: {spec!r}"
    return _version(low.group(1)), _version(high.group(1))


def test_pyproject_bound_is_the_tested_range():
    low, high = _declared_bound()
    assert low == compat.TESTED_MIN and high == compat.TESTED_BELOW


def test_installed_onnxscript_inside_the_bound():
    low, high = _declared_bound()
    installed = _version(importlib.metadata.version("onnxscript"))
    assert installed == _version(onnxscript.__version__)
    assert low <= installed < high, f"onnxscript {onnxscript.__version__} outside [{low}, {high})"


def test_every_compat_name_resolves():
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name
    assert compat.DEFAULT_REWRITE_RULES and all(hasattr(r, "try_rewrite") for r in compat.DEFAULT_REWRITE_RULES)
    assert isinstance(compat.FOLD_INPUT_SIZE_LIMIT, int) and compat.FOLD_INPUT_SIZE_LIMIT > 0
    assert isinstance(compat.FOLD_OUTPUT_SIZE_LIMIT, int) and compat.FOLD_OUTPUT_SIZE_LIMIT > 0
    assert len(compat.mha_scale_rules.rules) == 1 and len(compat.sdpa_via_mha_rules.rules) == 1
    # the placeholder domain is a string onnxscript writes out in its rules, not a name it exports
    assert f'"{compat.FUSION_PLACEHOLDER_DOMAIN}"' in inspect.getsource(ort_sdpa)


def test_private_names_match_onnxscript():
    """Where compat rebuilds or reads a private name, it equals what onnxscript itself uses."""
    from onnxscript import rewriter
    from onnxscript.rewriter.ort_fusions import mha_scale, sdpa_via_mha

    assert compat.DEFAULT_REWRITE_RULES == tuple(rewriter._DEFAULT_REWRITE_RULES)
    assert [r.name for r in compat.mha_scale_rules.rules] == [r.name for r in mha_scale._mha_scale_rules.rules]
    assert [r.name for r in compat.sdpa_via_mha_rules.rules] == [r.name for r in sdpa_via_mha._rules.rules]


def _const(name: str, arr) -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(np.asarray(arr), name=name))


def test_value_helpers():
    assert compat.get_numpy_value(None) is None
    np.testing.assert_array_equal(compat.get_numpy_value(_const("a", [1, 2])), [1, 2])
    assert compat.get_singleton_value(_const("s", 3.5)) == 3.5
    assert compat.get_singleton_value(_const("s1", [3.5]), rank=0) is None
    assert compat.get_singleton_value(_const("s1", [3.5]), rank=(0, 1)) == 3.5
    assert compat.get_singleton_value(_const("v", [1, 2])) is None
    assert compat.get_singleton_value(ir.Value(name="x")) is None
    # a Constant node's output is read through constant propagation
    node = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([7], np.int64))})
    assert compat.get_singleton_value(node.outputs[0]) == 7


def test_check_shape_bool():
    x = ir.Value(name="x", shape=ir.Shape(["B", "S"]))
    y = ir.Value(name="y", shape=ir.Shape(["B", "S"]))
    z = ir.Value(name="z", shape=ir.Shape(["B", 4]))
    bindings: dict = {}
    assert compat.check_shape_bool(bindings, x, ["B", "S"]) and compat.check_shape_bool(bindings, y, ["B", "S"])
    assert not compat.check_shape_bool(bindings, z, ["B", "S"])
    assert not compat.check_shape_bool({}, x, ["B"])
    assert not compat.check_shape_bool({}, ir.Value(name="u"), ["B"])


def test_fold_constants_pass_folds_and_reports():
    a = _const("a", np.ones((2, 2), np.float32))
    b = _const("b", np.full((2, 2), 2.0, np.float32))
    add = ir.node("Add", [a, b])
    x = ir.Value(name="x", shape=ir.Shape([2, 2]), type=ir.TensorType(ir.DataType.FLOAT))
    mul = ir.node("Mul", [x, add.outputs[0]])
    mul.outputs[0].name = "y"
    graph = ir.Graph([x], mul.outputs, nodes=[add, mul], initializers=[a, b], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    assert compat.FoldConstantsPass()(model).modified
    assert [n.op_type for n in model.graph if n.op_type != "Constant"] == ["Mul"]
    folded = compat.get_numpy_value(model.graph.node(-1).inputs[1])
    np.testing.assert_array_equal(folded, np.full((2, 2), 3.0, np.float32))
    assert not compat.FoldConstantsPass()(model).modified


def _guarded_log(eps: float, as_node: bool) -> ir.Model:
    """``Log(x * x + eps)``: the guard keeps silence (x = 0) finite."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"])]
    inits = []
    if as_node:
        nodes.append(helper.make_node("Constant", [], ["eps"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [eps])))
    else:
        inits.append(helper.make_tensor("eps", TensorProto.FLOAT, [], [eps]))
    nodes += [helper.make_node("Add", ["sq", "eps"], ["s"]), helper.make_node("Log", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = 9
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def test_identity_constants_match_exactly():
    """onnxscript's ``x + 0`` rule (abs_tol 1e-8 upstream) no longer drops an epsilon guard."""
    from onnxscript.rewriter.rules.common import _no_op

    from graphopt.onnxscript_compat import DEFAULT_REWRITE_RULES, exact_identity_constants

    assert any(r in DEFAULT_REWRITE_RULES for r in _no_op.rules.rules)
    assert exact_identity_constants(DEFAULT_REWRITE_RULES) == 0  # already applied at import
    for as_node in (True, False):
        model = _guarded_log(1e-10, as_node)
        assert _no_op.rules.apply_to_model(model) == 0
        assert [n.op_type for n in model.graph if n.op_type != "Constant"] == ["Mul", "Add", "Log"]
    model = _guarded_log(0.0, as_node=False)  # a real `+ 0` still goes
    assert _no_op.rules.apply_to_model(model) == 1


def test_epsilon_guard_survives_optimize(tmp_path):
    """The default recipe keeps ``Log(x*x + 1e-10)`` exact: silence stays finite and equal to the input model."""
    import onnxruntime as ort

    from graphopt.cli.main import main

    for as_node in (True, False):
        src, out = tmp_path / f"guard{as_node}.onnx", tmp_path / f"guard{as_node}.opt.onnx"
        ir.save(_guarded_log(1e-10, as_node), src)
        assert main(["optimize", str(src), "-o", str(out)]) == 0
        feeds = {"x": np.zeros((2, 16), np.float32)}
        ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.isfinite(ref).all() and np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=1e-6)

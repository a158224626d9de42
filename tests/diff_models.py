"""Small ONNX models for the diff tests, built with onnx.helper (no files committed)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphopt

H = 8


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(arr.astype(np.float32), name)


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "gamma": rng.standard_normal(H) * 0.1 + 1.0,
        "beta": rng.standard_normal(H) * 0.1,
        "W1": rng.standard_normal((H, H)) * 0.3,
        "W2": rng.standard_normal((H, H)) * 0.3,
        "W3": rng.standard_normal((H, H)) * 0.3,
        "eps": np.array(1e-5),
        "two": np.array(2.0),
    }


def _decomposed_ln(x: str, out: str, prefix: str) -> list[onnx.NodeProto]:
    p = prefix
    return [
        helper.make_node("ReduceMean", [x], [f"{p}mean"], name=f"{p}ReduceMean", axes=[-1]),
        helper.make_node("Sub", [x, f"{p}mean"], [f"{p}centered"], name=f"{p}Sub"),
        helper.make_node("Pow", [f"{p}centered", "two"], [f"{p}sq"], name=f"{p}Pow"),
        helper.make_node("ReduceMean", [f"{p}sq"], [f"{p}var"], name=f"{p}ReduceMean2", axes=[-1]),
        helper.make_node("Add", [f"{p}var", "eps"], [f"{p}var_eps"], name=f"{p}AddEps"),
        helper.make_node("Sqrt", [f"{p}var_eps"], [f"{p}std"], name=f"{p}Sqrt"),
        helper.make_node("Div", [f"{p}centered", f"{p}std"], [f"{p}norm"], name=f"{p}Div"),
        helper.make_node("Mul", [f"{p}norm", "gamma"], [f"{p}scaled"], name=f"{p}Mul"),
        helper.make_node("Add", [f"{p}scaled", "beta"], [out], name=f"{p}AddBeta"),
    ]


def _fused_ln(x: str, out: str, prefix: str) -> onnx.NodeProto:
    n = helper.make_node("LayerNormalization", [x, "gamma", "beta"], [out], name=f"{prefix}LayerNorm",
                         axis=-1, epsilon=1e-5)
    n.metadata_props.add(key=graphopt.PASS_TAG, value="fuse")
    return n


def mlp_ln(fused: bool = False, seed: int = 0, perturb: str | None = None) -> onnx.ModelProto:
    """x -> MatMul W1 -> Relu -> LN -> MatMul W2 -> Relu -> LN -> MatMul W3 -> y.

    ``fused`` replaces each 9-node decomposed LayerNorm with one LayerNormalization tagged
    ``graphopt.pass=fuse``; ``perturb`` adds 0.5 to one element of that weight.
    """
    w = _weights(seed)
    if perturb:
        w[perturb] = w[perturb].copy()
        w[perturb].flat[3] += 0.5
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
    ]
    nodes += [_fused_ln("r1", "ln1", "ln1/")] if fused else _decomposed_ln("r1", "ln1", "ln1/")
    nodes += [
        helper.make_node("MatMul", ["ln1", "W2"], ["h2"], name="mm2"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
    ]
    nodes += [_fused_ln("r2", "ln2", "ln2/")] if fused else _decomposed_ln("r2", "ln2", "ln2/")
    nodes += [helper.make_node("MatMul", ["ln2", "W3"], ["y"], name="mm3")]
    names = ["gamma", "beta", "W1", "W2", "W3"] + ([] if fused else ["eps", "two"])
    graph = helper.make_graph(
        nodes, "mlp_ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", H])],
        initializer=[_init(n, w[n]) for n in names],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def unrelated() -> onnx.ModelProto:
    """A conv net sharing nothing with ``mlp_ln``."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["img", "K"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
        helper.make_node("GlobalAveragePool", ["s"], ["out"], name="gap"),
    ]
    graph = helper.make_graph(
        nodes, "convnet",
        [helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 1, 1])],
        initializer=[_init("K", rng.standard_normal((4, 3, 3, 3)))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def with_if(then_extra: bool = False) -> onnx.ModelProto:
    """y = If(cond) then Relu(x) [-> Neg] else Abs(x): for subgraph diffs."""
    then_nodes = [helper.make_node("Relu", ["x"], ["t"], name="t_relu")]
    if then_extra:
        then_nodes = [helper.make_node("Relu", ["x"], ["t0"], name="t_relu"),
                      helper.make_node("Neg", ["t0"], ["t"], name="t_neg")]
    vi = helper.make_tensor_value_info
    then_g = helper.make_graph(then_nodes, "then", [], [vi("t", TensorProto.FLOAT, [4])])
    else_g = helper.make_graph([helper.make_node("Abs", ["x"], ["e"], name="e_abs")], "else", [],
                               [vi("e", TensorProto.FLOAT, [4])])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=else_g)],
        "ifnet", [vi("cond", TensorProto.BOOL, []), vi("x", TensorProto.FLOAT, [4])],
        [vi("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model

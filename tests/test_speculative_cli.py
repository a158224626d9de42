"""`graphopt generate --speculative`: the same tokens as plain decoding, the draft's figures in --json and on
stderr, an unknown mode refused (exit 2)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import load_models_module

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from test_generate_cli import save_tokenizer

    tiny = load_models_module("tiny")
    d = tmp_path_factory.mktemp("tiny-llama-spec")
    shutil.copy(tiny.build("llama", "causal-lm-with-past"), d / "model.onnx")
    for f in ("config.json", "generation_config.json"):
        shutil.copy(tiny.build_folder("llama", "causal-lm-with-past") / f, d / f)
    save_tokenizer(d)
    return d / "model.onnx"


PROMPT = "w5 w17 w99 w3 w250 w5 w17 w99 w3 w250 w5 w17"


def test_speculative_json_equals_plain_and_reports_acceptance(run_cli, model_path):
    args = ("generate", model_path, "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json")
    code, plain, err = run_cli(*args)
    assert code == 0, err
    for mode in ("lookup", "auto"):
        code, out, err = run_cli(*args, "--speculative", mode)
        assert code == 0, err
        got, want = json.loads(out), json.loads(plain)
        assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
        assert got["speculative"] == "lookup" and got["steps"] >= 1 and got["drafted"] > 0
        assert 0 <= got["accepted_per_step"] <= got["drafted"] and got["tokens_per_step"] >= 1
    assert "accepted_per_step" not in json.loads(plain)
    code, out, err = run_cli("generate", model_path, "--prompt", PROMPT, "--max-new-tokens", "6", "--ignore-eos",
                             "--speculative", "lookup")
    assert code == 0 and "accepted per step (lookup)" in err, err


def test_unknown_mode_is_a_usage_error(run_cli, model_path):
    code, _, err = run_cli("generate", model_path, "--prompt", PROMPT, "--speculative", "psychic")
    assert code == 2 and "unknown mode 'psychic'" in err, err


def test_bench_generate_speculative_rows(run_cli, model_path, tmp_path):
    text = tmp_path / "repeat.txt"
    text.write_text(" ".join(["w5 w17 w99 w3 w250 w7 w8"] * 6))
    rep = tmp_path / "gen.json"
    code, out, err = run_cli("bench", "--generate", model_path, "--prompt-file", text, "--context", "30",
                             "--max-new-tokens", "16", "--rounds", "2", "--warmup", "1", "--threads", "1",
                             "--no-rss", "--genai", "none", "--speculative", "lookup", "--report", rep)
    assert code == 0, err + out
    doc = json.loads(rep.read_text())
    plain, spec = doc["results"]
    assert (plain["name"], spec["name"]) == ("model.onnx", "model.onnx +lookup") and doc["speculative"] == "lookup"
    assert "accepted_per_step" not in plain and spec["accepted_per_step"] >= 0
    assert spec["speedup_vs"] == "model.onnx" and spec["speedup"] > 0 and spec["tokens_equal_plain"]
    assert spec["greedy_agreement"] == 16
    assert "accepted/step" in out and "speed-up" in out


def test_draft_model_and_layer_skip_on_the_command_line(run_cli, model_path, tmp_path):
    from graphopt import io
    from graphopt.engine.registry import builtin

    args = ("generate", model_path, "--prompt", PROMPT, "--max-new-tokens", "16", "--ignore-eos", "--json")
    code, plain, err = run_cli(*args)
    assert code == 0, err
    code, out, err = run_cli(*args, "--draft", model_path)  # the model drafting for itself
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == json.loads(plain)["token_ids"] and got["speculative"] == "draft-model"
    assert got["accepted"] > 0
    code, out, err = run_cli(*args, "--draft", tmp_path / "none.onnx")
    assert code == 2 and "no such file" in err
    code, out, err = run_cli(*args, "--speculative", "layer-skip")
    assert code == 2 and "carries no layer-skip draft" in err
    model = io.load(model_path)
    assert builtin().create("layer-skip-draft", {"prompts": 2, "prompt_tokens": 8, "new_tokens": 8, "drafts": 2,
                                                 "repeats": 1, "threads": 1, "min_gain": 0.0})(model).modified
    ls = model_path.parent / "model-ls.onnx"
    io.save(model, ls)
    code, out, err = run_cli(*args[:1], ls, *args[2:], "--speculative", "layer-skip")
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == json.loads(plain)["token_ids"] and got["speculative"] == "layer-skip"


def test_bench_generate_with_a_draft_model(run_cli, model_path, tmp_path):
    rep = tmp_path / "gen.json"
    args = ("bench", "--generate", model_path, "--context", "16", "--max-new-tokens", "12", "--rounds", "1",
            "--warmup", "1", "--threads", "1", "--no-rss", "--genai", "none")
    code, out, err = run_cli(*args, "--draft", model_path, "--report", rep)  # the model drafting for itself
    assert code == 0, err + out
    doc = json.loads(rep.read_text())
    plain, spec = doc["results"]
    assert spec["name"] == "model.onnx +draft" and doc["speculative"] == "draft" and doc["draft"] == str(model_path)
    assert spec["tokens_equal_plain"] and spec["accepted_per_step"] > 0 and spec["greedy_agreement"] == 12
    code, out, err = run_cli(*args, "--draft", tmp_path / "none.onnx")
    assert code == 2 and "no such file" in err
    code, out, err = run_cli(*args, "--draft", model_path, "--speculative", "lookup", "--report", rep)
    assert code == 0, err + out
    spec = json.loads(rep.read_text())["results"][1]
    assert spec["name"] == "model.onnx +lookup+draft" and spec["tokens_equal_plain"]
    code, out, err = run_cli(*args, "--draft", model_path, "--speculative", "heads")
    assert code == 2 and "--draft" in err


"""`graphopt deploy --genai`: the folder ONNX Runtime GenAI loads (genai_config.json, model, tokenizer files), its
greedy tokens equal to `graphopt generate`'s, and the one-line refusals of graphs that do not fit."""

from __future__ import annotations

import importlib.util
import json

import onnx_ir as ir
import pytest
from test_generate_cli import model_dir, save_tokenizer, tiny  # noqa: F401 (fixtures)

from graphopt import io
from graphopt.errors import UsageError

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
HAVE_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None


def test_config_maps_the_decoder_contract(run_cli, model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "genai"
    code, stdout, err = run_cli("deploy", model_dir / "model.onnx", "-o", out, "--genai", "--no-verify")
    assert code == 0, err
    assert "not verified (--no-verify)" in stdout
    assert {p.name for p in out.iterdir()} >= {"model.onnx", "genai_config.json", "tokenizer.json", "config.json"}
    cfg = json.loads((out / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert (dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]) == (2, 2, 16)
    assert (dec["num_attention_heads"], dec["hidden_size"]) == (4, 64)  # from config.json beside the model
    assert dec["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                             "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    assert dec["outputs"]["present_key_names"] == "present.%d.key"
    assert cfg["model"]["eos_token_id"] == 2 and cfg["model"]["vocab_size"] == 1000
    assert cfg["model"]["context_length"] == 128 and cfg["model"]["type"] == "llama"
    assert cfg["search"]["past_present_share_buffer"] is False  # present = past + new positions
    code, _, err = run_cli("deploy", model_dir / "model.onnx", "-o", out, "--genai", "--no-verify")
    assert code == 1 and "exists" in err  # nothing replaced without --force


@pytest.mark.skipif(not HAVE_GENAI, reason="onnxruntime_genai not installed")
def test_genai_loads_the_folder_and_generates_graphopt_tokens(run_cli, model_dir, tmp_path):  # noqa: F811
    from graphopt.deploy_genai import genai_greedy
    from graphopt.generate.loop import generate
    from graphopt.generate.sampling import GREEDY

    out = tmp_path / "genai"
    code, stdout, err = run_cli("deploy", model_dir / "model.onnx", "-o", out, "--genai")
    assert code == 0, err
    assert "onnxruntime_genai's 16 greedy tokens equal graphopt generate's" in stdout
    prompt = [5, 17, 99, 3, 250, 7, 41, 600]
    want = generate(model_dir / "model.onnx", prompt, max_new_tokens=24, sampling=GREEDY.masking([2])).token_ids
    assert genai_greedy(out, prompt, 24) == want


def test_last_position_logits_do_not_fit(model_dir, tmp_path):  # noqa: F811
    from graphopt.deploy_genai import deploy_genai

    model = io.load(model_dir / "model.onnx")
    logits = next(v for v in model.graph.outputs if v.name == "logits")
    logits.shape = ir.Shape([logits.shape[0], 1, logits.shape[2]])
    src = tmp_path / "last.onnx"
    io.save(model, src)
    with pytest.raises(UsageError, match="does not fit ONNX Runtime GenAI: 'logits' holds the last position only"):
        deploy_genai(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_not_a_decoder_is_refused(run_cli, tmp_path):
    from testmodels import make_mlp

    make_mlp(tmp_path / "mlp.onnx")
    code, _, err = run_cli("deploy", tmp_path / "mlp.onnx", "-o", tmp_path / "out", "--genai", "--no-verify")
    assert code == 2 and "not a decoder with past" in err
    assert not (tmp_path / "out").exists()

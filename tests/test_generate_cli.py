"""`graphopt generate`: --json, streaming, --ignore-eos, sampling flags and the bad-input messages (exit 2)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import load_models_module

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

KEYS = {"prompt_ids", "token_ids", "text", "prefill_ms", "decode_tokens_per_s"}
CHAT_TEMPLATE = ("{% for m in messages %}<s> w10 {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}w11 {% endif %}")


def save_tokenizer(folder, *, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A word-level tokenizer for the tiny models' 1000 ids: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3,
    ``w4`` ... ``w999``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 1000)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def tiny():
    return load_models_module("tiny")


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory):
    """A folder as a user has it: the llama export, its tokenizer and the Hugging Face config files."""
    d = tmp_path_factory.mktemp("tiny-llama")
    shutil.copy(tiny.build("llama", "causal-lm-with-past"), d / "model.onnx")
    for f in ("config.json", "generation_config.json"):
        shutil.copy(tiny.build_folder("llama", "causal-lm-with-past") / f, d / f)
    save_tokenizer(d)
    return d


def test_json_keys_and_ignore_eos_count(run_cli, model_dir):
    from graphopt.generate.loop import generate
    from graphopt.generate.sampling import Sampling

    code, out, err = run_cli("generate", model_dir / "model.onnx", "--prompt", "w5 w17 w99", "--max-new-tokens", "18",
                             "--ignore-eos", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert set(got) == KEYS
    assert got["prompt_ids"] == [5, 17, 99] and len(got["token_ids"]) == 18
    assert got["text"] == " ".join(f"w{t}" for t in got["token_ids"] if t > 3)
    assert got["prefill_ms"] > 0 and got["decode_tokens_per_s"] > 0
    want = generate(model_dir / "model.onnx", [5, 17, 99], max_new_tokens=18, sampling=Sampling().masking([2]))
    assert got["token_ids"] == want.token_ids


def test_streams_text_and_reports_timings(run_cli, model_dir):
    code, out, err = run_cli("generate", model_dir / "model.onnx", "--prompt", "w5 w17 w99", "--max-new-tokens", "6",
                             "--ignore-eos")
    assert code == 0, err
    _, js, _ = run_cli("generate", model_dir / "model.onnx", "--prompt", "w5 w17 w99", "--max-new-tokens", "6",
                       "--ignore-eos", "--json")
    assert out == json.loads(js)["text"] + "\n"
    assert "6 tokens (length): prefill" in err and "tokens/s" in err


def test_chat_template_and_seeded_sampling(run_cli, model_dir):
    args = ["generate", model_dir / "model.onnx", "--prompt", "w5 w6", "--max-new-tokens", "8", "--json"]
    code, out, err = run_cli(*args, "--chat")
    assert code == 0, err
    assert json.loads(out)["prompt_ids"] == [1, 10, 5, 6, 2, 11]
    sample = [*args, "--temperature", "0.9", "--top-k", "40", "--top-p", "0.9", "--seed", "5", "--ignore-eos"]
    runs = [json.loads(run_cli(*sample)[1])["token_ids"] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 8


def test_tokenizer_folder_option(run_cli, model_dir, tmp_path):
    shutil.copy(model_dir / "model.onnx", tmp_path / "m.onnx")
    code, out, err = run_cli("generate", tmp_path / "m.onnx", "--prompt", "w5", "--max-new-tokens", "3",
                             "--ignore-eos", "--json", "--tokenizer", model_dir)
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 3


def _error(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("error: "), err
    return lines[0]


def test_bad_inputs_are_one_line_and_exit_2(run_cli, model_dir, tiny, tmp_path):
    onnx = model_dir / "model.onnx"
    # not a decoder with past (the causal-lm export, tokenizer beside it)
    shutil.copy(tiny.build("llama", "causal-lm"), tmp_path / "nopast.onnx")
    save_tokenizer(tmp_path)
    code, _, err = run_cli("generate", tmp_path / "nopast.onnx", "--prompt", "w5")
    assert code == 2 and "not a decoder with past: no past_key_values" in _error(err)
    # no tokenizer beside the model
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(onnx, bare / "model.onnx")
    code, _, err = run_cli("generate", bare / "model.onnx", "--prompt", "w5")
    assert code == 2 and "no tokenizer files" in _error(err) and "--tokenizer" in err
    # a prompt longer than the model's maximum (config.json: 128 positions)
    code, _, err = run_cli("generate", onnx, "--prompt", " ".join(["w5"] * 200))
    assert code == 2 and "the prompt is 200 tokens; the model takes at most 128" in _error(err)
    # a missing model, a tokenizer without a chat template, a bad sampling value
    code, _, err = run_cli("generate", tmp_path / "missing.onnx", "--prompt", "w5")
    assert code == 2 and "no such file" in _error(err)
    notemplate = tmp_path / "notemplate"
    save_tokenizer(notemplate, chat_template=None)
    code, _, err = run_cli("generate", onnx, "--prompt", "w5", "--chat", "--tokenizer", notemplate)
    assert code == 2 and "no chat template" in _error(err)
    code, _, err = run_cli("generate", onnx, "--prompt", "w5", "--top-p", "1.5")
    assert code == 2 and "top-p" in _error(err)


def test_help(run_cli):
    code, out, err = run_cli("generate", "--help")
    assert code == 0, err
    assert "--ignore-eos" in out and "--tokenizer" in out
    assert "typing." not in out and " object at 0x" not in out and "<class " not in out, out


def test_streamed_text_waits_for_whole_characters():
    from graphopt.generate.text import _Deltas

    class Bytes:  # token t is byte t; "é" is two tokens
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    shown = []
    deltas = _Deltas(Bytes(), shown.append)
    for row, t in enumerate(b"a\xc3\xa9b"):
        deltas(row, t)
    assert shown == ["a", "\u00e9", "b"]


def test_optimized_decoder_gets_its_tokenizer_beside_it(run_cli, model_dir, tmp_path):
    """optimize copies the decoder's tokenizer and configs beside the output (never replacing a file there), so
    generate runs on the output with no --tokenizer and gives the input's greedy tokens."""
    out_dir = tmp_path / "built"
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")  # the user's own file stays
    code, text, err = run_cli("optimize", model_dir / "model.onnx", "-o", out_dir / "model.onnx", "--passes", "cleanup",
                              "--speed-check", "off")
    assert code == 0, err
    assert "beside the output: tokenizer.json" in text
    assert (out_dir / "tokenizer.json").is_file() and (out_dir / "generation_config.json").is_file()
    assert (out_dir / "config.json").read_text() == "{}"
    assert not list(out_dir.glob(".*.tmp"))
    args = ("--prompt", "w5 w17 w99", "--max-new-tokens", "8", "--ignore-eos", "--json")
    code, a, err = run_cli("generate", out_dir / "model.onnx", *args)
    assert code == 0, err
    code, b, err = run_cli("generate", model_dir / "model.onnx", *args)
    assert json.loads(a)["token_ids"] == json.loads(b)["token_ids"]

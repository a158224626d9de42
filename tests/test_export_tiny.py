"""Exporter end to end on the seeded tiny families: every family x task, with the parity gate.

Each test exports afresh into tmp_path (the export is what is under test); the HF folders come from
``models/tiny.py`` through the models cache.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="exporting needs torch")
pytest.importorskip("transformers", reason="exporting needs transformers")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _models_module(name: str):
    if str(REPO / "models") not in sys.path:
        sys.path.insert(0, str(REPO / "models"))
    return importlib.import_module(name)


@pytest.fixture(scope="session")
def tiny():
    """The models/tiny.py module (folders land in the models cache)."""
    return _models_module("tiny")


CASES = [(fam, task) for fam, tasks in _models_module("tiny").FAMILIES.items() for task in tasks]


@pytest.fixture(scope="session")
def tiny_onnx(tiny):
    """family, task -> cached ONNX export (parity-gated when built; built once per cache)."""
    built = {}

    def get(family, task):
        if (family, task) not in built:
            built[family, task] = tiny.build(family, task)
        return built[family, task]

    return get


@pytest.mark.parametrize(("family", "task"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_tiny_family_exports_with_parity(tiny, tiny_onnx, family, task):
    import onnx

    from graphopt.exporters import check_parity

    path = tiny_onnx(family, task)
    m = onnx.load(path)
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["graphopt.task"] == task
    assert meta["graphopt.exporter"] == "dynamo"
    assert meta["graphopt.attn_implementation"] in ("sdpa", "eager")
    # the cached file still matches PyTorch (feeds include a padded batch and a second shape)
    result = check_parity(tiny.build_folder(family, task), path, task=task, attn=meta["graphopt.attn_implementation"])
    assert result.passed and result.max_abs <= 1e-4
    assert any("padded" in f for f in result.feeds)
    ins = [i.name for i in m.graph.input]
    outs = [o.name for o in m.graph.output]
    assert ins[:2] == ["input_ids", "attention_mask"]
    assert ("token_type_ids" in ins) == (family == "bert")
    dims = [d.dim_param for d in m.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence"]
    if task == "causal-lm-with-past":
        layers = 2
        assert ins[2:] == [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        assert outs == ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        past = [d.dim_param or d.dim_value for d in m.graph.input[2].type.tensor_type.shape.dim]
        assert past[0] == "batch" and past[2] == "past_sequence"
    else:
        assert outs == ["last_hidden_state" if task == "feature-extraction" else "logits"]


def test_fresh_export_result(tiny, tmp_path):
    """export() itself (not the cache): result object, file, numbers per output."""
    from graphopt.exporters import export

    out = tmp_path / "bert.onnx"
    result = export(tiny.build_folder("bert", "token-classification"), out, task="token-classification",
                    exporter="torchscript", attn="eager")
    assert out.is_file() and result.path == out
    assert (result.exporter, result.attn, result.opset, result.fallback) == ("torchscript", "eager", 17, None)
    [o] = result.parity.outputs
    assert o.name == "logits" and o.passed and o.max_abs <= 1e-4 and o.cosine > 0.9999
    assert result.as_dict()["parity"]["passed"] is True


def test_llama_with_past_torchscript_runs_a_decode_step(tiny, tmp_path):
    """TorchScript on request; the with-past graph takes a one-token step after a 5-token past."""
    from graphopt.exporters import export
    from graphopt.runtime import session as runtime

    folder = tiny.build_folder("llama", "causal-lm-with-past")
    out = tmp_path / "llama.onnx"
    result = export(folder, out, task="causal-lm-with-past", exporter="torchscript", attn="eager")
    assert result.exporter == "torchscript" and result.attn == "eager" and result.fallback is None
    sess = runtime.make_session(out)
    rng = np.random.default_rng(0)
    feed = {"input_ids": np.array([[7]], dtype=np.int64), "attention_mask": np.ones((1, 6), dtype=np.int64)}
    for i in range(2):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)
    got = runtime.run(sess, [feed])[0]
    assert got["logits"].shape == (1, 1, 1000)
    assert got["present.0.key"].shape == (1, 2, 6, 16)


def make_module():
    """module:function source used by the tests: a tiny MLP-on-embeddings model."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)
            self.proj = torch.nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask):
            h = self.emb(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32)
            return {"logits": self.proj(h)}

    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 6))
    return Tiny(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_module_function_source(tmp_path, exporter):
    import onnx

    from graphopt.exporters import export

    out = tmp_path / "m.onnx"
    result = export(f"{__file__}:make_module", out, task="token-classification", exporter=exporter)
    assert result.parity.passed
    m = onnx.load(out)
    assert [i.name for i in m.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in m.graph.output] == ["logits"]
    assert [d.dim_param for d in m.graph.output[0].type.tensor_type.shape.dim][:2] == ["batch", "sequence"]


def make_branchy_module():
    """module:function source torch.export cannot capture (a branch on data); TorchScript traces one side."""
    import torch

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)

        def forward(self, input_ids, attention_mask):
            h = self.emb(input_ids)
            if bool((input_ids > 100).any()):  # never true for these ids
                h = h * 2
            return h * attention_mask.unsqueeze(-1).to(h.dtype)

    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 6))
    return Branchy(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_dynamo_failure_falls_back_to_torchscript(tmp_path):
    import onnx

    from graphopt.errors import ExportError
    from graphopt.exporters import export

    src = f"{__file__}:make_branchy_module"
    with pytest.raises(ExportError, match="the dynamo exporter failed"):
        export(src, tmp_path / "a.onnx", exporter="dynamo")
    assert not (tmp_path / "a.onnx").exists()
    result = export(src, tmp_path / "b.onnx")
    assert result.exporter == "torchscript" and result.fallback
    meta = {p.key: p.value for p in onnx.load(tmp_path / "b.onnx").metadata_props}
    assert meta["graphopt.exporter"] == "torchscript" and "graphopt.exporter_fallback" in meta


def test_fp16_export_uses_looser_default_tolerance(tiny, tmp_path):
    import onnx

    from graphopt.exporters import export

    out = tmp_path / "fp16.onnx"
    result = export(tiny.build_folder("bert", "feature-extraction"), out, dtype="fp16")
    assert result.parity.atol == 1e-2 and result.parity.passed
    assert result.parity.max_abs > 0  # fp16 rounding shows against the fp32 reference
    m = onnx.load(out)
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert {p.key: p.value for p in m.metadata_props}["graphopt.dtype"] == "fp16"


def test_torchscript_fp16_that_ort_rejects_is_an_export_error(tiny, tmp_path):
    """torch 2.13's TorchScript fp16 BERT mixes float/float16 in LayerNorm: a clear ExportError, no file."""
    from graphopt.errors import ExportError
    from graphopt.exporters import export

    out = tmp_path / "m.onnx"
    try:
        result = export(tiny.build_folder("bert", "feature-extraction"), out, dtype="fp16", exporter="torchscript")
    except ExportError as e:
        assert "does not load in ONNX Runtime" in e.message
        assert not out.exists()
    else:  # a torch that exports it well-typed
        assert result.parity.passed and out.exists()

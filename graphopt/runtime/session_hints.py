"""What a model needs from its ONNX Runtime session to run fast, recorded in the model's metadata.

The pipeline writes one metadata entry, ``graphopt.session``, on every model it returns: a JSON object
with the session settings the model was measured fastest under::

    {"execution_mode": "sequential", "graph_optimization_level": "all", "inter_op_threads": 1}

- ``graph_optimization_level``: ``all``. graphopt's CPU forms survive it (the residual norm as ``Sum`` +
  ``LayerNormalization``: ORT has no rule turning a ``Sum`` back into ``SkipLayerNormalization``); on
  the default and ``int8`` recipes' outputs basic, extended and all measured within noise of each other
  at 1 thread (``tools/bench_session_options.py``).
- ``execution_mode`` / ``inter_op_threads``: ``sequential`` with one inter-op thread. ``parallel``
  (ORT_PARALLEL) would run the independent length groups of a ``remove-padding`` graph side by side,
  but measured about 2x slower at 2 threads on both recipes' outputs (inter-op 2 with intra-op 1 or 2):
  the parallel executor schedules each of the ~1000 small nodes as a task. Should a graph ever measure
  faster in parallel, this is where it would say so.

``graphopt bench`` opens each model's sessions with these settings (the thread count stays the
command's); ``graphopt deploy`` writes them into the Triton configuration and the manifest. A model
without the entry (not optimized by graphopt, or stripped) gets ORT's defaults as graphopt uses them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import onnx
import onnx_ir as ir

logger = logging.getLogger(__name__)

KEY = "graphopt.session"
LEVELS = ("basic", "extended", "all")  # the levels a Triton onnxruntime configuration can state
EXECUTION_MODES = ("sequential", "parallel")
#: what every graphopt model is recorded to need today (see the module docstring for the measurements)
MEASURED = {"graph_optimization_level": "all", "execution_mode": "sequential", "inter_op_threads": 1}


def for_model(model: ir.Model) -> dict[str, Any]:
    """The session settings ``model`` runs fastest under (the same for every graph so far: measured)."""
    del model  # no graph has measured a different need yet
    return dict(MEASURED)


def record(model: ir.Model) -> dict[str, Any]:
    """Write :func:`for_model` into ``model``'s metadata (``graphopt.session``) and return it."""
    hints = for_model(model)
    model.metadata_props[KEY] = json.dumps(hints, sort_keys=True)
    return hints


def _check(hints: Any, where: str) -> dict[str, Any]:
    if not isinstance(hints, dict):
        raise ValueError(f"{where}: {KEY} is not a JSON object")
    out: dict[str, Any] = {}
    level = hints.get("graph_optimization_level")
    if level is not None:
        if level not in LEVELS:
            raise ValueError(f"{where}: graph_optimization_level {level!r} is not one of {', '.join(LEVELS)}")
        out["graph_optimization_level"] = level
    mode = hints.get("execution_mode")
    if mode is not None:
        if mode not in EXECUTION_MODES:
            raise ValueError(f"{where}: execution_mode {mode!r} is not one of {', '.join(EXECUTION_MODES)}")
        out["execution_mode"] = mode
    inter = hints.get("inter_op_threads")
    if inter is not None:
        if not isinstance(inter, int) or isinstance(inter, bool) or inter < 1:
            raise ValueError(f"{where}: inter_op_threads must be a positive integer, got {inter!r}")
        out["inter_op_threads"] = inter
    return out


def read(model: ir.Model | str | os.PathLike) -> dict[str, Any]:
    """The recorded settings of a model (object or path; a path is read without its weights), or ``{}``.

    An unreadable entry is logged and ignored (the model still runs under the defaults).
    """
    if isinstance(model, ir.Model):
        text, where = model.metadata_props.get(KEY), "model"
    else:

        proto = onnx.load(str(model), load_external_data=False)
        text = next((p.value for p in proto.metadata_props if p.key == KEY), None)
        where = str(model)
    if text is None:
        return {}
    try:
        return _check(json.loads(text), where)
    except (ValueError, json.JSONDecodeError) as e:
        logger.warning("ignoring the recorded session settings: %s", e)
        return {}


def session_kwargs(hints: dict[str, Any]) -> dict[str, Any]:
    """``runtime.make_session`` keyword arguments for recorded ``hints`` (thread count not included)."""
    kw: dict[str, Any] = {}
    if "graph_optimization_level" in hints:
        kw["level"] = hints["graph_optimization_level"]
    if "execution_mode" in hints:
        kw["execution_mode"] = hints["execution_mode"]
    if "inter_op_threads" in hints:
        kw["inter_op_threads"] = hints["inter_op_threads"]
    return kw

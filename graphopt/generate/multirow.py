"""Graphs whose multi-token forward is not the single-token one: speculative output may then differ.

ONNX Runtime's ``com.microsoft.MatMulNBits`` with ``accuracy_level`` 4 quantizes its input to int8 per block and
runs one kernel for a single row and another for several: a chunk of drafted tokens verified in one forward is
not computed as the same tokens fed one at a time, so speculative decoding's tokens may differ from plain
decoding's (rarely, where two logits are within rounding). The runtime says so (a logging warning, and
``SpeculativeGeneration.warning``); the tokens are still the model's own choices.
"""

from __future__ import annotations

import functools
import logging
import os

import onnx_ir as ir

from graphopt import io
from graphopt.runtime.ort_compat import model_path

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"


def int4_rows_differ(model: ir.Model) -> bool:
    """True when any graph of ``model`` has a MatMulNBits with accuracy_level 4."""
    graphs = [model.graph, *(f for f in model.functions.values())]
    for g in graphs:
        for node in ir.traversal.RecursiveGraphIterator(g) if isinstance(g, ir.Graph) else g:
            if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
                level = node.attributes.get("accuracy_level")
                if level is not None and level.as_int() == 4:
                    return True
    return False


def multirow_warning(decoder) -> str | None:
    """The warning for speculative decoding on ``decoder``'s graph (None: multi-token forwards are exact), logged.
    The graph is read once per file (and again when the file changes), not once per generation."""
    path = model_path(decoder.session)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    msg = _file_warning(str(path), st.st_mtime_ns, st.st_size)
    if msg is not None:
        logger.warning(msg)
    return msg


@functools.lru_cache(maxsize=16)
def _file_warning(path: str, mtime_ns: int, size: int) -> str | None:
    try:  # the weights stay in the file (only node attributes are read): no copy of a large model in memory
        model = io.load(path, in_place=True)
    except Exception:  # the session loaded it; an unreadable copy only loses the warning
        return None
    if not int4_rows_differ(model):
        return None
    return ("the graph has MatMulNBits accuracy_level 4, which computes a multi-token forward differently from "
            "single tokens: speculative output may differ from plain decoding")

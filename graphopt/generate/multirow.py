"""Graphs whose multi-token forward is not the single-token one: speculative output may then differ.

ONNX Runtime's CPU kernels take one path for a single row and another for several (``tools/check_multirow.py``:
forwards of 2-8 tokens compute a position bitwise alike, a one-token forward differs at the fifth decimal of a
logit). In float activations that has not changed a greedy token; ``com.microsoft.MatMulNBits`` with
``accuracy_level`` 4 re-quantizes each layer's input to int8, which turns the small difference into whole int8
steps (0.4-0.6 of a logit on SmolLM2's ``int4`` build): a chunk of drafted tokens verified in one forward is not
computed as the same tokens fed one at a time, so speculative decoding's tokens may differ from plain decoding's
where two logits are close. The runtime says so (a logging warning once per file, and
``SpeculativeGeneration.warning`` on every generation); the tokens are still the model's own choices.
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
    """The warning for speculative decoding on ``decoder``'s graph (None: multi-token forwards are exact). The graph
    is read, and the warning logged, once per file (and again when the file changes), not once per generation."""
    path = model_path(decoder.session)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _file_warning(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _file_warning(path: str, mtime_ns: int, size: int) -> str | None:
    try:  # the weights stay in the file (only node attributes are read): no copy of a large model in memory
        model = io.load(path, in_place=True)
    except Exception:  # the session loaded it; an unreadable copy only loses the warning
        return None
    if not int4_rows_differ(model):
        return None
    msg = ("the graph has MatMulNBits accuracy_level 4, which computes a multi-token forward differently from "
           "single tokens: speculative output may differ from plain decoding")
    logger.warning(msg)
    return msg

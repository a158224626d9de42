"""Memory planning for ``optimize``: estimate the peak before any work, choose the streaming paths,
and fail with one line instead of being killed by the kernel.

The estimate is a multiple of the model's weight bytes (the model file plus its external data
files), measured on random-weight Llama-style decoders of 0.1-2 B parameters (``models/big_decoder.py``,
``docs/benchmarks.md``): with the weights streamed (``graphopt.io.materialize`` hands the checker
and ONNX Runtime a model file beside its data, never an in-memory copy) the peak is about
``STREAMING_FACTOR[level]`` times the weights; through in-memory serialized copies (the path small
models take) about ``IN_MEMORY_FACTOR`` times. ``BASE_BYTES`` covers the interpreter and libraries.

The limit is ``--max-memory`` or, by default, the memory the system reports available
(``MemAvailable`` in ``/proc/meminfo``; no default limit where that file is missing).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import re
from pathlib import Path

import onnx

from graphopt import io
from graphopt.errors import UsageError

logger = logging.getLogger(__name__)

#: peak / weight bytes with the weights streamed, by verification level (measured, rounded up):
#: numeric: default recipe 1.02-1.16x from 0.4 B parameters on (one session at a time), the int8
#: recipe 1.05-1.24x from 0.4 B on, int4 (GPTQ) 1.92x at 0.1 B counting the interpreter; a self-contained 437 MB
#: BERT-base 1.74x (its weights read in place, ``graphopt.protoscan``)
STREAMING_FACTOR = {"numeric": 2.0, "structure": 1.3, "off": 1.3}
#: peak / weight bytes through in-memory serialized copies (measured 8.5-11x before streaming)
IN_MEMORY_FACTOR = 11.0
BASE_BYTES = 400 * 2**20

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """``"12G"``, ``"1500M"``, ``"2.5g"``, ``"800000000"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise UsageError(f"--max-memory {text!r}: not a size", hint="write e.g. 12G, 1500M or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def available() -> int | None:
    """Bytes the system reports available (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def weight_bytes(path: str | os.PathLike) -> int:
    """The model file's size plus the sizes of the external data files it refers to (read cheaply:
    only a small model file is parsed)."""
    path = Path(path)
    total = path.stat().st_size
    if total > 64 * 2**20:  # a large model file holds its weights itself
        return total
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX: io.load says so, in one line, when the model is loaded
        return total
    seen: set[Path] = set()
    for t in io._iter_tensor_protos(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), "")
            f = (path.parent / loc).resolve()
            if loc and f not in seen and f.is_file():
                seen.add(f)
                total += f.stat().st_size
    return total


def estimate(weights: int, level: str, *, streaming: bool) -> int:
    """Estimated peak bytes of ``optimize`` at verification ``level``."""
    factor = STREAMING_FACTOR.get(level, STREAMING_FACTOR['numeric']) if streaming else IN_MEMORY_FACTOR
    return int(weights * factor) + BASE_BYTES


def plan(path: str | os.PathLike, level: str, max_memory: int | None = None) -> bool:
    """Decide, before loading ``path``, whether ``optimize`` fits in ``max_memory`` (default: what the
    system has available) and whether it must stream the weights; returns whether it streams.

    Small models go through in-memory copies (faster) when that fits, otherwise every model streams
    (``graphopt.io.STREAM_BYTES`` is set to 0 for this process). Raises UsageError when even the
    streaming estimate exceeds the limit.
    """
    weights = weight_bytes(path)
    limit = max_memory if max_memory is not None else available()
    stream_anyway = weights >= io.STREAM_BYTES
    if limit is None:
        return stream_anyway
    if not stream_anyway and estimate(weights, level, streaming=False) > limit:
        io.STREAM_BYTES = 0
        stream_anyway = True
        logger.info("streaming the weights: the in-memory path would exceed %s", _gb(limit))
    need = estimate(weights, level, streaming=True)
    if need > limit:
        src = "--max-memory" if max_memory is not None else "memory available"
        lower = "" if level != "numeric" else f"; --verify structure needs about {_gb(estimate(weights, 'structure', streaming=True))}"
        raise UsageError(
            f"{path}: optimizing needs about {_gb(need)} ({_gb(weights)} of weights, --verify {level}) "
            f"but {src} is {_gb(limit)}",
            hint=f"free memory or raise --max-memory{lower}",
        )
    return stream_anyway


def trim() -> None:
    """Free what is unreachable now and hand the memory the C heap has freed back to the system.

    Models dropped by a caller (``onnx_ir`` graphs are reference cycles) are collected at once, not at
    the next collection; glibc's ``malloc_trim`` (nothing elsewhere) returns the freed heap: freed
    ONNX Runtime sessions and numpy temporaries otherwise stay resident, and the next session comes
    on top of them."""
    gc.collect()
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"

"""Feed folders: ``.npz`` files, each one feed (input name -> array), read in name order, written atomically;
and the checks and the one-line description of a list of feeds, whatever made it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from graphopt.errors import UsageError

Feed = dict[str, np.ndarray]


def load_dir(path: str | os.PathLike, limit: int | None = None) -> list[Feed]:
    """Read every ``*.npz`` in ``path`` (sorted by name) as one feed each."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"{p}: calibration folder not found", hint="--calib takes a folder of .npz files")
    files = sorted(p.glob("*.npz"))
    if not files:
        raise UsageError(f"{p}: no .npz feeds in the calibration folder", hint="make some with `graphopt feeds`")
    feeds = []
    for f in files[:limit]:
        try:
            with np.load(f, allow_pickle=False) as z:
                feeds.append({k: z[k] for k in z.files})
        except Exception as e:
            raise UsageError(f"{f}: not a readable .npz feed ({e})") from None
    return feeds


def save_dir(feeds: Sequence[Mapping[str, np.ndarray]], path: str | os.PathLike, prefix: str = "feed") -> Path:
    """Write feeds as ``PREFIX_00000.npz`` ... into ``path`` (created)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    width = max(5, len(str(len(feeds))))
    for i, feed in enumerate(feeds):
        tmp = p / f".{prefix}_{i:0{width}d}.npz.tmp"
        with open(tmp, "wb") as fh:
            np.savez(fh, **{k: np.asarray(v) for k, v in feed.items()})
        os.replace(tmp, p / f"{prefix}_{i:0{width}d}.npz")
    return p

def check_against(model: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]], source: str = "--calib") -> None:
    """Fail with a clear message when feeds lack a required model input or have the wrong rank."""
    required = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    for i, feed in enumerate(feeds):
        for v in required:
            if v.name not in feed:
                raise UsageError(f"{source}: feed {i} has no input {v.name!r}", hint=f"feed has {sorted(feed)}")
            if v.shape is not None and len(v.shape) != np.asarray(feed[v.name]).ndim:
                raise UsageError(
                    f"{source}: feed {i} input {v.name!r} has rank {np.asarray(feed[v.name]).ndim}, "
                    f"model expects {len(v.shape)}"
                )

def describe(feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
    if not feeds:
        return "no feeds"
    f = feeds[0]
    parts = [f"{k}{list(np.asarray(v).shape)}" for k, v in f.items()]
    return f"{len(feeds)} feeds, e.g. " + ", ".join(parts)

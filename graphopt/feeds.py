"""Verification feeds: loaded from a calibration folder or generated from the input signature.

A calibration folder holds ``.npz`` files, each one feed (input name -> array), read in name order.
Generated feeds respect what the graph says about its inputs: token ids stay below the vocabulary
size read from the embedding table they index, masks are ones (plus a right-padded batch of mixed
lengths), token types are zeros, position ids count up, and symbolic dimensions with the same name
get the same size.
"""

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


def split_feeds(feeds: Sequence[Mapping[str, np.ndarray]]) -> tuple[list, list]:
    """(calibration, held back): the first half calibrates, the rest is held back for checks.

    Fewer than two feeds cannot be split: the same feeds serve both (the same list object twice).
    """
    feeds = list(feeds)
    if len(feeds) < 2:
        return feeds, feeds
    k = len(feeds) // 2
    return feeds[:k], feeds[k:]


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


# ------------------------------------------------------------- generation



def _vocab_size(model: ir.Model, value: ir.Value) -> int | None:
    """Size of the table an integer input indexes through Gather (following Cast/Reshape/Unsqueeze)."""
    frontier = [value]
    seen = set()
    while frontier:
        v = frontier.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        for node, idx in v.uses():
            if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and idx == 1:
                data = node.inputs[0]
                if data is not None and data.shape is not None and len(data.shape) >= 1:
                    d0 = data.shape[0]
                    if isinstance(d0, int):
                        return d0
                if data is not None and data.const_value is not None:
                    return int(data.const_value.shape[0])
            elif node.op_type in ("EmbedLayerNormalization",) and idx in (0, 1):
                tbl = node.inputs[2 if idx == 0 else 4]
                if tbl is not None and tbl.shape is not None and isinstance(tbl.shape[0], int):
                    return tbl.shape[0]
            elif node.op_type in ("Gather", "Compress", "Slice") and idx == 0 and node.outputs:
                frontier.extend(node.outputs)  # selected ids are still ids (e.g. remove-padding's packing)
            elif node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Add") and node.outputs:
                frontier.extend(node.outputs)
    return None


def _dim_value(dim, sizes: dict[str, int], defaults: dict[str, int]) -> int:
    if isinstance(dim, int):
        return dim
    name = str(dim.value) if dim is not None and getattr(dim, "value", None) is not None else ""
    if not name:
        return 1
    if name in sizes:
        return sizes[name]
    # simple sums of known symbols, e.g. "past_sequence_length + 1" or "s1 + s2"
    if "+" in name:
        parts = [p.strip() for p in name.split("+")]
        total = 0
        for p in parts:
            if p.isdigit():
                total += int(p)
            else:
                total += _dim_value(ir.SymbolicDim(p), sizes, defaults)
        sizes[name] = total
        return total
    low = name.lower()
    if "past" in low:
        val = defaults["past"]
    elif "batch" in low or low in ("n", "b"):
        val = defaults["batch"]
    elif "seq" in low or "len" in low or "token" in low:
        val = defaults["seq"]
    else:
        val = defaults.get("other", 4)
    sizes[name] = val
    return val


def generate(
    model: ir.Model,
    *,
    count: int = 2,
    batch: int = 2,
    seq: int = 16,
    past: int = 8,
    seed: int = 0,
    padded: bool = True,
) -> list[Feed]:
    """Feeds for every non-initializer graph input.

    The first ``count`` feeds have full masks; with ``padded`` and a mask input, one more feed has
    right padding with mixed lengths (every row keeps at least one real token).
    """
    rng = np.random.default_rng(seed)
    inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    feeds = []
    n_total = count + (1 if padded and any(_is_mask(v.name) for v in inputs) else 0)
    for k in range(n_total):
        sizes: dict[str, int] = {}
        defaults = {"batch": batch + (1 if k == count else 0), "seq": seq, "past": past, "other": 4}
        # fix the sequence-like dims of ids first so masks that span past+seq line up
        feed: Feed = {}
        for v in inputs:
            shape = [] if v.shape is None else [_dim_value(d, sizes, defaults) for d in v.shape]
            feed[v.name] = _make(model, v, shape, rng, sizes)
        if k == count:
            _apply_padding(feed, rng)
        feeds.append(feed)
    return feeds


def _is_mask(name: str) -> bool:
    low = name.lower()
    return "mask" in low


def _make(model: ir.Model, v: ir.Value, shape: list[int], rng: np.random.Generator, sizes) -> np.ndarray:
    dtype = v.dtype.numpy() if v.dtype is not None else np.dtype(np.float32)
    name = v.name.lower()
    if dtype.kind == "b":
        if _is_mask(name):
            return np.ones(shape, dtype=bool)
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        if _is_mask(name):
            return np.ones(shape, dtype=dtype)
        if "token_type" in name or "segment" in name:
            return np.zeros(shape, dtype=dtype)
        if "position" in name and shape:
            return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
        vocab = _vocab_size(model, v)
        high = vocab if vocab else 2
        low = min(1, high - 1) if vocab and "ids" in name else 0
        return rng.integers(low, high, size=shape).astype(dtype)
    if dtype.kind == "f" or dtype.kind == "V":
        if _is_mask(name):
            return np.ones(shape, dtype=dtype)
        return rng.standard_normal(size=shape).astype(dtype)
    if dtype.kind in "US":
        return np.full(shape, "a", dtype=object)
    return np.zeros(shape, dtype=dtype)


def _apply_padding(feed: Feed, rng: np.random.Generator) -> None:
    masks = [k for k in feed if _is_mask(k) and feed[k].ndim == 2]
    if not masks:
        return
    b, s = feed[masks[0]].shape
    lengths = np.linspace(s, max(1, s // 4), num=b).astype(int)
    for k in masks:
        m = feed[k]
        if m.shape != (b, s):
            continue
        new = np.zeros_like(m)
        for i, n in enumerate(lengths):
            new[i, :n] = 1
        feed[k] = new
    for k, arr in feed.items():
        if k in masks or arr.ndim != 2 or arr.shape != (b, s) or arr.dtype.kind not in "iu":
            continue
        if "ids" in k.lower() and "position" not in k.lower() and "type" not in k.lower():
            for i, n in enumerate(lengths):
                arr[i, n:] = 0  # pad token id 0


def describe(feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
    if not feeds:
        return "no feeds"
    f = feeds[0]
    parts = [f"{k}{list(np.asarray(v).shape)}" for k, v in f.items()]
    return f"{len(feeds)} feeds, e.g. " + ", ".join(parts)



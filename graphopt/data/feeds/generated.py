"""Feeds generated from a model's input signature.

Generated feeds respect what the graph says about its inputs: token ids stay below the vocabulary
size read from the embedding table they index, masks are ones (plus a right-padded batch of mixed
lengths), token types are zeros, position ids count up, and symbolic dimensions with the same name
get the same size. Dims written as ``-1``, ``0`` or nothing are symbols of their own (``INPUT:AXIS``).
Integer inputs that are shapes or positions get values that fit the tensor they apply to.
``shapes`` / ``values`` (``--input-shape NAME:D1,D2,...``, ``--input-value NAME=V``, checked by
``check_overrides``) fix an input's shape or value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.data.feeds import hints as feed_hints
from graphopt.data.feeds.folder import Feed
from graphopt.errors import UsageError


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


def dim_symbol(v: ir.Value, axis: int, dim) -> str | None:
    """The symbol a dim stands for: its name, ``INPUT:AXIS`` for ``-1``/``0``/unnamed dims, None when fixed."""
    if isinstance(dim, int):
        return None if dim > 0 else f"{v.name}:{axis}"
    name = str(dim.value) if dim is not None and getattr(dim, "value", None) is not None else ""
    return name or f"{v.name}:{axis}"


def _dim_value(dim, sizes: dict[str, int], defaults: dict[str, int], key: str = "") -> int:
    if isinstance(dim, int) and dim > 0:
        return dim
    name = str(dim.value) if dim is not None and getattr(dim, "value", None) is not None else ""
    if not name or isinstance(dim, int):  # -1, 0 or unnamed: a symbol of its own, 1 unless chosen
        return sizes.get(key, 1) if key else 1
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


def _shape_of(v: ir.Value, sizes: dict[str, int], defaults: dict[str, int]) -> list[int]:
    if v.shape is None:
        return []
    out = []
    for axis, d in enumerate(v.shape):
        key = dim_symbol(v, axis, d) or ""
        out.append(_dim_value(d, sizes, defaults, key))
    return out



def generate(
    model: ir.Model,
    *,
    count: int = 2,
    batch: int = 2,
    seq: int = 16,
    past: int = 8,
    seed: int = 0,
    padded: bool = True,
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> list[Feed]:
    """Feeds for every non-initializer graph input.

    The first ``count`` feeds have full masks; with ``padded`` and a mask input, one more feed has
    right padding with mixed lengths (every row keeps at least one real token). A decoder with past and
    no ``position_ids`` gets the three steps of ``_decoder_steps`` instead (full masks, no padded feed). ``shapes`` and
    ``values`` fix an input's shape or value (``--input-shape`` / ``--input-value``); ``sizes``
    fixes symbolic dims by symbol (a dim name, or ``INPUT:AXIS`` for a ``-1``/``0``/unnamed dim).
    Integer inputs that are shapes or positions get values that fit the tensor they apply to.
    Use ``runnable`` to get feeds confirmed by running the model.
    """
    rng = np.random.default_rng(seed)
    shapes = dict(shapes or {})
    values = dict(values or {})
    inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    roles = {v.name: _role(v) for v in inputs}
    # inputs whose value depends on another tensor's shape are made after the others
    order = [v for v in inputs if roles[v.name] is None or roles[v.name].kind not in _DEPENDENT]
    order += [v for v in inputs if v not in order]
    feeds = []
    n_total = count + (1 if padded and any(_is_mask(v.name) for v in inputs) else 0)
    steps = _decoder_steps(inputs, batch, seq, past)
    if steps:
        n_total = count = len(steps)
    for k in range(n_total):
        sz: dict[str, int] = dict(sizes or {})
        for v in inputs:  # a user's shape binds the symbols of that input for every input
            if v.name in shapes and v.shape is not None:
                for axis, d in enumerate(v.shape):
                    key = dim_symbol(v, axis, d)
                    if key is not None and "+" not in key:
                        sz[key] = int(shapes[v.name][axis])
        defaults = {"batch": batch + (1 if k == count else 0), "seq": seq, "past": past, "other": 4}
        if steps:
            defaults = {**steps[k], "other": 4}
        feed: Feed = {}
        for v in order:
            if v.name in values:
                feed[v.name] = _fit_value(v, values[v.name], shapes.get(v.name), sz, defaults)
                continue
            shape = list(shapes[v.name]) if v.name in shapes else _shape_of(v, sz, defaults)
            feed[v.name] = _make(model, v, shape, rng, sz, role=roles[v.name], feed=feed)
        feed = {v.name: feed[v.name] for v in inputs}
        if k == count:
            _apply_padding(feed, rng)
        feeds.append(feed)
    return feeds



_DEPENDENT = frozenset({"ones", "reshape", "split"})


def _decoder_steps(inputs: Sequence[ir.Value], batch: int, seq: int, past: int) -> list[dict[str, int]]:
    """For a decoder with past whose positions come from the past length (``past_key_values.*`` and
    ``attention_mask`` inputs, no ``position_ids``): the steps its runtime runs, under the contract such a
    graph may be given (``group-query-attention``: masks are prefixes of ones, each row's positions start
    at 0, a step of several tokens after a past has one row): a prefill of ``batch`` rows, a one-token
    decode step of ``batch`` rows after ``past``, and a ``seq``-token step of one row after ``past``, all
    with full masks (``probe.runnable`` then gives each past the model's own presents of a prefill). Empty for
    any other graph."""
    names = {v.name for v in inputs}
    if "attention_mask" not in names or "position_ids" in names or not any(
            n.startswith("past_key_values.") for n in names):
        return []
    return [{"batch": batch, "seq": seq, "past": 0}, {"batch": batch, "seq": 1, "past": past},
            {"batch": 1, "seq": seq, "past": past}]


def _role(v: ir.Value) -> feed_hints.Role | None:
    if v.dtype is None or v.dtype.numpy().kind not in "iu":
        return None
    return feed_hints.role(v)


def _is_mask(name: str) -> bool:
    low = name.lower()
    return "mask" in low


def _fit_value(v: ir.Value, given, shape, sizes, defaults) -> np.ndarray:
    """A user's ``--input-value`` as an array of the input's dtype and rank."""
    dtype = v.dtype.numpy() if v.dtype is not None else np.dtype(np.float32)
    arr = np.asarray(given)
    rank = len(v.shape) if v.shape is not None else arr.ndim
    if shape is None and arr.size > 1 and rank == 1:
        shape = [arr.size]
    if shape is None:
        shape = _shape_of(v, sizes, defaults) if v.shape is not None else list(arr.shape)
    if arr.size == 1:
        return np.full(shape, arr.reshape(-1)[0]).astype(dtype)
    if int(np.prod(shape)) != arr.size:
        raise UsageError(f"--input-value {v.name}: {arr.size} values do not fill shape {list(shape)}",
                         hint=f"give one value, or --input-shape {v.name}:... with {arr.size} elements")
    return arr.reshape(shape).astype(dtype)


def _data_shape(data: ir.Value | None, feed: Feed) -> list[int] | None:
    if data is None:
        return None
    if data.name in feed:
        return list(np.asarray(feed[data.name]).shape)
    if data.shape is not None and all(isinstance(d, int) and d >= 0 for d in data.shape):
        return [int(d) for d in data.shape]
    if data.const_value is not None:
        return list(data.const_value.shape)
    return None


def _by_role(v: ir.Value, role: feed_hints.Role, shape: list[int], dtype: np.dtype, feed: Feed) -> np.ndarray:
    data_shape = _data_shape(role.data, feed)
    free_length = v.shape is not None and len(v.shape) == 1 and dim_symbol(v, 0, v.shape[0]) is not None
    if free_length and data_shape is not None and role.data is not None and role.kind in ("ones", "reshape"):
        shape = [len(data_shape)]  # a shape vector as long as the data's rank
    n = int(np.prod(shape)) if shape else 1
    if role.kind == "ones":
        return np.ones(shape, dtype=dtype)
    if role.kind == "big":
        return np.full(shape, np.iinfo(dtype).max, dtype=dtype)
    if role.kind == "arange":
        return np.arange(n, dtype=dtype).reshape(shape)
    if role.kind == "reshape":
        if data_shape is not None and len(data_shape) == n:
            return np.array(data_shape, dtype=dtype).reshape(shape)
        return np.array([1] * (n - 1) + [-1], dtype=dtype).reshape(shape) if n else np.zeros(shape, dtype=dtype)
    if role.kind == "split":
        total = data_shape[role.axis] if data_shape is not None and len(data_shape) > role.axis else n
        return feed_hints.split_parts(total, n).astype(dtype).reshape(shape)
    return np.zeros(shape, dtype=dtype)


def _make(model: ir.Model, v: ir.Value, shape: list[int], rng: np.random.Generator, sizes,
          role: feed_hints.Role | None = None, feed: Feed | None = None) -> np.ndarray:
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
        if not vocab and role is not None:
            return _by_role(v, role, shape, dtype, feed or {})
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



def check_overrides(model: ir.Model, shapes: Mapping[str, Sequence[int]] | None,
                    values: Mapping[str, np.ndarray] | None) -> None:
    """Unknown input names and shapes that contradict the model's fixed dims are usage errors."""
    inputs = {v.name: v for v in model.graph.inputs if v.name not in model.graph.initializers}
    for flag, given in (("--input-shape", shapes or {}), ("--input-value", values or {})):
        for name in given:
            if name not in inputs:
                raise UsageError(f"{flag}: the model has no input {name!r}",
                                 hint="its inputs: " + ", ".join(inputs) if inputs else "it has no inputs")
    for name, shape in (shapes or {}).items():
        v = inputs[name]
        if v.shape is None:
            continue
        if len(shape) != len(v.shape):
            raise UsageError(f"--input-shape {name}: {len(shape)} dims given, the input has rank {len(v.shape)}",
                             hint=f"its shape: {_show_shape(v)}")
        for axis, (d, want) in enumerate(zip(v.shape, shape)):
            if isinstance(d, int) and d > 0 and d != want:
                raise UsageError(f"--input-shape {name}: dim {axis} is fixed to {d} in the model, {want} given",
                                 hint=f"its shape: {_show_shape(v)}")


def _show_shape(v: ir.Value) -> str:
    if v.shape is None:
        return "unknown"
    return "[" + ", ".join(str(d) if isinstance(d, int) else str(d.value or "?") for d in v.shape) + "]"

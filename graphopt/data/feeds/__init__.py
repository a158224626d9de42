"""Verification feeds: loaded from a calibration folder or generated from the input signature.

A calibration folder holds ``.npz`` files, each one feed (input name -> array), read in name order.
Generated feeds respect what the graph says about its inputs: token ids stay below the vocabulary
size read from the embedding table they index, masks are ones (plus a right-padded batch of mixed
lengths), token types are zeros, position ids count up, and symbolic dimensions with the same name
get the same size. Dims written as ``-1``, ``0`` or nothing are symbols of their own (``INPUT:AXIS``).
Integer inputs that are shapes or positions get values that fit the tensor they apply to.

``runnable`` confirms generated feeds by running the model, trying a short ladder of candidates
(the defaults first, then sizes and scalar values read from the graph by ``graphopt.data.feeds.hints``);
``--input-shape NAME:D1,D2,...`` and ``--input-value NAME=V`` (``parse_input_shapes``,
``parse_input_values``, checked by ``check_overrides``) fix an input's shape or value.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from graphopt.data.feeds import hints as feed_hints
from graphopt.errors import GraphoptError, UsageError, first_line

logger = logging.getLogger(__name__)

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


def _symbol(v: ir.Value, axis: int, dim) -> str | None:
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
        key = _symbol(v, axis, d) or ""
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
    right padding with mixed lengths (every row keeps at least one real token). ``shapes`` and
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
    for k in range(n_total):
        sz: dict[str, int] = dict(sizes or {})
        for v in inputs:  # a user's shape binds the symbols of that input for every input
            if v.name in shapes and v.shape is not None:
                for axis, d in enumerate(v.shape):
                    key = _symbol(v, axis, d)
                    if key is not None and "+" not in key:
                        sz[key] = int(shapes[v.name][axis])
        defaults = {"batch": batch + (1 if k == count else 0), "seq": seq, "past": past, "other": 4}
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


def for_model(model: ir.Model, calib: str | os.PathLike | None = None, **generate_options) -> list[Feed]:
    """Feeds for ``model``: the ``calib`` folder's, checked against its inputs, or (without one)
    generated from its signature (``generate_options`` go to :func:`generate`)."""
    if calib is None:
        return generate(model, **generate_options)
    feeds = load_dir(calib)
    check_against(model, feeds)
    return feeds


_DEPENDENT = frozenset({"ones", "reshape", "split"})


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
    free_length = v.shape is not None and len(v.shape) == 1 and _symbol(v, 0, v.shape[0]) is not None
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


def describe(feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
    if not feeds:
        return "no feeds"
    f = feeds[0]
    parts = [f"{k}{list(np.asarray(v).shape)}" for k, v in f.items()]
    return f"{len(feeds)} feeds, e.g. " + ", ".join(parts)



# ------------------------------------------------------------- overrides


def parse_input_shapes(specs: Sequence[str] | None) -> dict[str, list[int]]:
    """``NAME:1,3,320,320`` (repeatable; brackets allowed, ``NAME:`` for a scalar) -> {name: dims}."""
    out: dict[str, list[int]] = {}
    for spec in specs or ():
        name, sep, dims = str(spec).rpartition(":")
        dims = dims.strip().strip("[]").strip()
        usage = "expected NAME:D1,D2,... such as images:1,3,320,320"
        if not sep or not name:
            raise UsageError(f"--input-shape {spec!r}: no input name", hint=usage)
        try:
            shape = [int(d) for d in dims.replace("x", ",").split(",")] if dims else []
        except ValueError:
            raise UsageError(f"--input-shape {spec!r}: dims must be integers", hint=usage) from None
        if any(d < 0 for d in shape):
            raise UsageError(f"--input-shape {spec!r}: dims must be non-negative", hint=usage)
        if name in out:
            raise UsageError(f"--input-shape {name!r} given twice")
        out[name] = shape
    return out


def parse_input_values(specs: Sequence[str] | None) -> dict[str, np.ndarray]:
    """``NAME=16000`` or ``NAME=1,2,3`` (repeatable) -> {name: array} (int unless a value has a point)."""
    out: dict[str, np.ndarray] = {}
    for spec in specs or ():
        name, sep, text = str(spec).partition("=")
        usage = "expected NAME=VALUE or NAME=V1,V2,... such as sr=16000"
        name, text = name.strip(), text.strip().strip("[]").strip()
        if not sep or not name or not text:
            raise UsageError(f"--input-value {spec!r}: {'no input name' if not name else 'no value'}", hint=usage)
        items = [t.strip() for t in text.split(",")]
        try:
            nums = [int(t) for t in items]
        except ValueError:
            try:
                nums = [float(t) for t in items]
            except ValueError:
                raise UsageError(f"--input-value {spec!r}: values must be numbers", hint=usage) from None
        if name in out:
            raise UsageError(f"--input-value {name!r} given twice")
        out[name] = np.array(nums[0] if len(nums) == 1 else nums)
    return out


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


# ------------------------------------------------------------- feeds that run


class NoRunnableFeeds(GraphoptError):
    """No generated feed makes the model run; ``reason`` says what ORT answered the first one."""

    def __init__(self, message: str, *, reason: str, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.reason = reason


def _ladders(model: ir.Model, inputs: list[ir.Value], skip: set[str]) -> dict[str, tuple[str, list[int]]]:
    """symbol -> (group, alternative sizes to try after the default).

    Group "spatial": image and signal extents of inputs that reach a convolution, pooling, resize
    or pad (multiples of the chain's stride, typical image sizes, audio frame sizes); group "other":
    batch-like dims (1) and the rest (graph constants, then 16 and 64).
    """
    ladders: dict[str, tuple[str, list[int]]] = {}
    for v in inputs:
        if v.shape is None or v.name in skip:
            continue
        keys = {axis: _symbol(v, axis, d) for axis, d in enumerate(v.shape)}
        keys = {a: k for a, k in keys.items() if k is not None and "+" not in k}
        if not keys:
            continue
        hints = feed_hints.dim_sizes(v)
        spatial = feed_hints.spatial_axes(v)
        stride = feed_hints.spatial_stride(model, v) if any(a in keys for a in spatial) else 0
        if not stride:  # no convolution, pooling, resize or pad downstream: not an image or a signal
            spatial = []
        for axis, key in keys.items():
            group = "spatial" if axis in spatial else "other"
            lad = ladders.setdefault(key, (group, []))[1]
            if isinstance(v.shape[axis], int) and v.shape[axis] == 0:
                lad.append(0)  # ONNX Runtime holds a dim written as 0 to 0
            lad.extend(hints.get(axis, []))
            low = key.lower()
            if axis in spatial and len(v.shape) == 2:
                lad.extend(feed_hints.AUDIO_SIZES)
            elif axis in spatial:
                lad.extend(feed_hints.round_up(s, stride) for s in ((2 * stride,) if stride > 1 else ()) + feed_hints.IMAGE_SIZES)
            elif "batch" in low or low in ("n", "b") or (axis == 0 and ":" in key):
                lad.append(1)
            else:
                lad.extend((16, 64))
    return {k: (g, list(dict.fromkeys(v))) for k, (g, v) in ladders.items()}


def _candidates(model: ir.Model, shapes, values, max_tries: int):
    """(sizes, values) to try in order: the defaults first, then graph-informed alternatives, the
    spatial dims, the other dims and the scalar values stepping along their ladders in turn."""
    import itertools

    inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    ladders = _ladders(model, inputs, skip=set(shapes) | set(values))
    scalars: dict[str, list] = {}
    for v in inputs:
        if v.name in values or v.dtype is None or v.dtype.numpy().kind not in "iu":
            continue
        if v.shape is not None and (len(v.shape) == 0 or (len(v.shape) == 1 and v.shape[0] == 1)):
            seen = feed_hints.compared_values(v)
            if seen:
                scalars[v.name] = [*seen, None]  # None: the default value
    spans = [1 + max((len(lad) for g, lad in ladders.values() if g == grp), default=0) for grp in ("spatial", "other")]
    spans.append(max((len(x) for x in scalars.values()), default=1))
    steps = sorted(itertools.product(*(range(n) for n in spans)), key=lambda t: (sum(t), t))
    seen_sigs = set()
    for a, b, j in steps:
        sizes = {}
        for key, (group, lad) in ladders.items():
            i = a if group == "spatial" else b
            if i and lad:
                sizes[key] = lad[min(i - 1, len(lad) - 1)]
        vals = dict(values)
        for name, lad in scalars.items():
            if lad[min(j, len(lad) - 1)] is not None:
                vals[name] = np.array(lad[min(j, len(lad) - 1)])
        sig = (tuple(sorted(sizes.items())), tuple(sorted((k, int(np.asarray(x).reshape(-1)[0])) for k, x in vals.items()
                                                          if np.asarray(x).size == 1)))
        if sig in seen_sigs:
            continue
        seen_sigs.add(sig)
        yield sizes, vals
        if len(seen_sigs) >= max_tries:
            return


def runnable(
    model: ir.Model,
    *,
    run=None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
    max_tries: int = 10,
    **kwargs,
) -> tuple[list[Feed], list[dict[str, np.ndarray]]]:
    """Generated feeds that make ``model`` run, and its outputs on them.

    Candidates are tried in order (``generate``'s defaults first, then sizes and values read from
    the graph: see ``graphopt.data.feeds.hints``), at most ``max_tries``; the first one that runs wins.
    ``run`` maps a list of feeds to outputs (default: an ORT CPU session made once). ``kwargs``
    go to ``generate``. Raises NoRunnableFeeds when none runs, RuntimeSetupError when the model
    cannot be loaded at all.
    """
    shapes = dict(shapes or {})
    values = dict(values or {})
    base_sizes = dict(kwargs.pop("sizes", None) or {})
    check_overrides(model, shapes, values)
    if run is None:
        run = _session_runner(model)
    first_error = ""
    tried = []
    for sizes, vals in _candidates(model, shapes, values, max_tries):
        try:
            feeds = generate(model, shapes=shapes, values=vals, sizes={**base_sizes, **sizes}, **kwargs)
        except UsageError:
            raise
        except Exception as e:  # a candidate the generator cannot fill (e.g. a reshape it cannot size)
            first_error = first_error or f"{type(e).__name__}: {e}"
            continue
        tried.append(describe(feeds[:1]).split("e.g. ", 1)[-1])
        try:
            outs = run(feeds)
        except Exception as e:
            msg = getattr(e, "message", None) or first_line(e)
            first_error = first_error or msg
            logger.info("feeds %s do not run the model: %s", tried[-1], msg)
            continue
        if len(tried) > 1:
            logger.info("feeds that run the model: %s (candidate %d)", tried[-1], len(tried))
        return feeds, outs
    reason = f"no generated feed runs the model ({len(tried)} tried, first {tried[0] if tried else '-'}): {first_error}"
    raise NoRunnableFeeds(reason, reason=reason,
                          hint="give input sizes and values with --input-shape NAME:D1,D2,... / --input-value "
                               "NAME=V, or real feeds with --calib")


def _session_runner(model: ir.Model):
    from graphopt.engine.verify import runnable as cpu_runnable
    from graphopt.errors import RuntimeSetupError
    from graphopt.runtime import session as runtime

    try:
        run_as, _ = cpu_runnable(model)
    except ValueError as e:
        raise RuntimeSetupError(f"cannot run the model on CPU: {e}") from None
    sess = runtime.make_session(run_as, provider="cpu", optimize=False)
    return lambda feeds: runtime.run(sess, feeds)


def calibration_feeds(model: ir.Model, calib_feeds: Sequence[Feed], held_feeds: Sequence[Feed],
                      purpose: str = "calibrating") -> tuple[list[Feed], list[Feed], str | None]:
    """The feeds a lossy pass calibrates on and the ones it confirms on (a pass's ``ctx.calib_feeds``
    and ``ctx.feeds``), each falling back to the other; generated from ``model`` when none were
    given, with a note saying so (else None)."""
    calib = list(calib_feeds) or list(held_feeds)
    held = list(held_feeds) or calib
    if calib:
        return calib, held, None
    calib = held = generate(model)
    return calib, held, f"no feeds given: {purpose} on generated feeds (give --calib for real data)"

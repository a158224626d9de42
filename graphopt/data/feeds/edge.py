"""Edge feeds: inputs at the corners of what a model accepts, for verifying lossless passes.

Random feeds never come near an epsilon guard (``Log(x*x + 1e-10)``), a variance of zero or an
overflowing ``Exp``; a rewrite that changes the model there passes a check on random inputs. Edge
feeds are variants of the first generated feed, one kind of corner each (its label):

- float inputs (not masks): ``zeros`` (silence), ``ones`` (a constant: variance 0), ``tiny``
  (random values scaled to :data:`TINY` for the dtype: squares underflow to 0), ``huge`` (scaled to
  :data:`HUGE`: exponentials overflow), ``one-hot`` (one 1 per vector along the last axis);
- token ids (integer inputs that index an embedding table): ``ids 0`` and ``ids max`` (vocabulary - 1);
- attention masks: ``mask one token`` (one real token per row, the rest padding);
- sequence dims (symbolic dims named like a length or a sample count, or axis 1 of ``[batch, seq]`` id and mask inputs):
  ``length 1`` and ``length N``, the longest the graph suggests (the largest position table it
  indexes, at most :data:`MAX_LENGTH`; else 4x the generated length) at batch 1.

Only candidates: ``graphopt.data.feeds.select`` keeps those the input model runs (a feed it refuses,
such as a length its convolutions cannot take, is dropped). Outputs that are NaN or Inf in the
reference on an edge feed are legitimate; a candidate only fails on new ones. They never feed the
calibration of lossy passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.data.feeds import generated
from graphopt.data.feeds.folder import Feed

#: scale of ``tiny`` float feeds per dtype: squares underflow to zero (float16: its subnormal range)
TINY = {"float16": 1e-6, "float32": 1e-30, "float64": 1e-30}
#: scale of ``huge`` float feeds per dtype: far beyond any normalized activation, squares and sums of
#: squares still finite, exponentials overflow
HUGE = {"float16": 1e2, "float32": 1e4, "float64": 1e4}
#: the longest sequence an edge feed has (a position table of 512 rows gives 256: one such run of
#: MiniLM costs about twice the three generated feeds together)
MAX_LENGTH = 256
_LENGTH_WORDS = ("seq", "len", "token", "time", "frame", "step", "word", "sample")


def _float_inputs(inputs: Sequence[ir.Value], base: Feed, fixed: set[str]) -> list[str]:
    return [v.name for v in inputs if v.name not in fixed and v.name in base
            and np.asarray(base[v.name]).dtype.kind == "f" and not generated._is_mask(v.name)]


def _id_inputs(model: ir.Model, inputs: Sequence[ir.Value], base: Feed, fixed: set[str]) -> dict[str, int]:
    out = {}
    for v in inputs:
        if v.name in fixed or v.name not in base or np.asarray(base[v.name]).dtype.kind not in "iu":
            continue
        low = v.name.lower()
        if generated._is_mask(low) or "position" in low or "type" in low or "segment" in low:
            continue
        vocab = generated._vocab_size(model, v)
        if vocab and vocab > 1:
            out[v.name] = vocab
    return out


def _masks(base: Feed, fixed: set[str]) -> list[str]:
    return [k for k, a in base.items() if k not in fixed and generated._is_mask(k) and np.asarray(a).ndim == 2]


def _length_symbols(inputs: Sequence[ir.Value], ids: Mapping[str, int], masks: Sequence[str]) -> set[str]:
    """Symbols of dims that are sequence lengths (named like one, or axis 1 of a [batch, seq] id/mask input)."""
    out = set()
    for v in inputs:
        if v.shape is None:
            continue
        for axis, d in enumerate(v.shape):
            key = generated.dim_symbol(v, axis, d)
            if key is None or "+" in key:
                continue
            low = key.lower()
            if "past" in low or "total" in low or "batch" in low:
                continue
            named = ":" not in key and any(w in low for w in _LENGTH_WORDS)
            if named or (axis == 1 and len(v.shape) == 2 and (v.name in ids or v.name in masks)):
                out.add(key)
    return out


def _batch_symbols(inputs: Sequence[ir.Value]) -> set[str]:
    out = set()
    for v in inputs:
        if v.shape is None or not len(v.shape):
            continue
        key = generated.dim_symbol(v, 0, v.shape[0])
        if key is not None and ("batch" in key.lower() or key.lower() in ("n", "b") or key.endswith(":0")):
            out.add(key)
    return out


def position_table(model: ir.Model, vocab_sizes: Sequence[int]) -> int | None:
    """The largest constant table (16+ rows, not a vocabulary) the graph gathers rows of: the positions it knows."""
    best = None
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        data = node.inputs[0]
        if data is None or data.const_value is None or len(data.const_value.shape) != 2:
            continue
        rows = int(data.const_value.shape[0])
        if rows >= 16 and rows not in vocab_sizes and (best is None or rows > best):
            best = rows
    return best


def _sizes_of(inputs: Sequence[ir.Value], feed: Feed) -> dict[str, int]:
    """The symbol sizes ``feed`` was generated with, read back from its arrays."""
    sizes: dict[str, int] = {}
    for v in inputs:
        if v.shape is None or v.name not in feed or np.asarray(feed[v.name]).ndim != len(v.shape):
            continue
        for axis, d in enumerate(v.shape):
            key = generated.dim_symbol(v, axis, d)
            if key is not None and "+" not in key:
                sizes.setdefault(key, int(np.asarray(feed[v.name]).shape[axis]))
    return sizes


def candidates(
    model: ir.Model,
    base: Feed,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
    seed: int = 1,
) -> list[tuple[str, Feed]]:
    """(label, feed) edge candidates derived from ``base`` (a generated feed that runs ``model``).

    Inputs fixed by ``values`` (``--input-value``) keep their value; dims fixed by ``shapes``
    (``--input-shape``) keep their size. Candidates equal to ``base`` are left out.
    """
    rng = np.random.default_rng(seed)
    shapes, values = dict(shapes or {}), dict(values or {})
    inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    fixed = set(values)
    out: list[tuple[str, Feed]] = []

    def variant(label: str, changes: Mapping[str, np.ndarray]) -> None:
        feed = {k: (changes[k] if k in changes else np.array(a, copy=True)) for k, a in base.items()}
        if any(not np.array_equal(feed[k], base[k]) for k in changes):
            out.append((label, feed))

    floats = _float_inputs(inputs, base, fixed)
    if floats:
        arrs = {k: np.asarray(base[k]) for k in floats}
        variant("zeros", {k: np.zeros_like(a) for k, a in arrs.items()})
        variant("ones", {k: np.ones_like(a) for k, a in arrs.items()})
        for label, table in (("tiny", TINY), ("huge", HUGE)):
            variant(label, {k: (rng.standard_normal(a.shape) * table.get(a.dtype.name, 1.0)).astype(a.dtype)
                            for k, a in arrs.items()})
        hot = {}
        for k, a in arrs.items():
            if a.ndim >= 1 and a.shape[-1] > 1:
                h = np.zeros(a.shape, a.dtype)
                idx = rng.integers(0, a.shape[-1], size=a.shape[:-1])
                np.put_along_axis(h, idx[..., None], 1, axis=-1)
                hot[k] = h
        if hot:
            variant("one-hot", hot)
    ids = _id_inputs(model, inputs, base, fixed)
    if ids:
        variant("ids 0", {k: np.zeros_like(base[k]) for k in ids})
        variant("ids max", {k: np.full_like(base[k], vocab - 1) for k, vocab in ids.items()})
    masks = _masks(base, fixed)
    if masks:
        changes = {}
        for k in masks:
            m = np.zeros_like(base[k])
            m[:, :1] = 1
            changes[k] = m
            for name in ids:  # padding after the one real token: pad id 0
                if np.asarray(base[name]).shape == m.shape:
                    changes[name] = np.where(m.astype(bool), base[name], 0).astype(base[name].dtype)
        variant("mask one token", changes)
    out.extend(_length_variants(model, inputs, base, ids, masks, shapes, values, rng))
    return out


def _length_variants(model, inputs, base, ids, masks, shapes, values, rng) -> list[tuple[str, Feed]]:
    lengths = _length_symbols(inputs, ids, masks)
    for name in shapes:  # dims the user fixed keep their size
        v = next((x for x in inputs if x.name == name), None)
        if v is not None and v.shape is not None:
            lengths -= {generated.dim_symbol(v, a, d) for a, d in enumerate(v.shape)}
    if not lengths:
        return []
    sizes = _sizes_of(inputs, base)
    scalars = {k: np.asarray(a) for k, a in base.items() if np.asarray(a).size <= 1 and np.asarray(a).ndim <= 1}
    vals = {**scalars, **values}
    current = max(sizes.get(k, 1) for k in lengths)
    table = position_table(model, list(ids.values()))
    longest = min(MAX_LENGTH, table) if table else min(MAX_LENGTH, 4 * current)
    out = []
    for label, n, batch_one in (("length 1", 1, False), (f"length {longest}", longest, True)):
        if n == current:
            continue
        sz = dict(sizes)
        sz.update({k: n for k in lengths})
        if batch_one:
            sz.update({k: 1 for k in _batch_symbols(inputs) if k not in lengths})
        try:
            feed = generated.generate(model, count=1, padded=False, shapes=shapes, values=vals, sizes=sz,
                                      seed=int(rng.integers(1 << 30)))[0]
        except Exception:  # noqa: BLE001 - a length the generator cannot fill is no edge feed
            continue
        if any(np.asarray(feed[k]).shape != np.asarray(base[k]).shape for k in feed if k in base):
            out.append((label, feed))
    return out

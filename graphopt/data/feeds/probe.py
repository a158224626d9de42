"""Generated feeds confirmed by running the model: a short ladder of candidates, the first that runs wins.

The defaults of ``graphopt.data.feeds.generated.generate`` come first, then sizes and scalar values read
from the graph by ``graphopt.data.feeds.hints``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.data.feeds import hints as feed_hints
from graphopt.data.feeds.folder import Feed, describe
from graphopt.data.feeds.generated import check_overrides, dim_symbol, generate
from graphopt.errors import GraphoptError, UsageError, first_line
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)


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
        keys = {axis: dim_symbol(v, axis, d) for axis, d in enumerate(v.shape)}
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


def _own_past(feeds: list[Feed], run) -> list[Feed]:
    """A decoder's generated feeds with a past (``past_key_values.N.*`` of ``P > 0`` positions, ``present.N.*``
    outputs) get the model's own cache as past: the presents of a ``P``-token prefill of the same rows (ids
    taken from the feed), instead of random values no run of the model produces. Feeds without past, or
    whose prefill does not run, stay as they are."""
    out = []
    for feed in feeds:
        past = {k: v for k, v in feed.items() if k.startswith("past_key_values.") and np.ndim(v) == 4}
        ids, mask = feed.get("input_ids"), feed.get("attention_mask")
        if not past or ids is None or mask is None or "position_ids" in feed:
            out.append(feed)
            continue
        b, p = next(iter(past.values())).shape[0], next(iter(past.values())).shape[2]
        if p == 0:
            out.append(feed)
            continue
        pre = {**feed, "input_ids": np.resize(np.asarray(ids), (b, p)).astype(ids.dtype),
               "attention_mask": np.ones((b, p), mask.dtype)}
        pre.update({k: v[:, :, :0] for k, v in past.items()})
        try:
            res = run([pre])[0]
        except Exception as e:  # noqa: BLE001 - the random past stays
            logger.info("decoder prefill for a past did not run: %s", first_line(e))
            out.append(feed)
            continue
        own = {k: res.get(k.replace("past_key_values.", "present.")) for k in past}
        if any(v is None or v.shape != past[k].shape for k, v in own.items()):
            out.append(feed)
            continue
        out.append({**feed, **own})
    return out


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
    ``run`` maps a list of feeds to outputs (default: ``graphopt.runtime.session.runner``, an ORT CPU session made once). ``kwargs``
    go to ``generate``. Raises NoRunnableFeeds when none runs, RuntimeSetupError when the model
    cannot be loaded at all.
    """
    shapes = dict(shapes or {})
    values = dict(values or {})
    base_sizes = dict(kwargs.pop("sizes", None) or {})
    check_overrides(model, shapes, values)
    if run is None:
        run = runtime.runner(model)
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
            feeds = _own_past(feeds, run)
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

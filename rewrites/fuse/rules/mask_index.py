"""Give fused Attention the raw 2-D padding mask instead of the exporter's float ``[B, 1, S, S]`` bias.

After attention fusion the Attention nodes take the export's additive mask as ``attention_bias``
(input 5). Every exporter builds that bias from the 2-D ``attention_mask`` with 10-40 nodes (the
classic ``(1 - m) * min``, transformers 5's vmap'd ``Gather``/``And``/``Where(b, 0, min)``, sdpa's
bool mask with ``-inf``); ORT's Attention kernel builds the same bias itself from a 2-D
``mask_index``::

    attention_mask [B, S] ──(10-40 mask nodes)──▶ bias [B, 1, S|1, S] ──▶ Attention(x, W, b, -, -, bias)
                                         ──▶
    attention_mask [B, S] ──Cast(int32)──▶ Attention(x, W, b, mask_index, mask_filter_value=c)

and the mask nodes are then dead and removed. ORT computes ``bias = where(mask_index > 0, 0, c)``
broadcast over heads and queries and adds it to the scores, so the rewrite is exact when the export's
bias is that function of the mask. That is established in two steps, and any doubt refuses:

1. Structure: walking back from the bias, the only graph input whose *values* are read is one
   rank-2 int/bool input (the mask); every other input is reached only through ``Shape``/``Size``
   (shapes, not data) of values whose shapes are known; no control flow or random ops.
   So the bias is a function of the mask's values and the input shapes only.
2. Values: that function is evaluated (ORT, optimisations off) on every 0/1 mask of shapes
   [8, 3] and [16, 4] (all masks of those lengths), on [2, 1], and on random masks of [5, 7] and
   [1, 9] including all-zero and all-one rows; each result must be exactly 0 at kept and one
   constant ``c <= -1e4`` (or ``-inf``) at masked keys, for every query row. ``c`` becomes
   ``mask_filter_value``, so rows whose mask is all zero behave as in the export as well; ``-inf``
   (sdpa exports) becomes the lowest float32, which is identical wherever a row keeps a key and
   keeps an all-padding row finite instead of NaN.

Mask values other than 0/1 are outside the contract (ORT keeps ``> 0``; exporters keep ``!= 0`` or
compute ``(1 - m) * c``). Refuses (node unchanged) when: the Attention already has a mask_index or
past state, or no bias; the bias has a rank other than 4 or is not broadcast over heads; the
structure check fails (another input's values are read, control flow, unknown shapes); an input
other than the mask has a dimension that is neither the mask's batch nor sequence symbol; the
evaluation fails or gives a value that is not the standard form; the masked constant is above -1e4.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from graphopt.errors import first_line
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.fuse.steps import ReasonedStep
from graphopt.runtime.contrib import attention_inputs
from graphopt.runtime.session import make_session

#: the masked value must be at least this negative to count as a padding mask
MAX_FILTER = -1e4
_SHAPE_OPS = {"Shape", "Size"}
_RANDOM = ("Random", "Multinomial", "Bernoulli", "Dropout")


def _is_known_shape(v: ir.Value) -> bool:
    return v.shape is not None and all(isinstance(d, int) or (isinstance(d, ir.SymbolicDim) and d.value) for d in v.shape)


def _mask_source(bias: ir.Value, graph_inputs: set[int]) -> tuple[ir.Value | None, str]:
    """(the one graph input whose values the bias reads, '') or (None, reason)."""
    seen: set[int] = set()
    stack = [bias]
    sources: dict[int, ir.Value] = {}
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if id(v) in graph_inputs:
            sources[id(v)] = v
            continue
        node = v.producer()
        if node is None:
            if v.const_value is None:
                return None, f"bias reads {v.name!r}, neither a graph input nor a constant"
            continue
        if node.op_type.startswith(_RANDOM) or any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()
        ):
            return None, f"bias is computed through {node.op_type} {node.name!r} (control flow or random)"
        if node.op_type in _SHAPE_OPS and node.domain == "":
            if not _is_known_shape(node.inputs[0]):
                return None, f"bias reads the shape of {node.inputs[0].name!r}, which is not known symbolically"
            continue
        stack.extend(i for i in node.inputs if i is not None)
    if len(sources) != 1:
        names = sorted(s.name for s in sources.values())
        return None, f"bias reads the values of {len(sources)} graph inputs {names}, not one mask"
    (mask,) = sources.values()
    if mask.shape is None or mask.shape.rank() != 2:
        return None, f"bias reads {mask.name!r}, which is not a rank-2 [batch, seq] mask"
    if mask.dtype not in (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL):
        return None, f"mask {mask.name!r} is {mask.dtype}, not int64/int32/bool"
    return mask, ""


def _probe_masks(rng: np.random.Generator) -> list[np.ndarray]:
    def every(s: int) -> np.ndarray:
        return ((np.arange(2**s)[:, None] >> np.arange(s)) & 1).astype(np.int64)

    rand = rng.integers(0, 2, size=(5, 7))
    rand[0] = 0
    rand[1] = 1
    rand[2, :3] = 1
    rand[2, 3:] = 0
    return [every(3), every(4), np.array([[1], [0]]), rand, np.array([[1, 1, 1, 1, 0, 1, 0, 0, 0]])]


def _feeds_for(model: ir.Model, mask: ir.Value, m: np.ndarray) -> dict[str, np.ndarray] | str:
    b_sym, s_sym = (str(d) if not isinstance(d, int) else d for d in mask.shape)
    sizes = {b_sym: m.shape[0], s_sym: m.shape[1]}
    feed: dict[str, np.ndarray] = {}
    for inp in model.graph.inputs:
        if inp is mask:
            feed[inp.name] = m.astype(mask.dtype.numpy())
            continue
        if inp.shape is None or inp.dtype is None:
            return f"input {inp.name!r} has no known shape"
        dims = []
        for d in inp.shape:
            if isinstance(d, int):
                dims.append(d)
            elif str(d) in sizes:
                dims.append(sizes[str(d)])
            else:
                return f"input {inp.name!r} has dimension {d} that is neither the mask's batch nor sequence"
        feed[inp.name] = np.zeros(dims, inp.dtype.numpy())
    return feed


def _standard_constant(m: np.ndarray, got: np.ndarray) -> float | str:
    """The masked constant ``c`` when ``got == where(m > 0, 0, c)`` over keys, else a reason."""
    b, s = m.shape
    if got.ndim != 4 or got.shape[0] not in (1, b) or got.shape[1] != 1 or got.shape[2] not in (1, s) or got.shape[3] != s:
        return f"bias has shape {list(got.shape)}, not [B, 1, S|1, S] for a mask of {[b, s]}"
    full = np.broadcast_to(got, (b, 1, s, s))
    keep = np.broadcast_to((m > 0)[:, None, None, :], full.shape)
    if not np.all(full[keep] == 0):
        return "bias is not 0 at every kept key"
    masked = full[~keep]
    if masked.size == 0:
        return 0.0
    c = masked.flat[0]
    if not np.all((masked == c) | (np.isneginf(masked) & np.isneginf(c))):
        return "bias is not one constant at every masked key"
    return float(c)


class MaskIndexStep(ReasonedStep):
    """Fusion step: Attention(bias from a 2-D mask) -> Attention(mask_index, mask_filter_value)."""

    def apply_to_model(self, model: ir.Model, **_) -> int:
        self.reasons = []
        sites = []
        for node in model.graph:
            if node.op_type != "Attention" or node.domain != MS_DOMAIN:
                continue
            a = attention_inputs(node)
            label = f"Attention {node.name!r}"
            if a.mask_index is not None:
                self.reasons.append(f"fuse: mask_index: {label} already has a mask_index")
            elif a.past_state:
                self.reasons.append(f"fuse: mask_index: {label} has past state or extra inputs")
            elif a.attention_bias is None:
                self.reasons.append(f"fuse: mask_index: {label} has no attention bias")
            else:
                sites.append(node)
        if not sites:
            return 0
        graph_inputs = {id(v) for v in model.graph.inputs}
        verdict: dict[int, tuple[ir.Value, float] | str] = {}
        biases = {}
        for node in sites:
            bias = attention_inputs(node).attention_bias
            if id(bias) in verdict or id(bias) in biases:
                continue
            mask, why = _mask_source(bias, graph_inputs)
            if mask is None:
                verdict[id(bias)] = why
            else:
                biases[id(bias)] = (bias, mask)
        if biases:
            verdict.update(_evaluate(model, list(biases.values())))
        casts: dict[int, ir.Value] = {}
        count = 0
        for node in sites:
            v = verdict[id(attention_inputs(node).attention_bias)]
            if isinstance(v, str):
                self.reasons.append(f"fuse: mask_index: Attention {node.name!r}: {v}")
                continue
            mask, c = v
            if id(mask) not in casts:
                if mask.dtype == ir.DataType.INT32:
                    casts[id(mask)] = mask
                else:
                    cast = ir.node("Cast", [mask], attributes={"to": ir.DataType.INT32}, name=f"{mask.name}_mask_index")
                    cast.outputs[0].name = f"{mask.name}_int32"
                    cast.outputs[0].dtype = ir.DataType.INT32
                    cast.outputs[0].shape = ir.Shape(mask.shape)
                    model.graph.insert_before(model.graph.node(0), cast)
                    casts[id(mask)] = cast.outputs[0]
            node.replace_input_with(5, None)
            node.replace_input_with(3, casts[id(mask)])
            # -inf would turn rows whose mask is all zero into NaN; the lowest float keeps them finite
            # and is identical wherever a row has a kept key (exp underflows to 0 either way)
            filt = float(np.finfo(np.float32).min) if np.isneginf(c) else c
            node.attributes["mask_filter_value"] = ir.AttrFloat32("mask_filter_value", filt)
            # trailing empty inputs are dropped
            while node.inputs and node.inputs[-1] is None:
                node.resize_inputs(len(node.inputs) - 1)
            count += 1
        return count


def _evaluate(model: ir.Model, pairs: list[tuple[ir.Value, ir.Value]]) -> dict[int, tuple[ir.Value, float] | str]:
    """Evaluate each bias on the probe masks; (mask, c) when standard, else a reason."""
    out: dict[int, tuple[ir.Value, float] | str] = {}
    added = [b for b, _ in pairs if b not in model.graph.outputs]
    model.graph.outputs.extend(added)
    try:
        # only what the biases depend on (the mask arithmetic): a copy sharing the tensors, its other
        # outputs and everything they need removed, so a large model is not loaded into ORT again
        probe = model.clone()
        keep = {b.name for b, _ in pairs}
        probe.graph.outputs[:] = [v for v in probe.graph.outputs if v.name in keep]
        common_passes.RemoveUnusedNodesPass()(probe)
        sess = make_session(probe, optimize=False)
    except Exception as e:  # noqa: BLE001 - a model ORT cannot load is not ours to fix here
        return {id(b): f"cannot evaluate the bias: {e}" for b, _ in pairs}
    finally:
        for b in added:
            model.graph.outputs.remove(b)
    rng = np.random.default_rng(0)
    consts: dict[int, set[float]] = {id(b): set() for b, _ in pairs}
    failed: dict[int, str] = {}
    names = [b.name for b, _ in pairs]
    for m in _probe_masks(rng):
        feeds = {}
        for (_b, mask) in pairs:
            f = _feeds_for(model, mask, m)
            if isinstance(f, str):
                return {id(b): f for b, _ in pairs}
            feeds.update(f)
        try:
            results = sess.run(names, feeds)
        except Exception as e:  # noqa: BLE001
            return {id(b): f"evaluating the bias failed: {first_line(e)}" for b, _ in pairs}
        for (b, _mask), got in zip(pairs, results):
            if id(b) in failed:
                continue
            c = _standard_constant(m, got)
            if isinstance(c, str):
                failed[id(b)] = f"{c} (mask {m.tolist() if m.size <= 9 else list(m.shape)})"
            elif m.min() == 0:
                consts[id(b)].add(c)
    for b, mask in pairs:
        if id(b) in failed:
            out[id(b)] = failed[id(b)]
            continue
        cs = consts[id(b)]
        if len(cs) != 1:
            out[id(b)] = f"masked value differs between masks: {sorted(cs)}"
            continue
        c = cs.pop()
        if not c <= MAX_FILTER:
            out[id(b)] = f"masked value {c} is above {MAX_FILTER}: not a padding mask"
            continue
        out[id(b)] = (mask, c)
    return out

"""What the GroupQueryAttention rewrite computes by running ONNX Runtime on pieces of the graph.

- ``rotary_tables``: the constant cos/sin caches ``[max_positions, D/2]``. The fused rotary computes them at
  run time as ``Cos(Unsqueeze(Cast(Range(0, n, 1), float), [1]) * inv_freq)`` (``Sin`` likewise); the same ops
  are run here once, by ONNX Runtime, for ``n = max_positions``, so every entry is the float the input
  model computes (numpy's ``cos`` may differ from ORT's in the last bit).
- ``mask_is_causal_padding``: the attention bias, computed from ``attention_mask`` by the export, evaluated
  on a prefill and a decode step with right-padded rows and compared with the causal + padding rule
  (query ``i`` of a step with past ``P`` sees key ``j`` iff ``j <= P + i`` and ``mask[j] == 1``), the only
  mask GroupQueryAttention applies.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from graphopt.onnxscript_compat import get_numpy_value
from graphopt.runtime.session import make_session

from .match import Refusal


def _only(v: ir.Value, op: str) -> ir.Node:
    node = v.producer() if v is not None else None
    if node is None or node.op_type != op or node.domain not in ("", "ai.onnx"):
        raise Refusal(f"rotary cache is not the {op} form Cos(positions x inv_freq)", v)
    return node


def _angles(cos: ir.Value, sin: ir.Value) -> tuple[np.ndarray, ir.Node, int]:
    """(inv_freq, the Mul, which Mul input is the positions) of ``cos = Cos(Mul)``, ``sin = Sin(Mul)``."""
    mul = _only(_only(cos, "Cos").inputs[0], "Mul")
    if _only(sin, "Sin").inputs[0] is not mul.outputs[0]:
        raise Refusal("cos and sin caches are computed from different angles", sin)
    for i in (0, 1):
        inv = get_numpy_value(mul.inputs[1 - i])
        if inv is not None and inv.ndim == 1 and inv.dtype == np.float32:
            return inv, mul, i
    raise Refusal("rotary inverse frequencies are not a constant float32 [D/2] tensor", mul.outputs[0])


def rotary_tables(cos: ir.Value, sin: ir.Value, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(cos_cache, sin_cache)`` of ``[max_positions, D/2]`` for positions ``0..max_positions-1``."""
    c, s = get_numpy_value(cos), get_numpy_value(sin)
    if c is not None and s is not None:
        if c.ndim != 2 or c.shape[0] < max_positions:
            raise Refusal(f"constant rotary cache {list(c.shape)} has fewer than {max_positions} positions", cos)
        return c[:max_positions].astype(np.float32), s[:max_positions].astype(np.float32)
    inv, mul, i = _angles(cos, sin)
    un = _only(mul.inputs[i], "Unsqueeze")
    if [int(a) for a in (get_numpy_value(un.inputs[1]) if len(un.inputs) > 1 else np.array([-1])).reshape(-1)] != [1]:
        raise Refusal("rotary positions are not unsqueezed on axis 1", un.outputs[0])
    cast = _only(un.inputs[0], "Cast")
    if cast.attributes.get_int("to", 0) != ir.DataType.FLOAT:
        raise Refusal("rotary positions are not cast to float32", cast.outputs[0])
    rng = _only(cast.inputs[0], "Range")
    start, delta = get_numpy_value(rng.inputs[0]), get_numpy_value(rng.inputs[2])
    if start is None or delta is None or int(start) != 0 or int(delta) != 1:
        raise Refusal("rotary positions are not Range(0, n, 1)", rng.outputs[0])
    return _run_tables(inv, max_positions, rng.inputs[0].dtype or ir.DataType.INT64)


def _run_tables(inv: np.ndarray, n: int, dtype: ir.DataType) -> tuple[np.ndarray, np.ndarray]:
    """The export's cache ops on ``Range(0, n, 1)``, run by ONNX Runtime."""
    def const(name, arr):
        return ir.Value(name=name, const_value=ir.tensor(arr, name=name))

    np_t = dtype.numpy()
    zero, lim, one = const("zero", np.array(0, np_t)), const("lim", np.array(n, np_t)), const("one", np.array(1, np_t))
    axes, inv_v = const("axes", np.array([1], np.int64)), const("inv", inv)
    rng = ir.node("Range", [zero, lim, one])
    cast = ir.node("Cast", [rng.outputs[0]], attributes={"to": ir.DataType.FLOAT})
    un = ir.node("Unsqueeze", [cast.outputs[0], axes])
    mul = ir.node("Mul", [un.outputs[0], inv_v])
    cos, sin = ir.node("Cos", [mul.outputs[0]]), ir.node("Sin", [mul.outputs[0]])
    cos.outputs[0].name, sin.outputs[0].name = "cos", "sin"
    for v in (cos.outputs[0], sin.outputs[0]):
        v.type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([], [cos.outputs[0], sin.outputs[0]], nodes=[rng, cast, un, mul, cos, sin],
                     initializers=[zero, lim, one, axes, inv_v], opset_imports={"": 17})
    sess = make_session(ir.Model(graph, ir_version=8), optimize=False)
    c, s = sess.run(["cos", "sin"], {})
    return np.ascontiguousarray(c, np.float32), np.ascontiguousarray(s, np.float32)


#: (past length, right-padded mask [2, past + sequence]): a prefill, and a step of two tokens after three
_CASES = ((0, np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int64)),
          (3, np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], np.int64)))


def mask_is_causal_padding(model: ir.Model, biases: list[ir.Value], kv_heads: int, head_dim: int) -> str | None:
    """None when every bias is the causal + padding mask of ``attention_mask``; else why not."""
    names = [b.name for b in biases]
    if any(not n for n in names):
        return "an attention bias has no name to probe"
    probe = model.clone()
    values = {v.name: v for n in probe.graph for v in n.outputs}
    probe.graph.outputs.clear()
    probe.graph.outputs.extend(values[n] for n in dict.fromkeys(names))
    common_passes.RemoveUnusedNodesPass()(probe)
    try:
        sess = make_session(probe, optimize=False)
    except Exception as e:  # noqa: BLE001 - a graph ORT cannot run is a refusal, not an error
        return f"the attention bias cannot be evaluated alone ({type(e).__name__})"
    for past, mask in _CASES:
        b, total = mask.shape
        seq = total - past
        feed = {"attention_mask": mask, "input_ids": np.zeros((b, seq), np.int64)}
        for v in probe.graph.inputs:
            if v.name.startswith("past_key_values."):
                feed[v.name] = np.zeros((b, kv_heads, past, head_dim), np.float32)
        allowed = (np.arange(total)[None, None, :] <= past + np.arange(seq)[None, :, None]) & (mask[:, None, :] == 1)
        try:
            outs = sess.run(None, feed)
        except Exception as e:  # noqa: BLE001
            return f"the attention bias cannot be evaluated on a {seq}-token step ({type(e).__name__})"
        for name, out in zip(dict.fromkeys(names), outs):
            got = np.broadcast_to(np.asarray(out, np.float64), (b, 1, seq, total))[:, 0]
            if not (np.all(got[allowed] == 0) and np.all(got[~allowed] <= -1e4)):
                return (f"attention bias {name!r} is not the causal + padding mask of attention_mask "
                        f"(checked on a step of {seq} tokens after {past})")
    return None

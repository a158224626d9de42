"""SmoothQuant for the ``quantize`` pass: move activation outliers into the weights.

For an activation ``x`` read by quantized MatMuls ``W_1..W_m``, per input channel j::

    s_j = max|x_j|^alpha / max_i max|W_i[j, :]|^(1 - alpha)      x' = x / s      W_i' = diag(s) W_i

so ``x' W_i' = x W_i`` exactly in float, with smaller activation outliers. ``x / s`` is folded where
that is free, else a ``Mul`` is inserted once per activation:

- producer ``LayerNormalization`` / ``SkipLayerNormalization`` whose output 0 is read only by
  smoothed targets: gamma and beta are divided by s;
- producer ``com.microsoft::Attention`` read only by smoothed targets: the V columns of its weight
  and bias are divided by s (attention is linear in V per channel);
- ``com.microsoft::MultiHeadAttention`` outputs that reach x only through row moves (``Reshape`` to
  ``[..., H]``, ``Concat``/``Gather`` on axis 0: ``remove-padding``'s length groups), whose values all
  come from one ``MatMul(·, W_v)`` by row moves (``Squeeze``, ``Gather`` on axis 0) and are read by
  nothing else: the columns of ``W_v`` and the V part of the attention bias are divided by s::

      MatMul(W_v / s) ─Squeeze─Gather_g─▶ MultiHeadAttention_g(bias_v / s) ─Reshape─Concat─Gather─▶ x / s

- otherwise ``Mul(x, 1/s)``.

``alpha='auto'`` picks, per activation, the alpha in 0.3..0.85 minimising the layers' quantization
error on the sampled calibration rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common.activations import Stats
from graphopt.rewrites.quantize.numeric import BLOCK_ELEMENTS, fake_quant_act, quantize_weight
from graphopt.rewrites.quantize.targets import Target
from graphopt.runtime.contrib import attention_inputs

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85)


def smooth_factors(stats: Stats, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    amax = np.maximum(stats.chan_absmax.astype(np.float64), 1e-5)
    wmax = np.maximum(np.max([np.abs(w).max(axis=1) for w in weights], axis=0).astype(np.float64), 1e-5)
    s = amax**alpha / wmax ** (1.0 - alpha)
    s = np.clip(s, 1e-3, 1e3)
    return s.astype(np.float32)


def local_error(x: np.ndarray, w: np.ndarray, s: np.ndarray | None, act: tuple[float, float] | None,
                act_type: str = "u8", *, cache: dict | None = None) -> float:
    """Relative output error of one int8 layer on sampled rows ``x`` (dynamic range when ``act`` is None).

    ``cache``: a dict kept by the caller across calls on the same ``x`` and ``w`` without smoothing
    (only the activation range changes): the float output and the quantized weight are made once.
    """
    if w.size > BLOCK_ELEMENTS:
        return _local_error_blocks(x, w, s, act, act_type)
    if s is None and cache:
        ref, wdq = cache["ref"], cache["wdq"]
    else:
        ref = x @ w
        if s is not None:
            x, w = x / s, w * s.reshape(-1, 1)
            if act is not None:
                act = (float(x.min()), float(x.max()))
        q, ws = quantize_weight(w)
        wdq = q.astype(np.float32) * ws
        if s is None and cache is not None:
            cache.update(ref=ref, wdq=wdq)
    xq = fake_quant_act(x, *(act or (None, None)), act_type)
    got = xq @ wdq
    return float(np.sum((got - ref) ** 2) / max(np.sum(ref**2), 1e-12))


def _local_error_blocks(x: np.ndarray, w: np.ndarray, s: np.ndarray | None, act: tuple[float, float] | None,
                       act_type: str) -> float:
    """``local_error`` of a large weight, a block of columns at a time (temporaries of one block)."""
    if s is not None:
        xs = x / s
        if act is not None:
            act = (float(xs.min()), float(xs.max()))
    else:
        xs = x
    xq = fake_quant_act(xs, *(act or (None, None)), act_type)
    num = den = 0.0
    step = max(1, BLOCK_ELEMENTS // w.shape[0])
    for c in range(0, w.shape[1], step):
        wc = w[:, c:c + step]
        ref = x @ wc
        if s is not None:
            wc = wc * s.reshape(-1, 1)
        q, ws = quantize_weight(wc)
        got = xq @ (q.astype(np.float32) * ws)
        num += float(np.sum((got - ref) ** 2, dtype=np.float64))
        den += float(np.sum(ref.astype(np.float64) ** 2))
    return num / max(den, 1e-12)


def choose(stats: Stats, group: list[Target], alpha: str | float, static: bool) -> tuple[np.ndarray, float]:
    """Smoothing factors for the targets reading one activation: (s, alpha used)."""
    weights = [t.weight_array for t in group]
    if alpha != "auto":
        a = float(alpha)
        return smooth_factors(stats, weights, a), a
    x = stats.rows
    best = (np.inf, None, 0.5)
    for a in ALPHAS:
        s = smooth_factors(stats, weights, a)
        act = (0.0, 0.0) if static else None
        err = sum(local_error(x, w, s, act) for w in weights)
        if err < best[0]:
            best = (err, s, a)
    return best[1], best[2]


def _only_read_by(v: ir.Value, nodes: set[int]) -> bool:
    return not v.is_graph_output() and all(id(u[0]) in nodes for u in v.uses())


def apply_smoothing(model: ir.Model, targets: list[Target], factors: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Divide each smoothed activation by its factors (fold or Mul); updates ``Target.act``.

    ``factors`` maps activation value name -> s. Weight scaling happens in ``qdq.apply``
    (QConfig.smooth). Returns the counts of each way used.
    """
    g = model.graph
    counts = {"smooth-fold-layernorm": 0, "smooth-fold-attention-v": 0, "smooth-fold-mha-v": 0, "smooth-mul": 0}
    groups: dict[str, list[Target]] = {}
    for t in targets:
        if t.act is not None and t.act.name in factors:
            groups.setdefault(t.act.name, []).append(t)
    for name, group in groups.items():
        s = factors[name].astype(np.float32)
        x = group[0].act
        readers = {id(t.node) for t in group}
        prod = x.producer()
        done = False
        if prod is not None and _only_read_by(x, readers) and x.index() == 0:
            if prod.op_type in ("LayerNormalization", "SkipLayerNormalization") and prod.domain in ("", MS_DOMAIN):
                gi, bi = (1, 2) if prod.op_type == "LayerNormalization" else (2, 3)
                gamma = prod.inputs[gi].const_value.numpy() if prod.inputs[gi] is not None and \
                    prod.inputs[gi].const_value is not None else None
                beta_v = prod.inputs[bi] if len(prod.inputs) > bi else None
                beta = beta_v.const_value.numpy() if beta_v is not None and beta_v.const_value is not None else None
                if gamma is not None and gamma.shape == s.shape and (beta_v is None or beta is not None) and \
                        len(prod.inputs[gi].uses()) == 1 and (beta_v is None or len(beta_v.uses()) == 1):
                    prod.inputs[gi].const_value = ir.tensor(gamma / s, name=prod.inputs[gi].name)
                    if beta is not None:
                        beta_v.const_value = ir.tensor(beta / s, name=beta_v.name)
                    done = True
                    counts["smooth-fold-layernorm"] += 1
            elif prod.op_type == "Attention" and prod.domain == MS_DOMAIN:
                a = attention_inputs(prod)
                w_v, b_v = a.weights, a.bias
                if w_v is not None and w_v.const_value is not None and len(w_v.uses()) == 1 and \
                        b_v is not None and b_v.const_value is not None and len(b_v.uses()) == 1:
                    w, b = w_v.const_value.numpy().copy(), b_v.const_value.numpy().copy()
                    h = w.shape[1] // 3
                    if h == s.shape[0]:
                        w[:, 2 * h:] /= s
                        b[2 * h:] /= s
                        w_v.const_value = ir.tensor(w, name=w_v.name)
                        b_v.const_value = ir.tensor(b, name=b_v.name)
                        done = True
                        counts["smooth-fold-attention-v"] += 1
            else:
                mhas = _attention_rows(x, s.shape[0])
                if mhas and _fold_into_mha_values(mhas, s):
                    done = True
                    counts["smooth-fold-mha-v"] += 1
        if not done:
            inv_name = f"{name}_smooth_inv"
            t = ir.tensor((1.0 / s).astype(np.float32), name=inv_name)
            inv = ir.Value(name=inv_name, shape=ir.Shape(s.shape), type=ir.TensorType(t.dtype), const_value=t)
            g.register_initializer(inv)
            mul = ir.node("Mul", [x, inv], name=f"{name}_smooth")
            mul.outputs[0].name = f"{name}_smoothed"
            mul.outputs[0].type, mul.outputs[0].shape = x.type, x.shape
            first = min((t.node for t in group), key=lambda n: list(g).index(n))
            g.insert_before(first, mul)
            for t in group:
                for i, v in enumerate(t.node.inputs):
                    if v is x:
                        t.node.replace_input_with(i, mul.outputs[0])
                t.act = mul.outputs[0]
            counts["smooth-mul"] += 1
    return {k: v for k, v in counts.items() if v}


def _const_ints(v: ir.Value | None) -> list[int] | None:
    """A constant integer input (initializer or Constant node), or None."""
    t = ir.convenience.get_const_tensor(v) if v is not None else None
    return None if t is None else [int(i) for i in t.numpy().reshape(-1)]


def _is_attention(node: ir.Node) -> bool:
    """com.microsoft MultiHeadAttention, or ONNX Attention (``remove-padding.attention_op=onnx``)."""
    return (node.op_type == "MultiHeadAttention" and node.domain == MS_DOMAIN) or \
        (node.op_type == "Attention" and node.domain == "")


def _attention_rows(x: ir.Value, hidden: int) -> list[ir.Node] | None:
    """The attention nodes (:func:`_is_attention`) whose output 0 reaches ``x`` only through row moves
    (each value on the way read by nothing else), or None. Rows keep their ``hidden`` channels: Reshape
    to a constant ``[..., hidden]`` of an attention output, Concat and Gather on axis 0 of such rows."""
    prod = x.producer()
    if prod is None:
        return None
    if _is_attention(prod) and x.index() == 0:
        if any(o.uses() or o.is_graph_output() for o in prod.outputs[1:]):
            return None
        return [prod]
    if prod.domain != "" or x.index() != 0:
        return None
    if prod.op_type == "Reshape":
        target = _const_ints(prod.inputs[1])
        src = prod.inputs[0].producer()
        if not target or len(target) < 2 or target[-1] != hidden or src is None or not _is_attention(src):
            return None
        sources = [prod.inputs[0]]
    elif prod.op_type == "Concat" and prod.attributes.get_int("axis", 0) == 0:
        sources = list(prod.inputs)
    elif prod.op_type == "Gather" and prod.attributes.get_int("axis", 0) == 0:
        sources = [prod.inputs[0]]
    else:
        return None
    found: list[ir.Node] = []
    for v in sources:
        if v is None or not _only_read_by(v, {id(prod)}):
            return None
        more = _attention_rows(v, hidden)
        if more is None:
            return None
        found += more
    return found


def _bias_add(node: ir.Node, hidden: int) -> ir.Value | None:
    """The constant ``[hidden]`` operand of ``Add(x, b)`` (read by this Add only), or None."""
    if node.op_type != "Add" or node.domain != "" or len(node.inputs) != 2:
        return None
    b = node.inputs[1]
    ok = b is not None and b.const_value is not None and b.shape is not None and list(b.shape) == [hidden] \
        and len(b.uses()) == 1 and not b.is_graph_output()
    return b if ok else None


def _value_projection(v: ir.Value | None, hidden: int) -> tuple[ir.Node, ir.Value | None] | None:
    """``(MatMul(·, W), b)``: the projection (constant ``W[K, hidden]``) that ``v`` comes from through
    Squeeze / axis-0 Gather, and the constant bias of an ``Add`` on the way (or None)."""
    bias = None
    while v is not None and v.producer() is not None:
        prod = v.producer()
        if prod.domain != "":
            return None
        if prod.op_type == "MatMul":
            w = prod.inputs[1]
            ok = w is not None and w.const_value is not None and w.shape is not None and len(w.shape) == 2 \
                and w.shape[1] == hidden and len(w.uses()) == 1
            return (prod, bias) if ok else None
        if prod.op_type == "Squeeze":
            axes = _const_ints(prod.inputs[1]) if len(prod.inputs) > 1 else None
            if axes is None or any(a < 0 for a in axes):  # the last axis may not go
                return None
        elif prod.op_type == "Add":
            if bias is not None or _bias_add(prod, hidden) is None:
                return None
            bias = prod.inputs[1]
        elif not (prod.op_type == "Gather" and prod.attributes.get_int("axis", 0) == 0):
            return None
        v = prod.inputs[0]
    return None


def _feeds_only_values(v: ir.Value, mhas: set[int]) -> bool:
    """Every use of ``v``, through Squeeze / axis-0 Gather data / a bias Add, is the value input (2) of
    one of ``mhas``."""
    if v.is_graph_output():
        return False
    for node, idx in v.uses():
        if id(node) in mhas:
            if idx != 2:
                return False
        elif node.domain == "" and idx == 0 and node.op_type in ("Squeeze", "Gather", "Add") and \
                (node.op_type != "Gather" or node.attributes.get_int("axis", 0) == 0):
            if not _feeds_only_values(node.outputs[0], mhas):
                return False
        else:
            return False
    return True


def _fold_into_mha_values(mhas: list[ir.Node], s: np.ndarray) -> bool:
    """Divide the values of ``mhas`` by ``s``: their V projection's columns, the bias Add on the way
    (ONNX Attention) or the V part of their attention bias (MultiHeadAttention)."""
    h = s.shape[0]
    found = [_value_projection(m.inputs[2] if len(m.inputs) > 2 else None, h) for m in mhas]
    if found[0] is None or any(f is None or f[0] is not found[0][0] for f in found):  # one V projection
        return False
    proj, add_bias = found[0]
    ids = {id(m) for m in mhas}
    if not _feeds_only_values(proj.outputs[0], ids):
        return False
    mha_bias = None
    if any(m.op_type == "MultiHeadAttention" for m in mhas):
        if any(m.op_type != "MultiHeadAttention" for m in mhas):
            return False
        biases = {id(b): b for b in (m.inputs[3] if len(m.inputs) > 3 else None for m in mhas)}
        if len(biases) != 1:  # one attention bias for all of them, or none for all
            return False
        mha_bias = next(iter(biases.values()))
        if mha_bias is not None:
            b = mha_bias.const_value.numpy() if mha_bias.const_value is not None else None
            if b is None or b.shape != (3 * h,) or mha_bias.is_graph_output() or \
                    any(id(n) not in ids for n, _ in mha_bias.uses()):
                return False
    if mha_bias is not None:
        b = mha_bias.const_value.numpy().copy()
        b[2 * h:] /= s
        mha_bias.const_value = ir.tensor(b, name=mha_bias.name)
    if add_bias is not None:
        add_bias.const_value = ir.tensor(add_bias.const_value.numpy() / s, name=add_bias.name)
    w = proj.inputs[1]
    w.const_value = ir.tensor(w.const_value.numpy() / s, name=w.name)
    return True

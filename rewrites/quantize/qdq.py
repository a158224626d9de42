"""Integer replacements of quantization targets (:mod:`.targets`), used by the ``quantize`` pass.

Replacements, per target and per format::

    dynamic (qop):  x ──DynamicQuantizeMatMul(Wq, w_scale[N], bias)──▶ y
                    x ──DynamicQuantizeLinear──▶ QAttention(Wq, b, x_scale, w_scale[3H], mask, x_zp)
    static  (qop):  x ──QuantizeLinear(s, zp)──▶ MatMulIntegerToFloat(Wq, s, w_scale[N], zp, bias) ──▶ y
                    x ──QuantizeLinear(s, zp)──▶ QAttention(...)
    static  (qdq):  x ──Q──DQ──▶ MatMul ◀──DQ(Wq, w_scale, axis=1)   (+ Add bias kept)
    int4:           x ──MatMulNBits(bits=4, block_size, accuracy_level)──▶ y
    embeddings:     Gather(table_q int8, ids) ──Cast(float)──Mul(scale[H])──▶   (= DequantizeLinear(axis=-1),
                    which ORT 1.32's CPU runs ~5x slower: a per-axis kernel)
    EmbedLayerNorm: Gather(table_q) ─DQ─ + position rows ─SkipLayerNormalization(+ segment rows)──▶

Weights are per-channel (per output column) symmetric int8 (stored as ``QConfig.weights`` says:
:func:`.numeric.int8_weights`). One ``QuantizeLinear`` is shared by all
consumers of the same activation. Refuses (keeps the node float): non-constant or non-2-D weights,
Attention with past/extra inputs, rotary width or unequal ``qkv_hidden_sizes`` (equal thirds are
QAttention's default and are dropped), QDQ below opset 13.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, default_opset
from graphopt.rewrites.common.names import Names
from graphopt.rewrites.quantize.int4 import pack_int4, rtn_int4
from graphopt.rewrites.quantize.numeric import WEIGHT_QMAX, act_qparams, quantize_weight, store_weight
from graphopt.rewrites.quantize.targets import QConfig, Target, const_array, sum_bias_index
from graphopt.runtime.contrib import attention_inputs

# ------------------------------------------------------------------ rewriting


class _Builder(Names):
    """Creates uniquely named initializers and nodes in a graph."""

    def __init__(self, model: ir.Model):
        super().__init__(model.graph)
        self.model = model
        self.shared_q: dict[tuple, ir.Value] = {}

    def node(self, before: ir.Node, op: str, inputs, attrs=None, *, domain: str = "", name: str = "",
             outputs: int = 1) -> ir.Node:
        n = ir.node(op, list(inputs), attrs or {}, domain=domain, num_outputs=outputs,
                    name=self.unique(name or op))
        for i, o in enumerate(n.outputs):
            o.name = self.unique(f"{n.name}_out{i}" if outputs > 1 else f"{n.name}_out")
        self.graph.insert_before(before, n)
        return n


def _replace_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Point every use (and a graph output) of ``old`` at ``new``; ``new`` takes the name when it is an output."""
    new.shape, new.type = old.shape, old.type
    if old.is_graph_output():
        name = old.name
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = f"{name}__replaced"
        new.name = name
    else:
        old.replace_all_uses_with(new)


def _first_of(graph: ir.Graph, nodes: list[ir.Node]) -> ir.Node:
    """The earliest of ``nodes`` in graph order (new nodes go before it)."""
    order = {id(n): i for i, n in enumerate(graph)}
    return min(nodes, key=lambda n: order[id(n)])


def _quantize_activation(b: _Builder, t: Target, cfg: QConfig, anchor: ir.Node) -> tuple[ir.Value, ...]:
    """The quantized activation (xq, scale, zero point) for ``t``, shared between consumers."""
    x = t.node.inputs[0]  # current input (an upstream rewrite may have replaced t.act)
    if cfg.mode == "dynamic":
        key = ("dyn", id(x))
        if key not in b.shared_q:
            n = b.node(anchor, "DynamicQuantizeLinear", [x], name=f"{x.name}_dynq", outputs=3)
            b.shared_q[key] = n
        n = b.shared_q[key]
        return tuple(n.outputs)
    lo, hi = cfg.act_range
    s, zp = act_qparams(lo, hi, cfg.act_type)
    key = ("st", id(x), float(s), int(zp), cfg.act_type)
    if key not in b.shared_q:
        sv = b.initializer(f"{x.name}_scale", np.array(s, dtype=np.float32))
        zv = b.initializer(f"{x.name}_zp", zp)
        n = b.node(anchor, "QuantizeLinear", [x, sv, zv], name=f"{x.name}_q")
        b.shared_q[key] = (n.outputs[0], sv, zv)
    return b.shared_q[key]



def apply(model: ir.Model, targets: list[Target], plan: Mapping[str, QConfig]) -> dict[str, int]:
    """Rewrite every target in ``plan`` in place; returns op-type -> count of created integer ops."""
    b = _Builder(model)
    g = model.graph
    counts: dict[str, int] = {}
    used_ms = False

    def bump(op: str) -> None:
        counts[op] = counts.get(op, 0) + 1

    for t in targets:
        cfg = plan.get(t.key)
        if cfg is None:
            continue
        node = t.node
        w = t.weight_array
        if cfg.smooth is not None and t.kind != "gather":
            w = w * cfg.smooth.reshape(-1, 1).astype(np.float32)
        pre = t.key.replace("/", "_")
        if t.kind == "embed_table":  # fused EmbedLayerNormalization: int8 word table
            if not cfg.whole_table_dq and not _can_unfuse_embed(model, node):
                continue
            q, s = quantize_weight(w, axis=1)
            qv = b.initializer(f"{pre}_table_q", q)
            sv = b.initializer(f"{pre}_table_scale", s)
            if _unfuse_embed(b, node, qv, sv, pre):
                bump("EmbedLayerNormalization(int8 gather)")
                continue
            # fallback: the whole table dequantized on every run (ORT does not constant-fold DequantizeLinear)
            dq = b.node(node, "DequantizeLinear", [qv, sv], {"axis": 1}, name=f"{pre}_table_dq")
            node.replace_input_with(2, dq.outputs[0])
            bump("EmbedLayerNormalization(int8 table)")
            continue
        if t.kind == "gather":
            q, s = quantize_weight(w, axis=1)
            qv = b.initializer(f"{pre}_table_q", q)
            sv = b.initializer(f"{pre}_table_scale", s)
            gnode = b.node(node, "Gather", [qv, node.inputs[1]], {"axis": 0}, name=f"{pre}_qgather")
            _replace_output(g, node.outputs[0], _dequantize_rows(b, node, gnode.outputs[0], sv, f"{pre}_dq"))
            g.remove(node, safe=True)
            bump("Gather(int8)")
            continue
        bias = None
        if t.bias_add is not None:
            bias_in = [v for v in t.bias_add.inputs if v is not node.outputs[0]][0]
            bias = const_array(bias_in)
        # BiasGelu: its bias goes into the integer op (not in QDQ form: that keeps MatMul + BiasGelu)
        gelu = t.bias_gelu if t.bias_gelu is not None and (cfg.mode in ("int4", "dynamic") or cfg.fmt != "qdq") \
            else None
        if gelu is not None:
            bias = const_array(gelu.inputs[1])
        # Sum(y, residual, b): b goes into the integer op too (a 2-input Sum is ~20% cheaper; measured)
        sum_node, sum_bias = None, None
        if t.bias_sum is not None and gelu is None and t.bias_add is None and \
                (cfg.mode in ("int4", "dynamic") or cfg.fmt != "qdq"):
            y_at = [i for i, v in enumerate(t.bias_sum.inputs) if v is node.outputs[0]]
            sum_bias = sum_bias_index(t.bias_sum, y_at[0], w.shape[1]) if len(y_at) == 1 else None
            if sum_bias is not None:
                sum_node, bias = t.bias_sum, const_array(t.bias_sum.inputs[sum_bias])
        out_node = t.bias_add if t.bias_add is not None else node
        if cfg.mode == "int4":
            new = _int4_node(b, t, cfg, w, bias, pre)
            _finish(b, t, out_node, new, gelu, pre)
            used_ms = True
            bump("MatMulNBits")
            if gelu is not None:
                bump("BiasGelu->Gelu")
            if sum_node is not None:
                _drop_sum_input(b, sum_node, sum_bias)
                bump("Sum bias->integer op")
            continue
        q, ws = quantize_weight(w, axis=1, qmax=WEIGHT_QMAX[cfg.weights])
        q, wz = store_weight(q, cfg.weights)  # wz: None for zero
        if t.kind == "attention":
            a = node.attributes
            # qkv_hidden_sizes (equal thirds only, see find_targets) is QAttention's default split
            attrs = {k: a[k].value for k in ("num_heads", "unidirectional", "do_rotary", "mask_filter_value", "scale")
                     if k in a}
            xq, xs, xz = _quantize_activation(b, t, cfg, node)
            qv = b.initializer(f"{pre}_w_q", q)
            sv = b.initializer(f"{pre}_w_scale", ws)
            zv = b.initializer(f"{pre}_w_zp", np.zeros_like(ws, dtype=np.int8) if wz is None else wz)
            named = attention_inputs(node)
            bias_v = named.bias if named.bias is not None else \
                b.initializer(f"{pre}_bias", np.zeros(w.shape[1], np.float32))  # QAttention's bias is required
            inputs = [xq, qv, bias_v, xs, sv, named.mask_index, xz, zv]
            new = b.node(node, "QAttention", inputs, attrs, domain=MS_DOMAIN, name=f"{pre}_qattn")
            _replace_output(g, node.outputs[0], new.outputs[0])
            g.remove(node, safe=True)
            used_ms = True
            bump("QAttention")
            continue
        # matmul
        if cfg.mode == "dynamic":
            qv = b.initializer(f"{pre}_w_q", q)
            sv = b.initializer(f"{pre}_w_scale", ws)
            bv = b.initializer(f"{pre}_bias", bias.astype(np.float32)) if bias is not None else None
            zv = b.initializer(f"{pre}_w_zp", wz) if wz is not None else None
            new = b.node(node, "DynamicQuantizeMatMul", [node.inputs[0], qv, sv, zv, bv], domain=MS_DOMAIN,
                         name=f"{pre}_dqmm")
            used_ms = True
            bump("DynamicQuantizeMatMul")
        elif cfg.fmt == "qdq":
            xq, xs, xz = _quantize_activation(b, t, cfg, node)
            dqx = b.node(node, "DequantizeLinear", [xq, xs, xz], name=f"{pre}_dqx")
            qv = b.initializer(f"{pre}_w_q", q)
            sv = b.initializer(f"{pre}_w_scale", ws)
            wq_in = [qv, sv] if wz is None else [qv, sv, b.initializer(f"{pre}_w_zp", wz)]
            dqw = b.node(node, "DequantizeLinear", wq_in, {"axis": 1}, name=f"{pre}_dqw")
            mm = b.node(node, "MatMul", [dqx.outputs[0], dqw.outputs[0]], name=f"{pre}_mm")
            new = mm
            if bias is not None:
                bv = b.initializer(f"{pre}_bias", bias.astype(np.float32))
                new = b.node(node, "Add", [mm.outputs[0], bv], name=f"{pre}_add")
            bump("QDQ MatMul")
        else:
            xq, xs, xz = _quantize_activation(b, t, cfg, node)
            qv = b.initializer(f"{pre}_w_q", q)
            sv = b.initializer(f"{pre}_w_scale", ws)
            bv = b.initializer(f"{pre}_bias", bias.astype(np.float32)) if bias is not None else None
            zv = b.initializer(f"{pre}_w_zp", wz) if wz is not None else None
            new = b.node(node, "MatMulIntegerToFloat", [xq, qv, xs, sv, xz, zv, bv], domain=MS_DOMAIN,
                         name=f"{pre}_mmi2f")
            used_ms = True
            bump("MatMulIntegerToFloat")
        _finish(b, t, out_node, new, gelu, pre)
        if gelu is not None:
            bump("BiasGelu->Gelu")
        if sum_node is not None:
            _drop_sum_input(b, sum_node, sum_bias)
            bump("Sum bias->integer op")
    if used_ms and MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    # drop float weights nobody reads any more
    for name, v in list(g.initializers.items()):
        if not v.uses() and not v.is_graph_output() and not v.is_graph_input():
            del g.initializers[name]
    return counts



def _drop_sum_input(b: _Builder, node: ir.Node, index: int) -> None:
    """Replace ``Sum`` ``node`` by the Sum of its other inputs (the integer op now adds input ``index``)."""
    new = b.node(node, "Sum", [v for i, v in enumerate(node.inputs) if i != index], name=f"{node.name or 'sum'}_nobias")
    _replace_output(b.graph, node.outputs[0], new.outputs[0])
    b.graph.remove(node, safe=True)


def _dequantize_rows(b: _Builder, before: ir.Node, rows: ir.Value, scale: ir.Value, name: str) -> ir.Value:
    """Gathered int8 rows times their per-column ``scale``: exactly ``DequantizeLinear(rows, scale, axis=-1)``
    (int8 -> float is exact, then one product per element), as Cast + Mul."""
    cast = b.node(before, "Cast", [rows], {"to": ir.DataType.FLOAT}, name=f"{name}_cast")
    return b.node(before, "Mul", [cast.outputs[0], scale], name=name).outputs[0]


def _finish(b: _Builder, t: Target, out_node: ir.Node, new: ir.Node, gelu: ir.Node | None, pre: str) -> None:
    """``new`` (the integer op) takes the place of ``out_node``; a folded BiasGelu becomes ``Gelu`` after it."""
    g = b.graph
    if gelu is not None:
        new.outputs[0].shape, new.outputs[0].type = out_node.outputs[0].shape, out_node.outputs[0].type
        act = b.node(gelu, "Gelu", [new.outputs[0]], domain=MS_DOMAIN, name=f"{pre}_gelu")
        _replace_output(g, gelu.outputs[0], act.outputs[0])
        g.remove(gelu, safe=True)
    else:
        _replace_output(g, out_node.outputs[0], new.outputs[0])
    g.remove([n for n in (t.bias_add, t.node) if n is not None], safe=True)


def _can_unfuse_embed(model: ir.Model, node: ir.Node) -> bool:
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return False
    if default_opset(model) < 15:
        return False
    ins = list(node.inputs) + [None] * (9 - len(node.inputs))
    return all(v is not None for v in (ins[1], ins[3], ins[4], ins[5]))


def _unfuse_embed(b: _Builder, node: ir.Node, qv: ir.Value, sv: ir.Value, pre: str) -> bool:
    """EmbedLayerNormalization with an int8 word table, without dequantizing the whole table per run::

        ids ─Gather(table_q)─Cast─Mul(scale)─Add(position rows)─SkipLayerNormalization(+ segment rows)

    Position rows: ``Gather(P, position_ids)``, or ``P[:seq]`` when the node has no position_ids.
    Refuses (returns False) when the mask_index / embedding_sum outputs are read, below opset 15
    (Shape with start/end), or without segment ids and table (plain LayerNormalization would do; not needed).
    """
    g = b.graph
    if not _can_unfuse_embed(b.model, node):
        return False
    ins = list(node.inputs) + [None] * (9 - len(node.inputs))
    ids, seg, _, pos_table, seg_table, gamma, beta, _, pos_ids = ins[:9]
    eps = node.attributes.get_float("epsilon", 1e-12)
    gq = b.node(node, "Gather", [qv, ids], {"axis": 0}, name=f"{pre}_word_q")
    word = _dequantize_rows(b, node, gq.outputs[0], sv, f"{pre}_word")
    if pos_ids is not None:
        pos = b.node(node, "Gather", [pos_table, pos_ids], {"axis": 0}, name=f"{pre}_pos")
    else:
        seq = b.node(node, "Shape", [ids], {"start": 1, "end": 2}, name=f"{pre}_seq")
        zero = b.initializer(f"{pre}_zero", np.array([0], np.int64))
        pos = b.node(node, "Slice", [pos_table, zero, seq.outputs[0], zero], name=f"{pre}_pos")
    seg_rows = b.node(node, "Gather", [seg_table, seg], {"axis": 0}, name=f"{pre}_seg")
    add = b.node(node, "Add", [word, pos.outputs[0]], name=f"{pre}_word_pos")
    inputs = [add.outputs[0], seg_rows.outputs[0], gamma]
    if beta is not None:
        inputs.append(beta)
    ln = b.node(node, "SkipLayerNormalization", inputs, {"epsilon": eps}, domain=MS_DOMAIN, name=f"{pre}_ln")
    _replace_output(g, node.outputs[0], ln.outputs[0])
    g.remove(node, safe=True)
    if MS_DOMAIN not in b.model.opset_imports:
        b.model.opset_imports[MS_DOMAIN] = 1
    return True


def _int4_node(b: _Builder, t: Target, cfg: QConfig, w: np.ndarray, bias: np.ndarray | None, pre: str) -> ir.Node:
    k, n = w.shape
    q, scales = cfg.int4_q if cfg.int4_q is not None else rtn_int4(w, cfg.block_size)
    packed = pack_int4(q, cfg.block_size)
    qv = b.initializer(f"{pre}_w_q4", packed)
    sv = b.initializer(f"{pre}_w_scale4", np.ascontiguousarray(scales.T).reshape(-1).astype(np.float32))
    inputs = [t.node.inputs[0], qv, sv, None, None]
    if bias is not None:
        inputs.append(b.initializer(f"{pre}_bias", bias.astype(np.float32)))
    attrs = {"K": int(k), "N": int(n), "bits": 4, "block_size": int(cfg.block_size),
             "accuracy_level": int(cfg.accuracy_level)}
    return b.node(t.node, "MatMulNBits", inputs, attrs, domain=MS_DOMAIN, name=f"{pre}_mmnbits")

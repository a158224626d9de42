"""EmbedLayerNormalization: BERT's embedding sum and its LayerNorm as one contrib op.

Matched subgraph (the adds in either order)::

    ids ──Gather(word)──┐
                        Add──┐
    tt  ──Gather(type)──┘    Add──LayerNormalization(gamma, beta, axis=-1)──▶ y
    pos_ids ──Gather(pos)────┘
    pos_ids = Slice(arange(N)[1, N], starts=[0], ends=<dim 1 of ids>, axes=[1])

Rewritten to ``EmbedLayerNormalization(Cast(ids, int32), Cast(tt, int32), word, pos, type, gamma,
beta)`` (com.microsoft), which uses positions 0..S-1 itself.

Refuses (graph unchanged) when: the tables or gamma/beta are not constants or have the wrong rank;
the position ids are not a slice ``[0:S]`` of a constant ``arange`` on axis 1 whose end is
the sequence length of ``ids`` (by shape); ids/tt are not rank 2; LayerNorm does not normalise
the last axis; the tables' widths differ; or an intermediate sum is used elsewhere (rewriter rule).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphopt.onnxscript_compat import check_shape_bool, get_numpy_value
from graphopt.opsets import MS_DOMAIN


def _seq_len_source(ends: ir.Value) -> tuple[ir.Value, int] | None:
    """(tensor, axis) when ``ends`` is ``Shape(t)[axis:axis+1]`` written either way, else None."""
    node = ends.producer()
    if node is None:
        return None
    if node.op_type == "Shape" and node.domain == "":
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", None)
        if end is not None and end - start == 1 and start >= 0:
            return node.inputs[0], start
        return None
    if node.op_type == "Unsqueeze" and len(node.inputs) == 2:
        axes = get_numpy_value(node.inputs[1])
        g = node.inputs[0].producer()
        if axes is None or axes.tolist() not in ([0], 0) or g is None or g.op_type != "Gather":
            return None
        idx = get_numpy_value(g.inputs[1])
        shp = g.inputs[0].producer()
        if idx is None or idx.ndim != 0 or shp is None or shp.op_type != "Shape":
            return None
        if shp.attributes.get_int("start", 0) != 0 or g.attributes.get_int("axis", 0) != 0:
            return None
        return shp.inputs[0], int(idx)
    return None


class EmbedLayerNormFusion(pattern.RewriteRuleClassBase):
    """Word + token-type + position embeddings, then LayerNorm."""

    def pattern(self, op, ids, tt, word, seg, pos, pos_table, starts, ends, axes, gamma, beta):
        w = op.Gather(word, ids, _outputs=["w"])
        t = op.Gather(seg, tt, _outputs=["t"])
        pos_ids = op.Slice(pos_table, starts, ends, axes, _allow_other_inputs=True, _outputs=["pos_ids"])
        p = op.Gather(pos, pos_ids, _outputs=["p"])
        s = op.Add(op.Add(w, t), p)
        return op.LayerNormalization(s, gamma, beta, _allow_other_attributes=True, _outputs=["ln"])

    def check(self, context, ids, tt, word, seg, pos, pos_table, starts, ends, axes, gamma, beta, ln, pos_ids, w, t, p,
              **_):
        result = pattern.MatchResult()
        for g in (w, t, p):
            if g.producer().attributes.get_int("axis", 0) != 0:
                return result.fail("embedding Gather is not on axis 0", g)
        tables = {"word": word, "type": seg, "position": pos}
        widths = set()
        for name, table in tables.items():
            if table.const_value is None:
                return result.fail(f"{name} embedding table is not a constant", table)
            if len(table.const_value.shape) != 2:
                return result.fail(f"{name} embedding table is not 2-D", table)
            widths.add(table.const_value.shape[1])
        if len(widths) != 1:
            return result.fail(f"embedding widths differ: {sorted(widths)}")
        width = widths.pop()
        for name, v in (("gamma", gamma), ("beta", beta)):
            if v is None or v.const_value is None or tuple(v.const_value.shape) != (width,):
                return result.fail(f"LayerNorm {name} is not a constant of shape [{width}]", v)
        node = ln.producer()
        axis = node.attributes.get_int("axis", -1)
        if axis not in (-1, 2):
            return result.fail(f"LayerNormalization normalises axis {axis}, not the last one", ln)
        for name, v in (("input ids", ids), ("token type ids", tt)):
            if v.shape is None or len(v.shape) != 2:
                return result.fail(f"{name} are not rank 2 ([batch, seq])", v)
            if v.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
                return result.fail(f"{name} are {v.dtype}, not int32/int64", v)
        # position ids must be exactly 0..S-1
        slice_node = pos_ids.producer()
        if len(slice_node.inputs) > 4 and slice_node.inputs[4] is not None:
            steps = get_numpy_value(slice_node.inputs[4])
            if steps is None or steps.tolist() != [1]:
                return result.fail("position slice has a step other than 1", pos_ids)
        table = get_numpy_value(pos_table)
        if table is None or table.ndim != 2 or table.shape[0] != 1:
            return result.fail("position ids are not a constant [1, N] table", pos_table)
        if not np.array_equal(table[0], np.arange(table.shape[1])):
            return result.fail("position id table is not 0..N-1", pos_table)
        st, ax = get_numpy_value(starts), get_numpy_value(axes)
        if st is None or st.tolist() != [0] or ax is None or ax.tolist() not in ([1], [-1]):
            return result.fail("position ids are not sliced [0:end] on axis 1", pos_ids)
        src = _seq_len_source(ends)
        if src is None:
            return result.fail("position slice end is not the shape of a [batch, seq] tensor", ends)
        src_val, src_axis = src
        if src_axis != 1:
            return result.fail(f"position slice end is dimension {src_axis}, not the sequence length", ends)
        same = src_val is ids or src_val is tt or (
            src_val.shape is not None and len(src_val.shape) == 2 and src_val.shape[1] == ids.shape[1]
        )
        if not same:
            return result.fail("position slice end is not the sequence length of the input ids", ends)
        bindings: dict = {}
        if not check_shape_bool(bindings, ids, ["B", "S"]) or not check_shape_bool(
            bindings, tt, ["B", "S"]
        ):
            return result.fail("input ids and token type ids differ in shape", tt)
        return result

    def rewrite(self, op, ids, tt, word, seg, pos, gamma, beta, ln, **_):
        eps = ln.producer().attributes.get_float("epsilon", 1e-5)
        ids32 = ids if ids.dtype == ir.DataType.INT32 else op.Cast(ids, to=ir.DataType.INT32)
        tt32 = tt if tt.dtype == ir.DataType.INT32 else op.Cast(tt, to=ir.DataType.INT32)
        out, _mask_index = op.EmbedLayerNormalization(
            ids32, tt32, word, pos, seg, gamma, beta, epsilon=eps, _domain=MS_DOMAIN, _outputs=2
        )
        return out


embed_layer_norm_rules = pattern.RewriteRuleSet(
    [
        *EmbedLayerNormFusion.rule("embed_layer_norm").commute(),
    ]
)

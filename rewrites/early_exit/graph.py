"""``early-exit``: the graph: exit heads and nested ``If`` nodes (``mode=batch``), or confident rows leaving
through ``Compress`` / ``ScatterND`` (``mode=row``); see the package docstring.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from graphopt.data import metrics
from graphopt.engine.registry import GraphoptPass
from graphopt.rewrites.early_exit.heads import Head

PREFIX = "early_exit"


@dataclasses.dataclass
class Exit:
    """One exit: after layer ``layer`` (its output ``value``), with its head."""

    layer: int  # 1-based
    value: ir.Value
    head: Head


def mask_input(model: ir.Model) -> ir.Value | None:
    """The ``[batch, seq]`` attention mask input of the graph, or None."""
    for v in model.graph.inputs:
        if v.name in metrics.MASK_NAMES and v.shape is not None and len(v.shape) == 2:
            return v
    return None


def localize_initializers(main: ir.Graph) -> int:
    """Move each initializer of ``main`` that only nodes of one branch (and the branches nested in it) read
    into that branch's initializers; the number moved.

    ONNX Runtime prepacks constant weights (MLAS's packed GEMM operands, the fused ``Attention``'s) only
    for a kernel's own graph's initializers: a layer moved into an ``If`` branch that reads its weights
    from the outer scope runs them unpacked, and two levels deep the layers took about twice as long at
    batch 1 (MiniLM, 5 nested exits that every row passes through: 13.1 ms against 6.7 ms)."""
    parent: dict[int, ir.Graph | None] = {id(main): None}
    graphs = {id(main): main}
    uses: dict[int, set[int]] = {}
    inits = {id(v): v for v in main.initializers.values()}
    keep = {id(v) for v in [*main.outputs, *main.inputs]}

    def walk(g: ir.Graph) -> None:
        for n in g:
            for v in n.inputs:
                if v is not None and id(v) in inits:
                    uses.setdefault(id(v), set()).add(id(g))
            for attr in n.attributes.values():
                subs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                    list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
                for sub in subs:
                    parent[id(sub)], graphs[id(sub)] = g, sub
                    walk(sub)

    walk(main)

    def chain(gid: int) -> list[int]:
        out = [gid]
        while parent[out[-1]] is not None:
            out.append(id(parent[out[-1]]))
        return out[::-1]  # main first

    moved = 0
    for vid, where in uses.items():
        if vid in keep:
            continue
        paths = [chain(g) for g in where]
        common = 0
        while all(len(p) > common and p[common] == paths[0][common] for p in paths):
            common += 1
        home = graphs[paths[0][common - 1]]
        if home is main:
            continue
        v = inits[vid]
        main.initializers.pop(v.name)
        home.register_initializer(v)
        moved += 1
    return moved


class Builder:
    """Nested If construction for one ``call``."""

    def __init__(self, p: GraphoptPass, model: ir.Model, batch_dim, n_layers: int, threshold: float,
                 pool: str = ""):
        self.p = p
        self.pool = pool or p.pool
        self.model = model
        self.batch_dim = batch_dim
        self.n_layers = n_layers
        self.threshold = threshold
        self.inits: list[ir.Value] = []

    def _const(self, tape: ir.tape.Tape, array: np.ndarray, name: str) -> ir.Value:
        v = tape.initializer(ir.tensor(np.asarray(array), name=name), name=name)
        self.inits.append(v)
        return v

    def _batch_valued(self, v: ir.Value) -> bool:
        return v.shape is not None and len(v.shape) >= 1 and v.shape[0] == self.batch_dim

    def build(self, exits: list[Exit]) -> str:
        g = self.model.graph
        out = g.outputs[0]
        rowmode = self.p.mode == "row"
        # outer values the tail reads must all be batch-indexed (or constant) in row mode
        if rowmode:
            first = exits[0].value.producer()
            tail = list(g)[list(g).index(first) + 1 :]
            for v in self._reads(tail):
                if not self._batch_valued(v):
                    return (f"mode=row: the layers after {exits[0].layer} read '{v.name}' {v.shape}, which "
                            "has no batch axis; use mode=batch")
            if not self._batch_valued(out):
                return f"mode=row: the output '{out.name}' {out.shape} has no batch axis; use mode=batch"
        outs = [out]
        tape = ir.tape.Tape()
        if self.p.exit_output:
            full = self._exit_layer(tape, out, self.n_layers, "full")
            full.name = self.p.exit_output
            g.extend(tape.nodes)
            g.outputs.append(full)
            outs.append(full)
        names = [v.name for v in outs]
        for v in outs:
            v.name = f"{PREFIX}/full/{v.name}"
        mask = mask_input(self.model)
        scope_vals: dict[str, ir.Value] = {"mask": mask} if mask is not None else {}
        preds: list[ir.Value] = []
        container, epilogue = g, []
        for i, ex in enumerate(exits):
            if_outs, container, epilogue, scope_vals, preds = self._split(
                container, ex, outs, epilogue, scope_vals, preds, rowmode)
            if i == 0:
                for v, n in zip(if_outs, names):
                    v.name = n
        for v in self.inits:
            g.register_initializer(v)
        localize_initializers(g)
        common_passes.NameFixPass()(self.model)  # names for the values the tapes left unnamed
        return ""

    def _reads(self, nodes: list[ir.Node]) -> list[ir.Value]:
        inside = {id(v) for n in nodes for v in n.outputs}
        seen, reads = set(), []
        for n in nodes:
            for v in n.inputs:
                if v is None or id(v) in inside or id(v) in seen:
                    continue
                seen.add(id(v))
                if v.is_initializer() or v.const_value is not None:
                    continue
                prod = v.producer()
                if prod is not None and prod.op_type == "Constant":
                    continue
                reads.append(v)
        return reads

    def _exit_layer(self, tape: ir.tape.Tape, like: ir.Value, layer: int, tag: str) -> ir.Value:
        k = self._const(tape, np.array([layer], np.int64), f"{PREFIX}/exit_layer_{tag}_value")
        start = self._const(tape, np.array([0], np.int64), f"{PREFIX}/exit_layer_{tag}_start")
        one = self._const(tape, np.array([1], np.int64), f"{PREFIX}/exit_layer_{tag}_end")
        shape = tape.op("Shape", [like], name=f"{PREFIX}/exit_layer_{tag}_shape")
        b = tape.op("Slice", [shape, start, one])
        v = tape.op("Expand", [k, b], name=f"{PREFIX}/exit_layer_{tag}")
        v.name = f"{PREFIX}/exit_layer_{tag}"
        v.dtype = ir.DataType.INT64
        v.shape = ir.Shape([self.batch_dim])
        return v

    def _head(self, tape: ir.tape.Tape, ex: Exit, h: ir.Value, mask: ir.Value | None) -> ir.Value:
        pre = f"{PREFIX}/L{ex.layer}"
        parts = []
        ax1 = self._const(tape, np.array([1], np.int64), f"{pre}/axis1")
        axl = self._const(tape, np.array([-1], np.int64), f"{pre}/axis_last")
        mf = None if mask is None else tape.op("Cast", [mask], {"to": ir.DataType.FLOAT})
        if "cls" in self.pool:
            idx = self._const(tape, np.array(0, np.int64), f"{pre}/cls_index")
            parts.append(tape.op("Gather", [h, idx], {"axis": 1}))
        if "mean" in self.pool:
            if mf is None:
                parts.append(tape.op("ReduceMean", [h, ax1], {"keepdims": 0}))
            else:
                num = tape.op("ReduceSum", [tape.op("Mul", [h, tape.op("Unsqueeze", [mf, axl])]), ax1], {"keepdims": 0})
                one = self._const(tape, np.array(1.0, np.float32), f"{pre}/one")
                den = tape.op("Max", [tape.op("ReduceSum", [mf, ax1], {"keepdims": 1}), one])
                parts.append(tape.op("Div", [num, den]))
        if "max" in self.pool:
            x = h
            if mf is not None:  # padded tokens -1e9: the max over the real ones
                one = self._const(tape, np.array(1.0, np.float32), f"{pre}/max_one")
                neg = self._const(tape, np.array(-1e9, np.float32), f"{pre}/max_neg")
                x = tape.op("Add", [h, tape.op("Unsqueeze", [tape.op("Mul", [tape.op("Sub", [one, mf]), neg]), axl])])
            parts.append(tape.op("ReduceMax", [x, ax1], {"keepdims": 0}))
        if "last" in self.pool:
            if mask is None:
                idx = self._const(tape, np.array(-1, np.int64), f"{pre}/last_index")
                parts.append(tape.op("Gather", [h, idx], {"axis": 1}))
            else:  # the last real token: index mask.sum - 1 per row (right padding)
                one = self._const(tape, np.array([1], np.int64), f"{pre}/last_one")
                zero = self._const(tape, np.array([0], np.int64), f"{pre}/last_zero")
                two = self._const(tape, np.array([2], np.int64), f"{pre}/last_two")
                three = self._const(tape, np.array([3], np.int64), f"{pre}/last_three")
                mi = tape.op("Cast", [mask], {"to": ir.DataType.INT64})
                last = tape.op("Max", [tape.op("Sub", [tape.op("ReduceSum", [mi, ax1], {"keepdims": 1}), one]), zero])
                shape = tape.op("Shape", [h])
                want = tape.op("Concat", [tape.op("Slice", [shape, zero, one]), one, tape.op("Slice", [shape, two, three])],
                               {"axis": 0})
                idx = tape.op("Expand", [tape.op("Unsqueeze", [last, axl]), want])
                picked = tape.op("GatherElements", [h, idx], {"axis": 1})
                parts.append(tape.op("Squeeze", [picked, ax1]))
        x = parts[0] if len(parts) == 1 else tape.op("Concat", parts, {"axis": 1})
        layers = ex.head.folded()
        for i, (w, b) in enumerate(layers):
            x = tape.op("Gemm", [x, self._const(tape, w, f"{pre}/head_w{i}"), self._const(tape, b, f"{pre}/head_b{i}")])
            if i + 1 < len(layers):
                x = tape.op("Tanh", [x])
        x.name = f"{pre}/logits"
        x.dtype = ir.DataType.FLOAT
        x.shape = ir.Shape([self.batch_dim, layers[-1][0].shape[1]])
        return x

    def _confident(self, tape, ex: Exit, logits: ir.Value, preds: list[ir.Value]) -> tuple[ir.Value, ir.Value]:
        """(per-row confident [B] bool, argmax [B] int64)."""
        pre = f"{PREFIX}/L{ex.layer}"
        pred = tape.op("ArgMax", [logits], {"axis": -1, "keepdims": 0})
        pred.name, pred.dtype, pred.shape = f"{pre}/pred", ir.DataType.INT64, ir.Shape([self.batch_dim])
        crit = self.p.criterion
        if crit == "patience":
            t = int(self.threshold)
            history = preds[len(preds) - (t - 1):] if t > 1 else []
            if t < 1 or len(history) < t - 1:
                conf = tape.op("Equal", [pred, tape.op("Add", [pred, self._const(tape, np.array(1, np.int64), f"{pre}/never")])])
            else:
                conf = None
                for q in history:
                    eq = tape.op("Equal", [q, pred])
                    conf = eq if conf is None else tape.op("And", [conf, eq])
                if conf is None:
                    conf = tape.op("Equal", [pred, pred])
        else:
            inv_t = self._const(tape, np.array(1.0 / ex.head.temperature, np.float32), f"{pre}/inv_temperature")
            tempered = tape.op("Mul", [logits, inv_t])
            axl = self._const(tape, np.array([-1], np.int64), f"{pre}/crit_axis")
            if crit == "maxprob":  # log-odds of the max probability: s_max - logsumexp(s_j, j != argmax)
                n_cls = ex.head.layers[-1][0].shape[1]
                classes = self._const(tape, np.arange(n_cls, dtype=np.int64), f"{pre}/classes")
                top = tape.op("Equal", [tape.op("Unsqueeze", [pred, axl]), classes])
                d = tape.op("Sub", [tempered, tape.op("ReduceMax", [tempered, axl], {"keepdims": 1})])
                low = self._const(tape, np.array(-1e30, np.float32), f"{pre}/masked")
                others = tape.op("ReduceLogSumExp", [tape.op("Where", [top, low, d]), axl], {"keepdims": 0})
                score = tape.op("Neg", [others])
            else:
                prob = tape.op("Softmax", [tempered], {"axis": -1})
                eps = self._const(tape, np.array(1e-12, np.float32), f"{pre}/eps")
                plogp = tape.op("Mul", [prob, tape.op("Log", [tape.op("Add", [prob, eps])])])
                n_cls = ex.head.layers[-1][0].shape[1]
                coef = self._const(tape, np.array(1.0 / math.log(n_cls), np.float32), f"{pre}/inv_log_classes")
                one = self._const(tape, np.array(1.0, np.float32), f"{pre}/one_e")
                score = tape.op("Add", [one, tape.op("Mul", [tape.op("ReduceSum", [plogp, axl], {"keepdims": 0}), coef])])
            th = self._const(tape, np.array(self.threshold, np.float32), f"{pre}/threshold")
            conf = tape.op("GreaterOrEqual", [score, th])
        conf.name, conf.dtype, conf.shape = f"{pre}/confident", ir.DataType.BOOL, ir.Shape([self.batch_dim])
        return conf, pred

    def _split(self, container: ir.Graph, ex: Exit, outs: list[ir.Value], epilogue: list[ir.Node],
               scope_vals: dict[str, ir.Value], preds: list[ir.Value], rowmode: bool):
        """Cut ``container`` after ``ex``'s layer: head + criterion + If(then: exit, else: the rest).

        ``outs`` are the values the rest computes (the model's outputs as this scope sees them), read by
        the scope's ``epilogue`` nodes or, at the top, by the graph outputs. Returns the If outputs and,
        for the next exit, the else graph, its epilogue, and this scope's versions of the tracked values.
        """
        pre = f"{PREFIX}/L{ex.layer}"
        nodes = list(container)
        cut = nodes.index(ex.value.producer())
        ep = {id(n) for n in epilogue}
        tail = [n for n in nodes[cut + 1 :] if id(n) not in ep]
        container.remove(tail)
        container.remove(epilogue)
        tape = ir.tape.Tape()
        logits = self._head(tape, ex, ex.value, scope_vals.get("mask"))
        conf, pred = self._confident(tape, ex, logits, preds)
        preds = preds + [pred]
        all_conf = tape.op("Cast", [tape.op("ReduceMin", [tape.op("Cast", [conf], {"to": ir.DataType.INT32})],
                                             {"keepdims": 0})], {"to": ir.DataType.BOOL})
        all_conf.name = f"{pre}/all_confident"
        # then: this exit's results
        then_tape = ir.tape.Tape()
        then_outs = [then_tape.op("Identity", [logits])]
        then_outs[0].name = f"{pre}/then/logits"
        if len(outs) > 1:
            then_outs.append(then_tape.op("Identity", [self._exit_layer(then_tape, logits, ex.layer, f"L{ex.layer}")]))
            then_outs[-1].name = f"{pre}/then/exit_layer"
        then_g = ir.Graph([], then_outs, nodes=then_tape.nodes, name=f"{pre}_exit")
        # else: the rest of the layers (row mode: on the unconfident rows only, scattered back in order)
        et = ir.tape.Tape()
        new_scope, new_preds = scope_vals, preds
        if rowmode:
            keep = et.op("Not", [conf])
            keep.name = f"{pre}/keep"
            idx = et.op("Transpose", [et.op("NonZero", [keep])], {"perm": [1, 0]})
            idx.name = f"{pre}/keep_index"
            compressed: dict[int, ir.Value] = {}

            def squeeze(v: ir.Value) -> ir.Value:
                if id(v) not in compressed:
                    c = et.op("Compress", [v, keep], {"axis": 0})
                    c.name = f"{pre}/rows/{v.name.split('/')[-1]}"
                    c.dtype, c.shape = v.dtype, v.shape
                    compressed[id(v)] = c
                return compressed[id(v)]

            inside = {id(n) for n in tail}
            for v in self._reads(tail):
                c = squeeze(v)
                for user, j in list(v.uses()):
                    if id(user) in inside:
                        user.replace_input_with(j, c)
            new_scope = {k: squeeze(v) for k, v in scope_vals.items()}
            new_preds = [squeeze(v) for v in preds]
            pt = ir.tape.Tape()
            bases = [logits] + ([self._exit_layer(pt, logits, ex.layer, f"L{ex.layer}_base")] if len(outs) > 1 else [])
            new_epilogue_outs = []
            for base, v in zip(bases, outs):
                s = pt.op("ScatterND", [base, idx, v])
                s.name = f"{pre}/else/{v.name.split('/')[-1]}"
                s.dtype = v.dtype
                s.shape = ir.Shape([self.batch_dim] + list(v.shape[1:])) if v.shape is not None else None
                new_epilogue_outs.append(s)
            new_epilogue = list(pt.nodes)
        else:
            new_epilogue_outs = []
            for v in outs:
                o = et.op("Identity", [v])
                o.name = f"{pre}/else/{v.name.split('/')[-1]}"
                o.dtype, o.shape = v.dtype, v.shape
                new_epilogue_outs.append(o)
            new_epilogue = list(et.nodes)
            et = ir.tape.Tape()
        else_g = ir.Graph([], new_epilogue_outs, nodes=list(et.nodes) + tail + new_epilogue, name=f"{pre}_deeper")
        if_node = ir.node("If", [all_conf], {"then_branch": then_g, "else_branch": else_g},
                          num_outputs=len(outs), name=f"{pre}/If")
        for o, ref in zip(if_node.outputs, outs):
            o.name = f"{pre}/out/{ref.name.split('/')[-1]}"
            o.dtype = ref.dtype
            o.shape = ir.Shape([self.batch_dim] + list(ref.shape[1:])) if ref.shape is not None else None
        # this scope now reads the If's outputs where it read the rest's
        swap = {id(ref): o for ref, o in zip(outs, if_node.outputs)}
        for n in epilogue:
            for j, v in enumerate(n.inputs):
                if v is not None and id(v) in swap:
                    n.replace_input_with(j, swap[id(v)])
        container.extend(list(tape.nodes) + [if_node] + list(epilogue))
        if container is self.model.graph:
            for j in range(len(container.outputs)):
                if id(container.outputs[j]) in swap:
                    container.outputs[j] = swap[id(container.outputs[j])]
        return list(if_node.outputs), else_g, new_epilogue, new_scope, new_preds

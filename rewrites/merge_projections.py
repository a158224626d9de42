"""``merge-projections``: sibling projections of one input become one wider projection and a ``Split`` (exact).

Attention's query, key and value projections, and a gated MLP's gate and up projections, read the same
activations. Their constant weights are concatenated along N, so one kernel reads ``x`` once::

    x ─┬─ MatMul(W_q) ─(Add b_q)─▶ q          x ── MatMul([W_q|W_k|W_v]) ─(Add [b_q|b_k|b_v])─ Split(-1) ─▶ q, k, v
       ├─ MatMul(W_k) ─(Add b_k)─▶ k    =>
       └─ MatMul(W_v) ─(Add b_v)─▶ v

Three forms are merged, each only with its own kind:

1. ``MatMul(x, W_i)``, W_i a constant ``[K, N_i]``, optionally followed by ``Add(·, b_i)`` with a constant
   bias ``[N_i]`` (leading 1s allowed); biases merge when every sibling has one, else the Adds stay after
   the ``Split``.
2. ``com.microsoft.MatMulNBits(x, B_i, scales_i[, zero_points_i][, g_idx][, bias_i])`` with equal K, bits,
   block_size, accuracy_level, input dtypes and the same optional inputs (an equal ``g_idx``): ``B``
   ``[N, blocks, blob]``, scales and zero points (per column ``ceil(blocks·bits/8)`` packed bytes, or one
   value per block) and bias are concatenated column by column.
3. The exact GGUF Q4_1 form (``exporters/gguf_blocks.py``)::

       MatMulNBits(x, q, d, 0) + ReduceSum(Reshape(x, [.., K/32, 32]), -1) @ m_iᵀ

   merges the MatMulNBits as in 2 and the correction MatMuls along N (``m_iᵀ`` ``[K/32, N_i]``), over one
   block sum of ``x`` (the siblings' block sums are the same computation; the first one is kept).

Every output column is computed by the same arithmetic as before. A graph output keeps its name.

Then (option ``pack_gqa``, on by default) a ``Split`` whose three outputs are exactly the query, key and value
of one ``com.microsoft.GroupQueryAttention`` (sizes ``H·D, Hkv·D, Hkv·D`` from its ``num_heads`` and
``kv_num_heads``, read nowhere else) is dropped and the attention takes the packed input
(``query = [B, S, (H + 2·Hkv)·D]``, key and value omitted), which ONNX Runtime computes identically::

    QKV ── Split ─▶ q, k, v ── GroupQueryAttention(q, k, v, …)   =>   QKV ── GroupQueryAttention(QKV, -, -, …)

Refuses (graph unchanged for that input, the reason in the notes with ``--explain``) when a weight (or
scale, zero point, bias) is not a constant or is read by another node too (merging would store it twice),
when shapes, dtypes or attributes differ, when a branch's inner value (the MatMul before its bias, the
MatMulNBits before its correction) is read elsewhere or is a graph output (the branch is then merged
without its Add), or when fewer than two siblings are left. Only the main graph is rewritten.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.rewrites.common.names import Names

MS_DOMAIN = "com.microsoft"
_NBITS_ATTRS = ("K", "bits", "block_size", "accuracy_level")


@dataclasses.dataclass
class _Branch:
    """One projection of ``x``: its head node, its optional Add, and the value the rest of the graph reads."""

    head: ir.Node
    n: int
    out: ir.Value
    tail: ir.Node | None = None  # the Add after the head (bias or correction)
    bias: ir.Value | None = None  # plain MatMul: the constant bias of ``tail``
    corr: ir.Node | None = None  # GGUF form: the correction MatMul(block sums, mins_t)


def _single_use(v: ir.Value) -> ir.Node | None:
    uses = v.uses()
    if len(uses) != 1 or v.is_graph_output():
        return None
    return uses[0][0]


def _other_input(add: ir.Node, v: ir.Value) -> ir.Value | None:
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    a, b = add.inputs
    return b if a is v else a if b is v else None


def _owned(v: ir.Value | None) -> bool:
    """A constant read by exactly one node (so merging moves it instead of copying it)."""
    return v is not None and v.const_value is not None and not v.is_graph_input() and not v.is_graph_output() \
        and len(v.uses()) == 1


def _matmul_branch(node: ir.Node) -> _Branch | str:
    w = node.inputs[1]
    if w is None or w.const_value is None:
        return "weight is not a constant"
    if not _owned(w):
        return f"weight '{w.name}' is read by other nodes too (merging would store it twice)"
    if len(w.const_value.shape) != 2:
        return f"weight '{w.name}' is not 2-D"
    n = int(w.const_value.shape[1])
    out = node.outputs[0]
    branch = _Branch(node, n, out)
    add = _single_use(out)
    bias = _other_input(add, out) if add is not None else None
    if bias is not None and _owned(bias) and bias.const_value.dtype == w.const_value.dtype:
        shape = tuple(bias.const_value.shape)
        if shape and shape[-1] == n and all(d == 1 for d in shape[:-1]) and len(shape) <= max(1, _rank(out)):
            branch.tail, branch.bias, branch.out = add, bias, add.outputs[0]
    return branch


def _rank(v: ir.Value) -> int:
    return len(v.shape) if v.shape is not None else 0


def _nbits_branch(node: ir.Node) -> _Branch | str:
    ins = list(node.inputs) + [None] * (6 - len(node.inputs))
    for i, v in enumerate(ins[1:], 1):
        if v is None:
            continue
        if v.const_value is None:
            return f"input {i} '{v.name}' is not a constant"
        if i != 4 and not _owned(v):  # g_idx ([K]) may be shared: it stays one tensor
            return f"input {i} '{v.name}' is read by other nodes too (merging would store it twice)"
    if any(node.attributes.get(a) is None for a in ("K", "N")):
        return "no K/N attributes"
    n = node.attributes.get_int("N")
    b = ins[1].const_value
    if len(b.shape) != 3 or int(b.shape[0]) != n:
        return f"B '{ins[1].name}' is not [N, blocks, blob]"
    out = node.outputs[0]
    branch = _Branch(node, n, out)
    add = _single_use(out)
    c = _other_input(add, out) if add is not None else None
    corr = c.producer() if c is not None else None
    if corr is not None and corr.op_type == "MatMul" and corr.domain in ("", "ai.onnx") and _single_use(c) is add:
        mins = corr.inputs[1]
        if corr.inputs[0] is not None and _owned(mins) and len(mins.const_value.shape) == 2 \
                and int(mins.const_value.shape[1]) == n:
            branch.tail, branch.corr, branch.out = add, corr, add.outputs[0]
    return branch


def _sums_key(v: ir.Value) -> tuple:
    """Equal keys: the same block sums of ``x`` (one value, or ReduceSum(Reshape(x, shape), axes) alike)."""
    rs = v.producer()
    if rs is None or rs.op_type != "ReduceSum" or len(rs.inputs) != 2 or rs.inputs[1] is None:
        return ("value", id(v))
    rh = rs.inputs[0].producer() if rs.inputs[0] is not None else None
    axes, shape = _const_any(rs.inputs[1]), _const_any(rh.inputs[1]) if rh is not None and len(rh.inputs) == 2 else None
    if rh is None or rh.op_type != "Reshape" or axes is None or shape is None or rh.attributes.get_int("allowzero", 0):
        return ("value", id(v))
    return ("block_sums", id(rh.inputs[0]), shape.tobytes(), axes.tobytes(), rs.attributes.get_int("keepdims", 1),
            rs.attributes.get_int("noop_with_empty_axes", 0))


def _const_any(v: ir.Value | None) -> np.ndarray | None:
    return None if v is None or v.const_value is None else np.asarray(v.const_value.numpy())


def _key(br: _Branch) -> tuple:
    """Siblings with equal keys merge."""
    h = br.head
    if h.op_type == "MatMul":
        w = h.inputs[1].const_value
        return ("MatMul", w.dtype, int(w.shape[0]))
    ins = list(h.inputs) + [None] * (6 - len(h.inputs))
    attrs = tuple(h.attributes.get_int(a, -1) for a in _NBITS_ATTRS)
    shapes = tuple(None if v is None else (v.const_value.dtype, len(v.const_value.shape)) for v in ins[1:])
    b = ins[1].const_value
    g_idx = None if ins[4] is None else _const_any(ins[4]).tobytes()
    mins = None if br.corr is None else br.corr.inputs[1].const_value
    sums = None if mins is None else (_sums_key(br.corr.inputs[0]), mins.dtype, int(mins.shape[0]))
    return ("MatMulNBits", attrs, tuple(b.shape[1:]), shapes, g_idx, sums)


def _per_column(v: ir.Value, n: int) -> np.ndarray:
    return v.const_value.numpy().reshape(n, -1)


class _Builder(Names):
    """New initializers and nodes with names unique in ``graph``."""

    def node(self, op: str, inputs, stem: str, *, domain: str = "", attributes=None, outputs: int = 1) -> ir.Node:
        nd = ir.node(op, inputs, domain=domain, attributes=attributes, name=self.unique(stem + "/" + op),
                     num_outputs=outputs)
        for o in nd.outputs:
            o.name = self.unique(f"{stem}.{op.lower()}")
        return nd


def _merge(graph: ir.Graph, x: ir.Value, branches: list[_Branch], bld: _Builder, split_opset: int) -> str:
    """Rewrite one group in place; what it did (a note)."""
    first = branches[0]
    stem = (first.head.name or "proj").rsplit("/", 1)[0] + "_merged"
    ns = [b.n for b in branches]
    total = sum(ns)
    nodes: list[ir.Node] = []
    h = first.head
    if h.op_type == "MatMul":
        w = bld.initializer(stem + ".weight", np.concatenate([b.head.inputs[1].const_value.numpy() for b in branches], 1))
        head = bld.node("MatMul", [x, w], stem)
    else:
        ins = list(h.inputs) + [None] * (6 - len(h.inputs))
        new_ins: list[ir.Value | None] = [x]
        labels = ("q", "scales", "zero_points", "g_idx", "bias")
        for i in range(1, 6):
            v = ins[i]
            if v is None:
                new_ins.append(None)
            elif i == 4:
                new_ins.append(v)  # g_idx: equal in every sibling (part of the key)
            else:
                parts = [_per_column(b.head.inputs[i], b.n) for b in branches]
                arr = np.concatenate(parts, 0)
                shape = (total, *v.const_value.shape[1:]) if len(v.const_value.shape) > 1 else (arr.size,)
                new_ins.append(bld.initializer(f"{stem}.{labels[i - 1]}", arr.reshape(shape)))
        while new_ins and new_ins[-1] is None:
            new_ins.pop()
        attrs = {a.name: a.value for a in h.attributes.values()}
        attrs["N"] = total
        head = bld.node("MatMulNBits", new_ins, stem, domain=MS_DOMAIN, attributes=attrs)
    nodes.append(head)
    result = head.outputs[0]
    dtype = first.head.outputs[0].dtype or x.dtype
    merged_tail = all(b.tail is not None for b in branches)
    if merged_tail and first.bias is not None:
        bias = bld.initializer(stem + ".bias", np.concatenate([b.bias.const_value.numpy().reshape(-1) for b in branches]))
        nodes.append(bld.node("Add", [result, bias], stem))
        result = nodes[-1].outputs[0]
    elif merged_tail:
        mins = bld.initializer(stem + ".mins_t", np.concatenate([b.corr.inputs[1].const_value.numpy() for b in branches], 1))
        nodes.append(bld.node("MatMul", [first.corr.inputs[0], mins], stem + "/min_correction"))
        nodes.append(bld.node("Add", [result, nodes[-1].outputs[0]], stem))
        result = nodes[-1].outputs[0]
    shape = ir.Shape([*x.shape[:-1], total]) if x.shape is not None and len(x.shape) >= 1 else None
    for nd in nodes:
        if dtype is not None:
            nd.outputs[0].dtype = dtype
        if shape is not None:
            nd.outputs[0].shape = shape
    sizes = np.array(ns, np.int64)
    if split_opset >= 13:
        split = bld.node("Split", [result, bld.initializer(stem + ".split", sizes)], stem, attributes={"axis": -1},
                         outputs=len(branches))
    else:
        split = bld.node("Split", [result], stem, attributes={"axis": -1, "split": ns}, outputs=len(branches))
    nodes.append(split)
    graph.insert_before(first.head, nodes)
    old: list[ir.Node] = []
    for b, new in zip(branches, split.outputs, strict=True):
        out = b.out if merged_tail else b.head.outputs[0]
        if out.dtype or dtype:
            new.dtype = out.dtype or dtype
        if out.shape is not None:
            new.shape = out.shape
        was_output = out.is_graph_output()
        out.replace_all_uses_with(new, replace_graph_outputs=True)
        if was_output:  # a graph output keeps its name
            name = out.name
            out.name = bld.unique(name + ".unmerged")
            new.name = name
        old += [nd for nd in (b.tail if merged_tail else None, b.corr if merged_tail else None, b.head) if nd is not None]
    consts = [v for nd in old for v in nd.inputs if v is not None and v.const_value is not None]
    sums = [b.corr.inputs[0] for b in branches[1:]] if merged_tail and first.corr is not None else []
    graph.remove(old, safe=True)
    _drop_dead(graph, sums)
    for v in consts:
        if not v.uses() and v.name in graph.initializers and not v.is_graph_output():
            graph.initializers.pop(v.name)
    kind = "MatMulNBits" if h.op_type != "MatMul" else "MatMul"
    extra = " + bias" if merged_tail and first.bias is not None else " + block-sum correction" if merged_tail else ""
    return f"merged {len(branches)} {kind}{extra} of '{x.name}' (N {'+'.join(map(str, ns))} = {total})"


def _drop_dead(graph: ir.Graph, values: list[ir.Value]) -> None:
    """Remove the producers of ``values`` (and their producers) that nothing reads any more."""
    todo = list(values)
    while todo:
        v = todo.pop()
        nd = v.producer()
        if nd is None or nd.graph is not graph or any(o.uses() or o.is_graph_output() for o in nd.outputs):
            continue
        ins = [i for i in nd.inputs if i is not None]
        graph.remove(nd, safe=True)
        todo += ins
        for i in ins:
            if i.const_value is not None and not i.uses() and i.name in graph.initializers \
                    and not i.is_graph_input() and not i.is_graph_output():
                graph.initializers.pop(i.name)


def _candidates(x: ir.Value, graph: ir.Graph) -> list[ir.Node]:
    seen, out = set(), []
    for node, idx in x.uses():
        if idx != 0 or node.graph is not graph or id(node) in seen:
            continue
        if (node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2) or \
                (node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN):
            seen.add(id(node))
            out.append(node)
    return out


def _pack_gqa(graph: ir.Graph) -> int:
    """GroupQueryAttention fed by one Split's three outputs takes the Split's input packed; how many."""
    done = 0
    for node in list(graph):
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN or len(node.inputs) < 3:
            continue
        q, k, v = node.inputs[:3]
        split = q.producer() if q is not None else None
        if split is None or split.op_type != "Split" or split.domain not in ("", "ai.onnx") \
                or list(split.outputs) != [q, k, v] or len(split.inputs) != 2:
            continue
        if any(len(o.uses()) != 1 or o.is_graph_output() for o in split.outputs):
            continue
        sizes, x = _const_any(split.inputs[1]), split.inputs[0]
        heads, kv_heads = node.attributes.get_int("num_heads", 0), node.attributes.get_int("kv_num_heads", 0)
        if sizes is None or sizes.shape != (3,) or not heads or not kv_heads or _rank(x) not in (0, 3):
            continue
        axis = split.attributes.get_int("axis", 0)
        if axis not in (-1, 2) or sizes[0] % heads or sizes[0] // heads * kv_heads != sizes[1] or sizes[1] != sizes[2]:
            continue
        node.replace_input_with(0, x)
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)
        sizes_value = split.inputs[1]
        graph.remove(split, safe=True)
        if sizes_value is not None and sizes_value.is_initializer() and not sizes_value.uses() \
                and not sizes_value.is_graph_output():
            graph.initializers.pop(sizes_value.name)  # the split sizes are read by nothing now
        done += 1
    return done


class MergeProjectionsPass(GraphoptPass):
    """Sibling projections of one input (Q/K/V, gate/up; MatMul, MatMulNBits, GGUF Q4_1) merged into one + Split."""

    name = "merge-projections"
    exact = True
    in_default_recipe = False  # a decoder recipe's step (after fuse); encoders' Q/K/V are packed by fuse already
    emits = ("com.microsoft::MatMulNBits",)

    def __init__(self, *, pack_gqa: bool = True):
        super().__init__()
        self.pack_gqa = pack_gqa

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 18))
        bld = _Builder(graph)
        notes: list[str] = []
        counts: dict[str, int] = {}
        xs: list[ir.Value] = []
        for node in graph:
            if node.op_type in ("MatMul", "MatMulNBits") and node.inputs and node.inputs[0] is not None \
                    and node.inputs[0] not in xs:
                xs.append(node.inputs[0])
        for x in xs:
            groups: dict[tuple, list[_Branch]] = {}
            cands = _candidates(x, graph)
            for node in cands:
                br = _matmul_branch(node) if node.op_type == "MatMul" else _nbits_branch(node)
                if isinstance(br, str):
                    if ctx.explain and len(cands) > 1:
                        notes.append(f"{node.op_type} '{node.name}' on '{x.name}' not merged: {br}")
                    continue
                groups.setdefault(_key(br), []).append(br)
            for key, branches in groups.items():
                if len(branches) < 2:
                    if ctx.explain and len(cands) > 1:
                        notes.append(f"{branches[0].head.op_type} '{branches[0].head.name}' on "
                                     f"'{x.name}': no sibling with the same weight kind, shape and attributes")
                    continue
                if key[0] == "MatMul" and not all(b.tail is not None for b in branches):
                    for b in branches:  # the Adds stay after the Split
                        b.tail, b.bias, b.out = None, None, b.head.outputs[0]
                notes.append(_merge(graph, x, branches, bld, opset))
                counts[key[0]] = counts.get(key[0], 0) + 1
        packed = _pack_gqa(graph) if self.pack_gqa else 0
        if packed:
            counts["packed_gqa"] = packed
            notes.append(f"{packed} GroupQueryAttention take the packed QKV instead of a Split's three outputs")
        if not counts:
            if ctx.explain and not notes:
                notes.append("no input is read by two or more constant-weight projections")
            return PassResult(model, False, notes=notes)
        graph.sort()
        if ctx.explain:
            return PassResult(model, True, notes=notes, rule_counts=counts)
        merged = sum(v for k, v in counts.items() if k != "packed_gqa")
        gqa = f"; {packed} GroupQueryAttention take the packed QKV" if packed else ""
        return PassResult(model, True, notes=[f"{merged} groups of sibling projections merged{gqa}"], rule_counts=counts)


register(MergeProjectionsPass)

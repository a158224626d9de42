"""``cut-positions``: compute the last layer only for the sequence positions the outputs read (exact).

A classifier pooled on its first token reads ``H[:, 0]`` of the last layer output ``H[B, S, H]``; a causal
LM whose output is ``logits[:, -1:]`` reads the last position only. Everything between the attention and
that read is position-wise (output projection, residual, LayerNorm, FFN), and the attention's scores and
context rows are per query. The pass moves the position read up the graph, through position-wise ops,
as a one-position ``Slice``:

    H = LN(FFN(LN(x + Wo·softmax(Q·Kᵀ + M)·V)));  Gather(H, 0, axis=1)
    becomes   H₀ = LN(FFN(LN(x[:, 0:1] + Wo·softmax(Q[:, :, 0:1]·Kᵀ + M[..., 0:1, :])·V)));  Gather(H₀, 0, axis=1)

Ops it moves the read through (each only when every consumer of its output is itself moved, so no work
is duplicated): elementwise unary and binary ops (an operand broadcast on the sliced axis is used
whole), ``Where``, ``LayerNormalization`` / ``Softmax`` / reductions (keepdims) over other axes, ``MatMul`` (rows of the left
operand; columns of the right), ``Transpose``, ``Reshape`` keeping the axes up to the sliced one. Elsewhere it inserts the ``Slice`` (keys and values stay
whole). Every cut is exact: the same arithmetic on fewer rows.

Option ``last_token_logits=true`` (changes the output contract, so off by default): a causal LM's output
``NAME[B, S, V]`` is replaced by ``NAME_last[B, 1, V]`` (its last position), and the cut applies to it;
``output=NAME`` picks the output when several are ``[B, S, V]``. The result's ``sliced_outputs`` tells
the pipeline to verify ``NAME_last`` against the last position of ``NAME``'s reference.

Refuses (graph unchanged, reason in the notes) when no one-position ``Gather`` / ``Slice`` (constant
index, input of rank >= 3, that input read nowhere else) follows a position-wise op: for example mean
pooling, which uses every position.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError

_UNARY = {"Gelu", "Tanh", "Relu", "Erf", "Sigmoid", "Cast", "Neg", "Sqrt", "Identity", "IsNaN", "Not", "Exp",
          "Reciprocal", "FastGelu", "BiasGelu", "QuickGelu", "Softplus", "HardSigmoid", "Abs"}
_BINARY = {"Add", "Mul", "Sub", "Div", "Pow", "Where", "Max", "Min", "And", "Or", "Equal"}
_BIG = np.iinfo(np.int64).max


def _const(v: ir.Value | None) -> np.ndarray | None:
    if v is None:
        return None
    c = v.const_value
    if c is None and v.producer() is not None and v.producer().op_type == "Constant":
        attr = v.producer().attributes.get("value")
        c = attr.value if attr is not None else None
    return None if c is None else np.asarray(c.numpy())


def _rank(v: ir.Value) -> int | None:
    return None if v.shape is None else len(v.shape)


def _dim(v: ir.Value, i: int):
    return v.shape[i]


class _Read:
    """A one-position read of ``value`` on ``axis``: ``start`` (``-1``: the last position)."""

    def __init__(self, node: ir.Node, value: ir.Value, axis: int, start: int):
        self.node, self.value, self.axis, self.start = node, value, axis, start


def _find_read(node: ir.Node) -> _Read | str:
    """The output-producing node as a one-position read, or why not."""
    if node.domain not in ("", "ai.onnx"):
        return f"{node.op_type} is not a position read"
    x = node.inputs[0]
    r = _rank(x) if x is not None else None
    if r is None or r < 3:
        return f"{node.op_type} input has no known rank >= 3"
    if node.op_type == "Gather":
        axis = node.attributes.get_int("axis", 0) % r
        idx = _const(node.inputs[1])
        if idx is None or idx.size != 1:
            return "Gather index is not one constant position"
        return _Read(node, x, axis, int(idx.reshape(-1)[0]))
    if node.op_type == "Slice":
        starts, ends = _const(node.inputs[1]), _const(node.inputs[2])
        axes = _const(node.inputs[3]) if len(node.inputs) > 3 else np.arange(r)
        steps = _const(node.inputs[4]) if len(node.inputs) > 4 else None
        if starts is None or ends is None or axes is None or starts.size != 1 or (steps is not None and steps.size and int(steps[0]) != 1):
            return "Slice is not a one-axis constant slice"
        s, e, axis = int(starts[0]), int(ends[0]), int(axes[0]) % r
        if s == -1 and e >= 2**31 or (s >= 0 and e == s + 1):
            return _Read(node, x, axis, s)
        return "Slice reads more than one position"
    return f"{node.op_type} is not a one-position Gather/Slice"


class _Cut:
    """One call's work: which nodes move under the read, and the rewrite."""

    def __init__(self, model: ir.Model, read: _Read):
        self.model, self.read = model, read
        self.want: dict[ir.Value, int] = {read.value: read.axis}
        self.moved: dict[ir.Node, dict[ir.Value, int]] = {}  # node -> wanted axis per sliced input
        self.new_shape: dict[ir.Node, np.ndarray] = {}  # moved Reshapes: their shape input, leading axes copied

    def _input_axes(self, node: ir.Node, axis: int) -> dict[ir.Value, int] | None:
        out = node.outputs[0]
        r = _rank(out)
        if r is None or len(node.outputs) != 1 or node.domain not in ("", "ai.onnx"):
            return None
        op = node.op_type
        if op in _UNARY:
            return {node.inputs[0]: axis}
        if op in _BINARY:
            res = {}
            for x in node.inputs:
                rx = _rank(x) if x is not None else None
                if rx is None:
                    return None
                d = axis - (r - rx)
                if d < 0 or _dim(x, d) == 1:
                    continue  # broadcast on the sliced axis: used whole
                if x in res and res[x] != d:
                    return None
                res[x] = d
            return res
        if op == "LayerNormalization":
            a = node.attributes.get_int("axis", -1) % r
            return {node.inputs[0]: axis} if axis < a and len(node.outputs) == 1 else None
        if op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2"):
            x = node.inputs[0]
            rx = _rank(x)
            axes = _const(node.inputs[1]) if len(node.inputs) > 1 else None
            if axes is None:
                axes = node.attributes.get_ints("axes", None)
            if rx is None or axes is None or rx != r or not node.attributes.get_int("keepdims", 1):
                return None
            return {x: axis} if axis not in {int(a) % rx for a in np.asarray(axes).reshape(-1)} else None
        if op == "Softmax":
            a = node.attributes.get_int("axis", -1) % r
            return {node.inputs[0]: axis} if axis != a else None
        if op == "Transpose":
            perm = node.attributes.get_ints("perm", None)
            return {node.inputs[0]: list(perm)[axis]} if perm is not None else None
        if op == "Reshape":
            x = node.inputs[0]
            if x is None or x.shape is None or len(x.shape) <= axis:
                return None
            keep, rest = list(out.shape)[: axis + 1], list(out.shape)[axis + 1:]
            if [str(d) for d in keep] != [str(d) for d in list(x.shape)[: axis + 1]] or "None" in map(str, keep) \
                    or not all(isinstance(d, int) for d in rest):
                return None
            # leading axes are copied (0), the rest is static: exact on the sliced input
            self.new_shape[node] = np.array([0] * (axis + 1) + rest, np.int64)
            return {x: axis}
        if op == "MatMul":
            a, b = node.inputs
            ra, rb = _rank(a), _rank(b)
            if ra is None or rb is None or ra < 2 or rb < 2:
                return None
            if axis == r - 2:
                return {a: ra - 2}
            if axis == r - 1:
                return {b: rb - 1}
            res = {}
            for x, rx in ((a, ra), (b, rb)):
                d = axis - (r - rx)
                if d >= 0 and _dim(x, d) != 1:
                    res[x] = d
            return res if a is not b else None
        return None

    def _flat_gemm(self, unflat: ir.Node, axis: int) -> bool:
        """``Reshape([B, S, K] → [B*S, K]) → Gemm → Reshape(→ [B, S, N])`` (GPT-2's Conv1D export) as one
        row-wise op: cut on the sequence axis by giving both Reshapes shapes that keep one position."""
        if unflat.op_type != "Reshape" or axis != 1 or _rank(unflat.outputs[0]) != 3:
            return False
        gemm = unflat.inputs[0].producer() if unflat.inputs[0] is not None else None
        if gemm is None or gemm.op_type != "Gemm" or gemm.attributes.get_int("transA", 0) or len(gemm.inputs[0].uses()) != 1 \
                or len(gemm.outputs[0].uses()) != 1:
            return False
        if len(gemm.inputs) > 2 and gemm.inputs[2] is not None and (_rank(gemm.inputs[2]) or 0) > 1:
            return False  # a per-row C would need slicing too
        flat = gemm.inputs[0].producer()
        if flat is None or flat.op_type != "Reshape" or flat.inputs[0] is None or _rank(flat.inputs[0]) != 3:
            return False
        x, out = flat.inputs[0], unflat.outputs[0]
        k, n = x.shape[2], out.shape[2]
        if not isinstance(k, int) or not isinstance(n, int) or str(x.shape[0]) != str(out.shape[0]) \
                or str(x.shape[1]) != str(out.shape[1]) or str(x.shape[0]) == "None" or x in self.want:
            return False
        self.moved[unflat], self.moved[gemm], self.moved[flat] = {}, {}, {x: 1}
        self.new_shape[unflat] = np.array([-1, 1, n], np.int64)
        self.new_shape[flat] = np.array([-1, k], np.int64)
        self.want[x] = 1
        return True

    def plan(self) -> None:
        graph = self.model.graph
        outputs = set(graph.outputs)
        for node in reversed(list(graph)):
            if node is self.read.node or len(node.outputs) != 1:
                continue
            out = node.outputs[0]
            if node in self.moved or out not in self.want or out in outputs:
                continue
            if any(u.node is not self.read.node and u.node not in self.moved for u in out.uses()):
                continue
            if self._flat_gemm(node, self.want[out]):
                continue
            axes = self._input_axes(node, self.want[out])
            if axes is None or any(x in self.want and self.want[x] != d for x, d in axes.items()):
                continue
            self.moved[node] = axes
            self.want.update(axes)

    def rewrite(self) -> int:
        graph = self.model.graph
        start = self.read.start
        sliced: dict[ir.Value, ir.Value] = {}
        made = 0

        def const(arr: np.ndarray, name: str) -> ir.Value:
            t = ir.tensor(arr, name=name)
            v = ir.Value(name=name, const_value=t, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.INT64))
            graph.register_initializer(v)
            return v

        base = f"cut_positions_{self.read.value.name}"
        starts = const(np.array([start], np.int64), f"{base}_starts")
        ends = const(np.array([_BIG if start == -1 else start + 1], np.int64), f"{base}_ends")
        axis_vals: dict[int, ir.Value] = {}

        def frontier(v: ir.Value, axis: int) -> ir.Value:
            if v not in sliced:
                if axis not in axis_vals:
                    axis_vals[axis] = const(np.array([axis], np.int64), f"{base}_axis{axis}")
                n = ir.node("Slice", [v, starts, ends, axis_vals[axis]], name=f"{base}_slice_{v.name}")
                n.outputs[0].name = f"{v.name}_cut"
                n.outputs[0].dtype = v.dtype
                graph.insert_before(self._first_use(v), n)
                sliced[v] = n.outputs[0]
            return sliced[v]

        for node in list(graph):  # topological order
            if node not in self.moved:
                continue
            axes = self.moved[node]
            for i, x in enumerate(node.inputs):
                if x in axes:
                    node.replace_input_with(i, sliced[x] if x in sliced else frontier(x, axes[x]))
            if node in self.new_shape:
                node.replace_input_with(1, const(self.new_shape[node], f"{base}_shape{made}"))
                # 0 copies the input's dim (a zero-size dim copies as 0: the same as allowzero=1 did)
                node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
            out = node.outputs[0]
            sliced[out] = out  # computed on the read positions only, in place
            out.shape = None
            made += 1
        x = self.read.value
        node = self.read.node
        if x not in sliced:
            node.replace_input_with(0, frontier(x, self.read.axis))
        # the read now sees one position: read position 0 of it (Gather) or all of it (Slice)
        if node.op_type == "Gather":
            idx = _const(node.inputs[1])
            node.replace_input_with(1, const(np.zeros(idx.shape, np.int64), f"{base}_index0"))
        else:
            node.replace_input_with(1, const(np.array([0], np.int64), f"{base}_zero"))
            node.replace_input_with(2, const(np.array([_BIG], np.int64), f"{base}_all"))
        return made

    def _first_use(self, v: ir.Value) -> ir.Node:
        users = {u.node for u in v.uses()}
        return next(n for n in self.model.graph if n in users or n in self.moved and v in self.moved[n])


class CutPositionsPass(GraphoptPass):
    """Compute the last layer only for the positions the outputs read (first-token pooling, last-token logits)."""

    name = "cut-positions"
    exact = True
    run_after = ("cleanup",)

    def __init__(self, *, last_token_logits: bool = False, output: str = ""):
        super().__init__()
        if not isinstance(last_token_logits, bool):
            raise UsageError(f"cut-positions.last_token_logits must be true or false, got {last_token_logits!r}")
        if output and not last_token_logits:
            raise UsageError("cut-positions.output names the output for last_token_logits=true; set both")
        self.last_token_logits = last_token_logits
        self.output = output

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        notes: list[str] = []
        sliced: dict[str, tuple[str, int, int]] = {}
        if self.last_token_logits:
            got, err = _add_last_token_output(model, self.output)
            if err:
                return PassResult(model, False, notes=[f"not applied: {err}"])
            sliced[f"{got}_last"] = (got, 1, -1)
            notes.append(f"last_token_logits: output {got!r} [batch, sequence, vocab] replaced by {got}_last "
                         "[batch, 1, vocab] (its last position)")
        total, cuts = 0, 0
        for node in list(graph):
            if node.op_type not in ("Gather", "Slice"):
                continue
            read = _find_read(node)
            if isinstance(read, str):
                continue
            if any(u.node is not node for u in read.value.uses()) or read.value in set(graph.outputs):
                continue
            cut = _Cut(model, read)
            cut.plan()
            if not cut.moved:
                continue
            total += cut.rewrite()
            cuts += 1
            notes.append(f"{node.name or node.op_type}: {len(cut.moved)} ops computed for position {read.start} "
                         f"of axis {read.axis} only")
        if not cuts:
            notes.append("not applied: no one-position Gather/Slice reads a position-wise computation "
                         "(the outputs use every position, e.g. mean pooling)")
            return PassResult(model, self.last_token_logits, notes=notes, sliced_outputs=sliced)
        return PassResult(model, True, notes=notes, rule_counts={"position-read": cuts, "ops-cut": total},
                          sliced_outputs=sliced)


def _add_last_token_output(model: ir.Model, name: str) -> tuple[str, str]:
    """Replace a ``[B, S, V]`` output (``name``, or the only one) by its last position, ``<name>_last``;
    returns (the output's name, "") or ("", why not)."""
    graph = model.graph
    outs = [o for o in graph.outputs if (o.name == name if name else True)]
    outs = [o for o in outs if o.shape is not None and len(o.shape) == 3]
    if len(outs) != 1:
        return "", f"last_token_logits needs one [batch, sequence, vocab] output{f' named {name}' if name else ''}"
    out = outs[0]
    i = list(graph.outputs).index(out)
    vals = []
    for arr, n in ((np.array([-1], np.int64), "starts"), (np.array([_BIG], np.int64), "ends"),
                   (np.array([1], np.int64), "axes")):
        v = ir.Value(name=f"{out.name}_last_{n}", const_value=ir.tensor(arr, name=f"{out.name}_last_{n}"),
                     shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.INT64))
        graph.register_initializer(v)
        vals.append(v)
    node = ir.node("Slice", [out, *vals], name=f"{out.name}_last")
    new = node.outputs[0]
    new.name = f"{out.name}_last"
    new.dtype = out.dtype
    new.shape = ir.Shape([out.shape[0], 1, out.shape[2]])
    graph.append(node)
    graph.outputs[i] = new
    return out.name, ""


register(CutPositionsPass)

"""``convert-precision``: the conversion itself: which values go to fp16/bf16, the Casts at the boundaries.

:class:`Converter` infers element types, plans every node (low precision, fp32 island, or follow its
inputs), converts the initializers it can and inserts a Cast where a value is read in the other precision;
:func:`fold_cast_pairs` then drops round trips that are exact. See the package docstring for the rules.
"""

from __future__ import annotations

import collections
import logging

import ml_dtypes
import numpy as np
import onnx.defs
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, node_domain

logger = logging.getLogger(__name__)

F32, F16, BF16 = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16
PRECISIONS = {"fp16": F16, "bf16": BF16}
_NP = {F16: np.float16, BF16: ml_dtypes.bfloat16}
_TYPE_STR = {F16: "tensor(float16)", BF16: "tensor(bfloat16)"}

#: fp32 islands by default: softmax, exponentials/logarithms, powers and accumulating reductions
DEFAULT_BLOCK = ("Softmax", "LogSoftmax", "Exp", "Log", "Pow", "CumSum", "ReduceMean", "ReduceSum",
                 "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceProd")

#: ops that run in the precision of their computed inputs (data movement, comparisons, elementwise)
FOLLOW = frozenset({
    "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Gather", "GatherElements",
    "GatherND", "Slice", "Concat", "Split", "Expand", "Tile", "Pad", "Where", "Shape", "Size", "Compress",
    "ScatterND", "ScatterElements", "Max", "Min", "ReduceMax", "ReduceMin", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "IsNaN", "IsInf", "Cast", "CastLike", "TopK", "ArgMax", "ArgMin",
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Relu", "Clip", "Sign", "Sum",
    "Trilu", "NonZero", "Dropout",
})

#: com.microsoft ops -> the low precisions their CUDA kernels register (onnxruntime
#: contrib_ops/cuda/cuda_contrib_kernels.cc); every float input/output is their type ``T``
CONTRIB_CUDA: dict[str, frozenset[ir.DataType]] = {
    "Attention": frozenset({F16, BF16}),
    "MultiHeadAttention": frozenset({F16, BF16}),
    "PackedAttention": frozenset({F16}),
    "PackedMultiHeadAttention": frozenset({F16}),
    "GroupQueryAttention": frozenset({F16, BF16}),
    "SkipLayerNormalization": frozenset({F16, BF16}),
    "SkipSimplifiedLayerNormalization": frozenset({F16, BF16}),
    "SimplifiedLayerNormalization": frozenset({F16, BF16}),
    "EmbedLayerNormalization": frozenset({F16}),
    "BiasGelu": frozenset({F16, BF16}),  # contrib_ops/cuda/math/bias_gelu.cc
    "FastGelu": frozenset({F16, BF16}),
    "Gelu": frozenset({F16, BF16}),
    "QuickGelu": frozenset({F16, BF16}),
    "BiasAdd": frozenset({F16}),
    "FusedMatMul": frozenset({F16, BF16}),
    "RotaryEmbedding": frozenset({F16, BF16}),
    "MatMulNBits": frozenset({F16, BF16}),
    "RemovePadding": frozenset({F16}),
    "RestorePadding": frozenset({F16}),
}
#: contrib outputs that are fp32 statistics whatever T is (mean, inverse std-dev)
CONTRIB_FP32_OUTPUTS = {"SkipLayerNormalization": (1, 2), "SkipSimplifiedLayerNormalization": (1, 2),
                        "SimplifiedLayerNormalization": (1,)}


def _set_dtype(v: ir.Value, dtype: ir.DataType) -> None:
    """Give ``v`` a new tensor type: ``Model.clone()`` shares type objects, so ``v.dtype = ...`` (which
    mutates the type in place) would change the model the pipeline cloned from as well."""
    v.type = ir.TensorType(dtype)


def _schema(node: ir.Node, opset: int):
    try:
        return onnx.defs.get_schema(node.op_type, opset, node_domain(node))
    except onnx.defs.SchemaError:
        return None


def _param_positions(formal, count: int) -> list[str]:
    """Type parameter of each actual position (the last formal one repeats when variadic)."""
    out = []
    for i in range(count):
        if i < len(formal):
            out.append(formal[i].type_str)
        elif formal and formal[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
            out.append(formal[-1].type_str)
        else:
            out.append("")
    return out


class Converter:
    """One call: the plan and the rewrite of one model (pass state lives here, not on the pass)."""

    def __init__(self, model: ir.Model, low: ir.DataType, block: frozenset[str], keep_io: bool):
        self.model, self.graph, self.low, self.block, self.keep_io = model, model.graph, low, block, keep_io
        self.opsets = model.opset_imports
        self.prec: dict[ir.Value, ir.DataType] = {}  # computed float values -> their precision
        self.casts: dict[tuple[int, ir.DataType], ir.Value] = {}
        self.variants: dict[tuple[int, ir.DataType], ir.Value] = {}
        self.sources: set[int] = set()  # id of source nodes / initializer values
        self.counts: collections.Counter[str] = collections.Counter()
        self.fp32_ops: collections.Counter[str] = collections.Counter()
        self.clamped = 0

    # ------------------------------------------------------------------ types
    def infer_dtypes(self) -> None:
        """Fill missing element types (contrib ops lose them in shape inference) from schemas / inputs."""
        for node in self.graph:
            missing = [o for o in node.outputs if o.dtype is None]
            if not missing:
                continue
            if node.op_type == "Cast" and node_domain(node) == "":
                _set_dtype(node.outputs[0], ir.DataType(node.attributes["to"].value))
                continue
            if node.op_type in ("Constant", "ConstantOfShape") and node_domain(node) == "":
                value = node.attributes.get("value")
                if value is not None and value.type == ir.AttributeType.TENSOR:
                    _set_dtype(node.outputs[0], value.value.dtype)
                elif node.op_type == "ConstantOfShape" or {"value_float", "value_floats"} & set(node.attributes):
                    _set_dtype(node.outputs[0], F32)
                elif {"value_int", "value_ints"} & set(node.attributes):
                    _set_dtype(node.outputs[0], ir.DataType.INT64)
                continue
            schema = _schema(node, self.opsets.get(node_domain(node), 1)) if node_domain(node) == "" else None
            if schema is None:
                known = next((i.dtype for i in node.inputs if i is not None and i.dtype is not None
                              and i.dtype.is_floating_point()), None)
                # contrib ops: output 0 (and a Skip*LayerNormalization's input_skip_bias_sum) is their T;
                # other outputs (mask_index int32, fp32 statistics) are left unknown
                typed = (0, 3) if node.op_type.startswith("Skip") else (0,)
                if known is not None:
                    for j in typed:
                        if j < len(node.outputs) and node.outputs[j].dtype is None:
                            _set_dtype(node.outputs[j], known)
                continue
            ins = _param_positions(schema.inputs, len(node.inputs))
            outs = _param_positions(schema.outputs, len(node.outputs))
            allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
            for j, o in enumerate(node.outputs):
                if o.dtype is not None:
                    continue
                p = outs[j]
                src = next((v.dtype for v, q in zip(node.inputs, ins) if q == p and v is not None and v.dtype), None)
                if src is None and len(allowed.get(p, ())) == 1:
                    src = _dtype_of(allowed[p][0])
                if src is None and p and p not in allowed:  # a fixed type written in the schema
                    src = _dtype_of(p)
                if src is not None:
                    _set_dtype(o, src)

    # ------------------------------------------------------------------ plan of a node
    def is_float(self, v: ir.Value | None) -> bool:
        """A float value of the input model (fp32), or one this run has converted already."""
        return v is not None and v.dtype in (F32, self.low)

    def is_source(self, node: ir.Node | None) -> bool:
        if node is None or node_domain(node) != "" or len(node.outputs) != 1 or node.outputs[0].dtype != F32:
            return False
        if node.op_type == "Cast":
            return True
        if node.op_type == "Constant":
            return "value" in node.attributes
        return node.op_type == "ConstantOfShape"

    def plan(self, node: ir.Node) -> tuple[str, list[tuple[list[int], list[int]]]]:
        """(kind, groups): kind compute / follow / fp32; groups of float input and output positions
        sharing one convertible type parameter. Float positions outside every group stay fp32."""
        fin = [i for i, v in enumerate(node.inputs) if self.is_float(v)]
        fout = [j for j, v in enumerate(node.outputs) if self.is_float(v)]
        if not fin and not fout:
            return "none", []
        dom = node_domain(node)
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return "fp32", []
        if node.op_type in self.block:
            return "fp32", []
        if node.op_type == "LayerNormalization" and dom == "":
            stash = node.attributes.get("stash_type")
            if stash is not None and int(stash.value) != 1:
                return "fp32", []
        schema = _schema(node, self.opsets.get(dom, 1)) if dom == "" else None
        if schema is None:
            if dom not in ("", MS_DOMAIN) or self.low not in CONTRIB_CUDA.get(node.op_type, ()):
                return "fp32", []
            keep = CONTRIB_FP32_OUTPUTS.get(node.op_type, ())
            return "compute", [(fin, [j for j in fout if j not in keep])]
        ins = _param_positions(schema.inputs, len(node.inputs))
        outs = _param_positions(schema.outputs, len(node.outputs))
        allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
        groups = []
        for p in dict.fromkeys(ins[i] for i in fin):
            if _TYPE_STR[self.low] not in allowed.get(p, ()):
                continue
            groups.append(([i for i in fin if ins[i] == p], [j for j in fout if outs[j] == p]))
        if not groups:
            return "fp32", []
        return ("follow" if node.op_type in FOLLOW else "compute"), groups

    # ------------------------------------------------------------------ values in a precision
    def natural(self, v: ir.Value) -> ir.DataType | None:
        """The precision a value has now; None for a source (free to take either)."""
        if self.source_of(v) is not None:
            return None
        return self.prec.get(v, v.dtype)

    def source_of(self, v: ir.Value):
        if v.is_initializer() and not v.is_graph_input() and v.const_value is not None and v.dtype == F32:
            return v
        if self.is_source(v.producer()):
            return v.producer()
        return None

    def get(self, v: ir.Value, p: ir.DataType, before: ir.Node | None) -> ir.Value:
        """``v`` in precision ``p``: a source's copy in ``p``, ``v`` itself, or a shared Cast of it."""
        src = self.source_of(v)
        if src is not None:
            return self.variant(v, src, p)
        if self.prec.get(v, v.dtype) == p:
            return v
        key = (id(v), p)
        if key not in self.casts:
            cast = ir.node("Cast", [v], {"to": p}, name=f"{v.name}_to_{p.name.lower()}")
            out = cast.outputs[0]
            out.name, out.dtype, out.shape = f"{v.name}_{p.name.lower()}", p, v.shape
            self._insert(cast, v, before)
            self.prec[out] = p
            self.casts[key] = out
            self.counts["casts"] += 1
        return self.casts[key]

    def _insert(self, node: ir.Node, v: ir.Value, before: ir.Node | None) -> None:
        prod = v.producer()
        if prod is not None and prod.graph is self.graph:
            self.graph.insert_after(prod, node)
        elif before is not None:
            self.graph.insert_before(before, node)
        else:
            self.graph.append(node)

    def variant(self, v: ir.Value, src, p: ir.DataType) -> ir.Value:
        if p == F32:
            return v
        key = (id(v), p)
        if key in self.variants:
            return self.variants[key]
        self.sources.add(id(src))
        suffix = p.name.lower()
        if isinstance(src, ir.Value):  # initializer
            t = ir.tensor(self.convert(src.const_value.numpy()), name=f"{v.name}_{suffix}")
            new = ir.Value(name=t.name, shape=v.shape, type=ir.TensorType(p), const_value=t)
            self.graph.register_initializer(new)
            self.counts["initializers"] += 1
        else:
            node: ir.Node = src
            if node.op_type == "Cast":
                copy = ir.node("Cast", list(node.inputs), {"to": p}, name=f"{node.name}_{suffix}")
            else:
                attr = "value"
                t = node.attributes[attr].value if attr in node.attributes else ir.tensor(np.zeros(1, np.float32))
                arr = self.convert(t.numpy())
                copy = ir.node(node.op_type, list(node.inputs), {attr: ir.tensor(arr)}, name=f"{node.name}_{suffix}")
            new = copy.outputs[0]
            new.name, new.dtype, new.shape = f"{v.name}_{suffix}", p, v.shape
            self.graph.insert_after(node, copy)
            self.counts["constants"] += 1
        self.variants[key] = new
        return new

    def convert(self, arr: np.ndarray) -> np.ndarray:
        np_t = _NP[self.low]
        top = float(ml_dtypes.finfo(np_t).max)
        arr = np.asarray(arr, dtype=np.float32)
        over = np.isfinite(arr) & (np.abs(arr) > top)
        n = int(over.sum())
        if n:
            self.clamped += n
            arr = np.clip(arr, -top, top).astype(np.float32) if not np.isinf(arr).any() else \
                np.where(over, np.sign(arr) * top, arr).astype(np.float32)
        return arr.astype(np_t)

    # ------------------------------------------------------------------ the rewrite
    def run(self) -> None:
        self.graph.sort()
        self.infer_dtypes()
        for v in self.graph.inputs:
            if v.dtype == F32 and not self.keep_io:
                _set_dtype(v, self.low)
            if v.dtype is not None:
                self.prec[v] = v.dtype
        for node in list(self.graph):
            if self.is_source(node):
                continue
            kind, groups = self.plan(node)
            if kind == "none":
                continue
            grouped_in = {i for g in groups for i in g[0]}
            grouped_out = {j for g in groups for j in g[1]}
            if kind == "fp32" or (not groups and kind != "none"):
                self.fp32_ops[node.op_type] += 1
            for ins, outs in groups:
                p = self.low
                if kind == "follow":
                    nat = [self.natural(node.inputs[i]) for i in ins]
                    p = self.low if self.low in nat else (F32 if F32 in nat else self.low)
                for i in ins:
                    new = self.get(node.inputs[i], p, node)
                    if new is not node.inputs[i]:
                        node.replace_input_with(i, new)
                for j in outs:
                    _set_dtype(node.outputs[j], p)
                    self.prec[node.outputs[j]] = p
            for i, v in enumerate(node.inputs):
                if i not in grouped_in and self.is_float(v):
                    new = self.get(v, F32, node)
                    if new is not v:
                        node.replace_input_with(i, new)
            for j, v in enumerate(node.outputs):
                if j not in grouped_out and v.dtype == F32:
                    self.prec[v] = F32
        self.outputs()
        self.drop_unused_sources()
        self.counts["cast-pairs"] = fold_cast_pairs(self.graph)

    def outputs(self) -> None:
        for k, v in enumerate(list(self.graph.outputs)):
            if v.dtype not in (F32, self.low) or (self.keep_io and self.prec.get(v, v.dtype) == F32):
                continue
            want = F32 if self.keep_io else self.low
            if self.prec.get(v, v.dtype) == want and self.source_of(v) is None:
                continue
            if self.source_of(v) is not None and want == F32:
                continue
            new = self.get(v, want, None)
            if new is v:
                continue
            name = v.name
            v.name = f"{name}_{(self.low if want == F32 else F32).name.lower()}"
            new.name = name
            self.graph.outputs[k] = new

    def drop_unused_sources(self) -> None:
        for node in list(self.graph):
            if id(node) in self.sources and not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
                self.graph.remove(node, safe=True)
        for name, v in list(self.graph.initializers.items()):
            if id(v) in self.sources and not v.uses() and not v.is_graph_output():
                del self.graph.initializers[name]


def _dtype_of(type_str: str) -> ir.DataType | None:
    names = {"tensor(float)": F32, "tensor(float16)": F16, "tensor(bfloat16)": BF16, "tensor(double)": ir.DataType.DOUBLE,
             "tensor(int64)": ir.DataType.INT64, "tensor(int32)": ir.DataType.INT32, "tensor(bool)": ir.DataType.BOOL}
    return names.get(type_str)


def _exact_in(src: ir.DataType, mid: ir.DataType) -> bool:
    """Every value of ``src`` is exactly representable in the float type ``mid``."""
    if src == ir.DataType.BOOL or src == mid:
        return True
    if not mid.is_floating_point():
        return False
    bits = {F32: 24, ir.DataType.DOUBLE: 53, F16: 11, BF16: 8}.get(mid, 0)
    if src.is_floating_point():
        return (src, mid) in {(F16, F32), (BF16, F32), (F16, ir.DataType.DOUBLE), (BF16, ir.DataType.DOUBLE),
                              (F32, ir.DataType.DOUBLE)}
    return src.itemsize * 8 - (1 if src.is_signed() else 0) <= bits


def fold_cast_pairs(graph: ir.Graph) -> int:
    """Fold ``Cast(Cast(x, to=A), to=B)`` where the first cast is exact: ``x`` itself when B is x's
    type, else one ``Cast(x, to=B)``. Returns the number folded."""
    folded = 0
    for node in list(graph):
        if node.op_type != "Cast" or node_domain(node) != "":
            continue
        first = node.inputs[0].producer() if node.inputs[0] is not None else None
        if first is None or first.op_type != "Cast" or node_domain(first) != "" or first.graph is not graph:
            continue
        x = first.inputs[0]
        mid = ir.DataType(first.attributes["to"].value)
        to = ir.DataType(node.attributes["to"].value)
        if x is None or x.dtype is None or not _exact_in(x.dtype, mid):
            continue
        out = node.outputs[0]
        if x.dtype == to and not out.is_graph_output():
            out.replace_all_uses_with(x)
            graph.remove(node, safe=True)
        else:
            node.replace_input_with(0, x)
        if not first.outputs[0].uses() and not first.outputs[0].is_graph_output():
            graph.remove(first, safe=True)
        folded += 1
    return folded

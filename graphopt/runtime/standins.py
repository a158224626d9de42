"""CPU stand-ins for contrib ops that only have CUDA kernels, so models made for ``--provider cuda`` verify on CPU.

ONNX Runtime has no CPU kernel for ``com.microsoft::PackedMultiHeadAttention``. A model that uses it
cannot run on the CPU provider, where the pipeline verifies. :func:`cpu_runnable` returns a copy in
which every such node is replaced by an exact standard-op reference of the op's documented semantics
(ContribOperators.md, and what the CUDA kernels read). The model that is saved keeps the contrib op.

What this checks: everything our passes build around the op (the packing index, token_offset,
cumulative_sequence_length, bias layout, head split, scale), against the op's semantics. What it
cannot check: the CUDA kernel itself (its accumulation order, fp16 paths, and kernel selection). The
prepared GPU script ``tools/cuda_checks.py`` does that on a CUDA machine.

PackedMultiHeadAttention reference (query/key/value ``[T, H]``, or packed ``[T, N, 3, h]`` with key/value absent)::

    sequence b owns the packed rows cu[b] .. cu[b+1]-1 (what the fused CUDA kernels read); row i
    of sequence b is slot (b, i - cu[b]) of a right-padded [B, S] layout, S = token_offset.shape[1]
    Q, K, V (+ bias[:H], bias[H:2H], bias[2H:]) --unpack to [B, S]--> [B, N, S, h]
    softmax(Q Kᵀ * scale (+ attention_bias), keys at slots >= length masked out exactly) V --pack--> [T, Hv]

The unfused CUDA kernel instead places row i at ``token_offset[i]`` (flattened) and writes padding
at the remaining entries. The reference therefore also checks that ``token_offset`` agrees with the
layout above (its first T entries are exactly the slots of the packed rows, and it is a permutation
of ``[0, B*S)``) and that ``cumulative_sequence_length`` is well formed (starts at 0, ends at T, no
negative or longer-than-S sequence). When any check fails, its output is NaN, so verification fails.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN
from graphopt.runtime import ort_compat
from graphopt.runtime.contrib import attention_inputs

logger = logging.getLogger(__name__)


#: where the CUDA kernels are checked on a GPU (named in reports)
GPU_CHECK = "tools/cuda_checks.py"


def note(ops: list[str]) -> str:
    """The report note for a model verified through stand-ins for ``ops``.

    ``ops`` entries ``OP(float16)`` / ``OP(bfloat16)`` are precision stand-ins (see :func:`low_precision_stand_ins`).
    """
    exact = [o for o in ops if "(" not in o]
    low = [o for o in ops if "(" in o]
    parts = []
    if exact:
        parts.append(f"verified on CPU with a standard-op stand-in for {', '.join(exact)} (no CPU kernel in ONNX Runtime); "
                     f"the CUDA kernel itself is checked by {GPU_CHECK} on a GPU")
    if low:
        parts.append(f"verified on CPU with precision stand-ins for {', '.join(low)} (no CPU kernel in that type): "
                     "inputs cast to fp32, the op in fp32, outputs rounded to the type, as the CUDA kernels "
                     f"accumulate in fp32; the fp16/bf16 CUDA kernels themselves are checked by {GPU_CHECK} on a GPU")
    return "; ".join(parts)


def _const(tape: ir.tape.Tape, array: np.ndarray) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(array)})


def _ints(tape: ir.tape.Tape, values) -> ir.Value:
    return _const(tape, np.asarray(values, dtype=np.int64))


def _scalar(tape: ir.tape.Tape, value: int) -> ir.Value:
    return _const(tape, np.asarray(value, dtype=np.int64))


def _dim(tape: ir.tape.Tape, value: ir.Value, axis: int) -> ir.Value:
    """``value.shape[axis]`` as a 1-D int64 tensor of one element."""
    return tape.op("Shape", [value], {"start": axis, "end": axis + 1})


def _count_false(tape: ir.tape.Tape, cond: ir.Value) -> ir.Value:
    """Number of False entries of a bool tensor (int64 scalar; 0 for an empty tensor)."""
    flat = tape.op("Reshape", [tape.op("Not", [cond]), _ints(tape, [-1])])
    return tape.op("ReduceSum", [tape.op("Cast", [flat], {"to": ir.DataType.INT64}), _ints(tape, [0])], {"keepdims": 0})


def _packed_mha(t: ir.tape.Tape, node: ir.Node) -> ir.Value:
    """Standard-op reference of com.microsoft PackedMultiHeadAttention (see the module docstring)."""
    a = attention_inputs(node)
    query, key, value, bias = a.query, a.key, a.value, a.bias
    offset, cu, attn_bias = a.token_offset, a.cumulative_sequence_length, a.attention_bias
    if query is None or offset is None or cu is None:
        raise ValueError(f"PackedMultiHeadAttention {node.name!r} lacks query, token_offset or cumulative_sequence_length")
    heads = node.attributes.get("num_heads")
    if heads is None:
        raise ValueError(f"PackedMultiHeadAttention {node.name!r} has no num_heads")
    nh = int(heads.value)
    scale_attr = node.attributes.get("scale")
    scale = float(scale_attr.value) if scale_attr is not None else 0.0

    if key is None:  # packed QKV [T, N, 3, h]
        if value is not None:
            raise ValueError(f"PackedMultiHeadAttention {node.name!r}: packed query with a value input")
        parts = t.op_multi_out("Split", [query, _ints(t, [1, 1, 1])], {"axis": 2}, num_outputs=3)
        q, k, v = (t.op("Reshape", [p, _ints(t, [0, -1])]) for p in parts)
    else:
        if value is None:
            raise ValueError(f"PackedMultiHeadAttention {node.name!r} has key but no value")
        q, k, v = query, key, value
    if bias is not None:
        widths = t.op("Concat", [_dim(t, q, 1), _dim(t, k, 1), _dim(t, v, 1)], {"axis": 0})
        bq, bk, bv = t.op_multi_out("Split", [bias, widths], {"axis": 0}, num_outputs=3)
        q, k, v = t.op("Add", [q, bq]), t.op("Add", [k, bk]), t.op("Add", [v, bv])

    tokens = _dim(t, q, 0)  # [1] = T
    tokens_s = t.op("Squeeze", [tokens, _ints(t, [0])])
    batch, seq = _dim(t, offset, 0), _dim(t, offset, 1)
    seq_s = t.op("Squeeze", [seq, _ints(t, [0])])
    slots = t.op("Mul", [batch, seq])  # [1] = B*S
    slots_s = t.op("Squeeze", [slots, _ints(t, [0])])

    cu64 = t.op("Cast", [cu], {"to": ir.DataType.INT64})  # [B+1]
    starts = t.op("Slice", [cu64, _ints(t, [0]), _ints(t, [-1])])
    ends = t.op("Slice", [cu64, _ints(t, [1]), _ints(t, [np.iinfo(np.int64).max])])
    lengths = t.op("Sub", [ends, starts])  # [B]
    # the sequence of each packed row, and its slot in the right-padded [B, S] layout
    rows = t.op("Range", [_scalar(t, 0), tokens_s, _scalar(t, 1)])  # [T]
    seq_of_row = t.op("ReduceSum", [
        t.op("Cast", [t.op("LessOrEqual", [t.op("Unsqueeze", [ends, _ints(t, [0])]),
                                           t.op("Unsqueeze", [rows, _ints(t, [1])])])], {"to": ir.DataType.INT64}),
        _ints(t, [1])], {"keepdims": 0})  # [T]
    last_seq = t.op("Sub", [batch, _ints(t, [1])])
    seq_of_row_c = t.op("Min", [seq_of_row, t.op("Max", [last_seq, _ints(t, [0])])])
    pos_in_seq = t.op("Sub", [rows, t.op("Gather", [cu64, seq_of_row_c], {"axis": 0})])
    slot_of_row = t.op("Add", [t.op("Mul", [seq_of_row, seq_s]), pos_in_seq])  # [T]
    top_slot = t.op("Sub", [slots_s, _scalar(t, 1)])
    slot_safe = t.op("Max", [t.op("Min", [slot_of_row, top_slot]), _scalar(t, 0)])

    # the checks: cu well formed; token_offset agrees with the layout and is a permutation of [0, B*S)
    offset_flat = t.op("Cast", [t.op("Reshape", [offset, _ints(t, [-1])])], {"to": ir.DataType.INT64})
    conds = [
        t.op("Equal", [t.op("Size", [cu64]), t.op("Squeeze", [t.op("Add", [batch, _ints(t, [1])]), _ints(t, [0])])]),
        t.op("Equal", [t.op("Slice", [cu64, _ints(t, [0]), _ints(t, [1])]), _ints(t, [0])]),
        t.op("Equal", [t.op("Slice", [cu64, _ints(t, [-1]), _ints(t, [np.iinfo(np.int64).max])]), tokens]),
    ]
    checks = [_count_false(t, c) for c in conds]
    checks.append(_count_false(t, t.op("GreaterOrEqual", [lengths, _scalar(t, 0)])))
    checks.append(_count_false(t, t.op("LessOrEqual", [lengths, seq_s])))
    head = t.op("Slice", [offset_flat, _ints(t, [0]), tokens])
    checks.append(_count_false(t, t.op("Equal", [head, slot_of_row])))
    in_range = t.op("And", [t.op("GreaterOrEqual", [offset_flat, _scalar(t, 0)]), t.op("Less", [offset_flat, slots_s])])
    checks.append(_count_false(t, in_range))
    offset_safe = t.op("Max", [t.op("Min", [offset_flat, top_slot]), _scalar(t, 0)])
    every = t.op("Range", [_scalar(t, 0), slots_s, _scalar(t, 1)])  # [B*S]
    inverse = t.op("ScatterElements", [t.op("Mul", [every, _scalar(t, 0)]), offset_safe, every], {"axis": 0})
    checks.append(_count_false(t, t.op("Equal", [t.op("Gather", [inverse, offset_safe], {"axis": 0}), every])))
    failures = checks[0]
    for c in checks[1:]:
        failures = t.op("Add", [failures, c])
    ok = t.op("Equal", [failures, _scalar(t, 0)])

    # unpack: slot -> packed row (T, a zero row, for padding slots)
    fill = t.op("Expand", [tokens_s, slots])
    row_of_slot = t.op("ScatterElements", [fill, slot_safe, rows], {"axis": 0})  # [B*S]
    grid = t.op("Concat", [batch, seq, _ints(t, [nh, -1])], {"axis": 0})

    def unpack(x: ir.Value, perm: list[int]) -> ir.Value:
        padded = t.op("Gather", [t.op("Pad", [x, _ints(t, [0, 0, 1, 0])]), row_of_slot], {"axis": 0})
        return t.op("Transpose", [t.op("Reshape", [padded, grid])], {"perm": perm})

    qh = unpack(q, [0, 2, 1, 3])  # [B, N, S, h]
    kh = unpack(k, [0, 2, 3, 1])  # [B, N, h, S]
    vh = unpack(v, [0, 2, 1, 3])  # [B, N, S, hv]
    if scale:
        scale_v = t.op("CastLike", [_const(t, np.asarray(scale, np.float32)), q])
    else:
        head_size = t.op("Div", [_dim(t, q, 1), _ints(t, [nh])])
        scale_v = t.op("Reciprocal", [t.op("Sqrt", [t.op("CastLike", [head_size, q])])])
    scores = t.op("Mul", [t.op("MatMul", [qh, kh]), scale_v])  # [B, N, S, S]
    if attn_bias is not None:
        scores = t.op("Add", [scores, attn_bias])
    key_pos = t.op("Range", [_scalar(t, 0), seq_s, _scalar(t, 1)])
    key_ok = t.op("Less", [t.op("Unsqueeze", [key_pos, _ints(t, [0])]), t.op("Unsqueeze", [lengths, _ints(t, [1])])])
    key_ok = t.op("Unsqueeze", [key_ok, _ints(t, [1, 2])])  # [B, 1, 1, S]
    # a key past its sequence's length gets weight 0 exactly (exp underflows); a row of only such
    # keys (a padding slot of an empty sequence) is never packed back
    lowest = t.op("CastLike", [_const(t, np.asarray(np.finfo(np.float32).min, np.float32)), q])
    probs = t.op("Softmax", [t.op("Where", [key_ok, scores, lowest])], {"axis": -1})
    ctx = t.op("Transpose", [t.op("MatMul", [probs, vh])], {"perm": [0, 2, 1, 3]})  # [B, S, N, hv]
    ctx = t.op("Reshape", [ctx, t.op("Concat", [_ints(t, [-1]), _dim(t, v, 1)], {"axis": 0})])
    out = t.op("Gather", [ctx, slot_safe], {"axis": 0})  # [T, Hv]
    nan = t.op("CastLike", [_const(t, np.asarray(np.nan, np.float32)), q])
    return t.op("Where", [ok, out, nan])


#: (domain, op_type) -> stand-in builder; ops with no CPU kernel in ONNX Runtime
STAND_INS = {(MS_DOMAIN, "PackedMultiHeadAttention"): _packed_mha}


_LOW = {ir.DataType.FLOAT16: "tensor(float16)", ir.DataType.BFLOAT16: "tensor(bfloat16)"}
_CPU_KERNELS: dict[tuple[str, str], list[tuple[tuple[int, int], set[str]]]] | None = None


def _cpu_kernels() -> dict[tuple[str, str], list[tuple[tuple[int, int], set[str]]]]:
    """(domain, op) -> [(version range, every type the CPU kernel's constraints name)] of this ONNX Runtime."""
    global _CPU_KERNELS
    if _CPU_KERNELS is None:
        table: dict = {}
        for k in ort_compat.kernel_defs():
            if k.provider == "CPUExecutionProvider":
                types = {t for ts in k.type_constraints.values() for t in ts}
                table.setdefault((k.domain or "", k.op_name), []).append((tuple(k.version_range), types))
        _CPU_KERNELS = table
    return _CPU_KERNELS


def _cpu_has(node: ir.Node, opset: int, type_str: str) -> bool:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return any(lo <= opset <= hi and type_str in types
               for (lo, hi), types in _cpu_kernels().get((domain, node.op_type), ()))


def _low_dtypes(node: ir.Node) -> set[ir.DataType]:
    return {v.dtype for v in (*node.inputs, *node.outputs) if v is not None and v.dtype in _LOW}


def low_precision_ops(model: ir.Model) -> list[str]:
    """``OP(float16)`` / ``OP(bfloat16)`` for nodes of ``model``'s main graph with fp16/bf16 tensors and no
    CPU kernel in that type (ONNX Runtime would refuse bf16 and insert its own casts for fp16)."""
    found = set()
    for node in model.graph:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        if node.op_type in ("Constant", "Cast", "CastLike") and domain == "":
            continue
        opset = model.opset_imports.get(domain, 1)
        for dt in _low_dtypes(node):
            if not _cpu_has(node, opset, _LOW[dt]):
                found.add(f"{node.op_type}({_LOW[dt][7:-1]})")
    return sorted(found)


def low_precision_stand_ins(model: ir.Model) -> list[str]:
    """Replace (in place) each node with fp16/bf16 tensors and no CPU kernel in that type by the same op
    in fp32 between Casts: inputs cast to fp32, outputs rounded back to their type. Returns the ops."""
    graph, done = model.graph, set()
    for node in list(graph):
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        if node.op_type in ("Constant", "Cast", "CastLike") and domain == "":
            continue
        opset = model.opset_imports.get(domain, 1)
        low = [dt for dt in _low_dtypes(node) if not _cpu_has(node, opset, _LOW[dt])]
        if not low:
            continue
        tape = ir.tape.Tape()
        ins = [tape.op("Cast", [v], {"to": ir.DataType.FLOAT}) if v is not None and v.dtype in _LOW else v
               for v in node.inputs]
        wide = tape.op_multi_out(node.op_type, ins, {k: a for k, a in node.attributes.items()},
                                 domain=node.domain, num_outputs=len(node.outputs))
        outs = []
        for old, new in zip(node.outputs, wide):
            if old.dtype in _LOW:
                new.dtype = ir.DataType.FLOAT
                outs.append(tape.op("Cast", [new], {"to": old.dtype}))
            else:
                if old.dtype is not None:  # an unused output of unknown type (a mask_index) stays untyped
                    new.dtype = old.dtype
                outs.append(new)
        names = [o.name for o in node.outputs]
        ir.convenience.replace_nodes_and_values(graph, node, [node], list(tape.nodes), list(node.outputs), outs)
        for old, new, name in zip(node.outputs, outs, names):
            if name:
                old.name = f"{name}_replaced"
                new.name = name
        done.update(f"{node.op_type}({_LOW[dt][7:-1]})" for dt in low)
    return sorted(done)


def cuda_only_ops(model: ir.Model) -> list[str]:
    """Op types in ``model``'s main graph that have a stand-in here (no CPU kernel)."""
    return sorted({n.op_type for n in model.graph if ((n.domain or ""), n.op_type) in STAND_INS})


def cpu_runnable(model: ir.Model) -> tuple[ir.Model, list[str]]:
    """``model`` itself when it has no CUDA-only op, else a copy with each replaced by its stand-in.

    Nodes with fp16/bf16 tensors and no CPU kernel in that type are first run in fp32 between Casts
    (:func:`low_precision_stand_ins`; reported as ``OP(float16)``), then CUDA-only ops get their
    stand-ins. Returns the model to run on CPU and the op types replaced (empty when none).
    """
    ops = cuda_only_ops(model)
    low = low_precision_ops(model)
    if not ops and not low:
        return model, []
    opset = model.opset_imports.get("", 0)
    if ops and opset < 15:  # CastLike and Shape(start, end)
        raise ValueError(f"the stand-ins for {', '.join(ops)} need opset >= 15, the model has {opset}")
    copy = model.clone()
    if low:
        low = low_precision_stand_ins(copy)
    graph = copy.graph
    for node in list(graph):
        build = STAND_INS.get(((node.domain or ""), node.op_type))
        if build is None:
            continue
        tape = ir.tape.Tape()
        out = build(tape, node)
        old = node.outputs[0]
        name = old.name
        # replace_nodes_and_values gives the stand-in's output the old output's name, type and shape
        # (graph outputs and calibration read values by name); the removed value then gives it up
        ir.convenience.replace_nodes_and_values(graph, node, [node], list(tape.nodes), [old], [out])
        if name:
            old.name = f"{name}_replaced"
            out.name = name
    logger.info("replaced %s by standard-op stand-ins for a CPU run", ", ".join(ops + low))
    return copy, ops + low

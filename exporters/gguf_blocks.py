"""Put a GGUF file's quantized blocks back into the fp32 ONNX export of its dequantized model, exactly.

Weights are found by value, not by name (exporters rename and pre-transpose them): the bytes of each
constant ``MatMul`` B (``[K, N]``, transposed to ``[N, K]``) and of each other fp32 initializer are
compared with every GGUF tensor dequantized the way transformers does it (Hugging Face row order).

* Q4_1 projection ``A @ W.T`` with ``W = d·q + m`` per block of 32 along K becomes
  ``MatMulNBits(A, q packed, d, zero points 0)`` (com.microsoft; bits 4, block 32, accuracy_level 1:
  fp32 activations) ``+ ReduceSum(A as [.., K/32, 32], -1) @ m.T`` -- the same sum, regrouped.
  ``B`` is ``[N, K/32, 16]`` uint8, element ``2j`` in the low nibble of byte ``j`` (ORT's layout),
  scales ``[N·K/32]``, zero points ``[N·ceil(K/64)]`` uint8 zeros (absent they would default to 8).
* Q8_0 tensors (here: the token embedding and the tied LM head) stay fp32 in the arithmetic:
  ``MatMulNBits`` with bits=8 is exact but far slower than the fp32 MatMul at accuracy_level 1 (it
  quantizes activations only at level 4, which is not exact). They are stored as their int8 codes and
  fp16 scales and rebuilt by ``Cast``/``Mul``/``Reshape`` on initializers only, which ONNX Runtime
  folds into the fp32 tensor once at session creation: the file keeps 8.5 bits per weight, the
  arithmetic is bit-identical (``d·q`` in fp32 is exact).
* Any other initializer matching a Q4_1 tensor (no MatMul to put it in) is stored the same way
  (``d·q + m``); everything else stays as exported (F32 norms and the like).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import numpy as np
import onnx_ir as ir

from graphopt.exporters import gguf

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
ACCURACY_LEVEL = 1  # fp32 activations: exact


@dataclasses.dataclass
class BlockReport:
    """What ``apply`` did."""

    matmulnbits: list[str] = dataclasses.field(default_factory=list)  # HF names now MatMulNBits
    stored_blocks: list[str] = dataclasses.field(default_factory=list)  # HF names kept fp32, stored as blocks
    kept_fp32: list[str] = dataclasses.field(default_factory=list)  # matched tensors left as fp32 (why in notes)
    notes: list[str] = dataclasses.field(default_factory=list)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


def pack_q4(q: np.ndarray) -> np.ndarray:
    """``q`` uint8 ``[N, K]`` (0..15) -> MatMulNBits ``B`` ``[N, K/32, 16]``: element 2j low nibble, 2j+1 high."""
    n, k = q.shape
    pairs = q.reshape(n, k // gguf.QK, gguf.QK // 2, 2).astype(np.uint8)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def hf_blocks(g: gguf.GGUFModel) -> dict[str, tuple[str, gguf.GGUFTensor, np.ndarray | None]]:
    """Digest of each GGUF tensor's dequantized Hugging Face weight -> (HF name, tensor, row order)."""
    out = {}
    for hf, (t, perm) in g.hf_tensors().items():
        if len(t.shape) != 2:
            continue
        w = t.dequantize()
        out[_digest(w if perm is None else w[perm])] = (hf, t, perm)
    return out


def _rows(a: np.ndarray, perm: np.ndarray | None) -> np.ndarray:
    return a if perm is None else a[perm]


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(v)
    return v


def _unique(graph: ir.Graph, stem: str) -> str:
    names = {v.name for v in graph.initializers.values()} | {o.name for n in graph for o in n.outputs}
    name, i = stem, 1
    while name in names:
        name, i = f"{stem}_{i}", i + 1
    return name


def apply(model: ir.Model, g: gguf.GGUFModel) -> BlockReport:
    """Rewrite ``model`` in place (see the module docstring); returns what became which form."""
    graph = model.graph
    table = hf_blocks(g)
    report = BlockReport()
    done: set[str] = set()
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        a, b = node.inputs
        if b is None or b.const_value is None or len(b.const_value.shape) != 2:
            continue
        hit = table.get(_digest(b.const_value.numpy().T))
        if hit is None:
            continue
        hf, t, perm = hit
        if t.type != "Q4_1":
            continue
        rank = len(a.shape) if a.shape is not None else None
        if rank is None or rank < 2:
            report.kept_fp32.append(hf)
            report.notes.append(f"{hf}: activation rank unknown, kept the fp32 MatMul")
            continue
        _to_matmulnbits(graph, node, a, t, perm, hf, rank)
        report.matmulnbits.append(hf)
        done.add(hf)
    for value in list(graph.initializers.values()):
        if value.const_value is None or value.const_value.dtype != ir.DataType.FLOAT or len(value.const_value.shape) != 2:
            continue
        if not value.uses():
            continue
        hit = table.get(_digest(value.const_value.numpy()))
        if hit is None:
            continue
        hf, t, perm = hit
        if t.type not in gguf.BLOCK_TYPES:
            continue
        _to_folded_blocks(graph, value, t, perm, hf)
        report.stored_blocks.append(hf)
        done.add(hf)
    if report.matmulnbits or report.stored_blocks:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        if "" not in model.opset_imports:
            model.opset_imports[""] = 18
    _drop_unused(graph)
    _notes(report, g, done)
    return report


def _to_matmulnbits(graph: ir.Graph, node: ir.Node, a: ir.Value, t: gguf.GGUFTensor, perm, hf: str, rank: int) -> None:
    q, d, m = t.q4_1()
    q, d, m = _rows(q, perm), _rows(d, perm), _rows(m, perm)
    n, k = q.shape
    nb = k // gguf.QK
    stem = hf.removeprefix("inner.").removesuffix(".weight")
    packed = _const(graph, _unique(graph, stem + ".q4"), pack_q4(q))
    scales = _const(graph, _unique(graph, stem + ".scales"), d.astype(np.float32).reshape(-1))
    zeros = _const(graph, _unique(graph, stem + ".zero_points"), np.zeros(n * ((nb + 1) // 2), np.uint8))
    mins_t = _const(graph, _unique(graph, stem + ".mins_t"), np.ascontiguousarray(m.astype(np.float32).T))
    shape = _const(graph, _unique(graph, stem + ".block_shape"), np.array([0] * (rank - 1) + [nb, gguf.QK], np.int64))
    axes = _const(graph, _unique(graph, stem + ".block_axis"), np.array([-1], np.int64))
    nbits = ir.node("MatMulNBits", [a, packed, scales, zeros], domain=MS_DOMAIN, name=stem + "/MatMulNBits",
                    attributes={"K": k, "N": n, "bits": 4, "block_size": gguf.QK, "accuracy_level": ACCURACY_LEVEL})
    blocks = ir.node("Reshape", [a, shape], name=stem + "/blocks")
    sums = ir.node("ReduceSum", [blocks.outputs[0], axes], attributes={"keepdims": 0}, name=stem + "/block_sums")
    corr = ir.node("MatMul", [sums.outputs[0], mins_t], name=stem + "/min_correction")
    add = ir.node("Add", [nbits.outputs[0], corr.outputs[0]], name=stem + "/add")
    out = node.outputs[0]
    for v, suffix in ((nbits, "nbits"), (blocks, "blocks"), (sums, "sums"), (corr, "corr")):
        v.outputs[0].name = _unique(graph, f"{stem}.{suffix}")
        v.outputs[0].dtype = ir.DataType.FLOAT
    add.outputs[0].name = _unique(graph, stem + ".out")
    add.outputs[0].dtype, add.outputs[0].shape = ir.DataType.FLOAT, out.shape
    graph.insert_before(node, [nbits, blocks, sums, corr, add])
    was_output = out.is_graph_output()
    out.replace_all_uses_with(add.outputs[0], replace_graph_outputs=True)
    if was_output:  # a graph output keeps its name
        name = out.name
        out.name = _unique(graph, name + ".fp32")
        add.outputs[0].name = name
    graph.remove(node, safe=True)


def _to_folded_blocks(graph: ir.Graph, value: ir.Value, t: gguf.GGUFTensor, perm, hf: str) -> None:
    """``value`` (an fp32 initializer) <- Reshape(Cast(q) · Cast(d) [+ Cast(m)]) on block initializers."""
    stem = hf.removeprefix("inner.").removesuffix(".weight")
    if t.type == "Q8_0":
        q, d = t.q8_0()
        m = None
    else:
        q, d, m = t.q4_1()
    q, d = _rows(q, perm), _rows(d, perm)
    n, k = q.shape
    nb = k // gguf.QK
    nodes = []

    def op(kind, inputs, **attrs):
        nd = ir.node(kind, inputs, attributes=attrs or None, name=f"{stem}/{kind}_{len(nodes)}")
        nd.outputs[0].name = _unique(graph, f"{stem}.{kind.lower()}{len(nodes)}")
        nodes.append(nd)
        return nd.outputs[0]

    codes = _const(graph, _unique(graph, stem + ".codes"), q.reshape(n, nb, gguf.QK))
    scales = _const(graph, _unique(graph, stem + ".scales"), d.reshape(n, nb, 1))
    w = op("Mul", [op("Cast", [codes], to=ir.DataType.FLOAT), op("Cast", [scales], to=ir.DataType.FLOAT)])
    if m is not None:
        mins = _const(graph, _unique(graph, stem + ".mins"), _rows(m, perm).reshape(n, nb, 1))
        w = op("Add", [w, op("Cast", [mins], to=ir.DataType.FLOAT)])
    shape = _const(graph, _unique(graph, stem + ".shape"), np.array([n, k], np.int64))
    out = op("Reshape", [w, shape])
    out.dtype, out.shape = ir.DataType.FLOAT, ir.Shape([n, k])
    first = next(iter(graph))
    graph.insert_before(first, nodes)
    ir.convenience.replace_all_uses_with(value, out)
    old = value.name
    graph.initializers.pop(old)
    out.name = old  # consumers and readers see the same tensor name


def _drop_unused(graph: ir.Graph) -> None:
    for name, v in list(graph.initializers.items()):
        if not v.uses() and not v.is_graph_output() and not v.is_graph_input():
            graph.initializers.pop(name)


def _notes(report: BlockReport, g: gguf.GGUFModel, done: set[str]) -> None:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(g.type_counts().items()))
    report.notes.insert(0, f"GGUF tensors: {counts}")
    if report.matmulnbits:
        report.notes.append(f"{len(report.matmulnbits)} Q4_1 projections -> MatMulNBits (4-bit, block 32, "
                            f"accuracy_level {ACCURACY_LEVEL}) + block-sum x minimum correction (exact)")
    for hf in report.stored_blocks:
        t = next(t for name, (t, _) in g.hf_tensors().items() if name == hf)
        report.notes.append(f"{hf} ({t.type}): fp32 arithmetic (Gather / MatMul), stored as its {t.type} blocks "
                            "and rebuilt by Cast/Mul initializer ops ONNX Runtime folds at load (exact); "
                            "MatMulNBits bits=8 is exact but much slower than the fp32 MatMul at accuracy_level 1")
    for hf, (t, _) in g.hf_tensors().items():
        if hf in done or len(t.shape) != 2:
            continue
        if t.type not in gguf.BLOCK_TYPES:
            report.notes.append(f"{hf} ({t.type}): no exact block form here; kept the dequantized fp32")
    unmatched = [hf for hf, (t, _) in g.hf_tensors().items() if t.type in gguf.BLOCK_TYPES and hf not in done]
    if unmatched:
        report.notes.append(f"{len(unmatched)} block tensors not found in the graph (kept fp32): {', '.join(unmatched[:4])}")

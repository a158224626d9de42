"""The graph side of ``quantize-int4``: MatMuls to ``MatMulNBits`` (4 or 8 bits; exact Q4_1 blocks with their
block-sum correction), Gathers to ``GatherBlockQuantized``, and a calibration window as a feed."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN

Kernel = tuple[int, int]  # (block_size, accuracy_level)


def rewrite(model: ir.Model, kernel: Kernel, names: set[int], emb_names: set[int], quant,
            eight: frozenset[int] = frozenset()) -> dict[str, int]:
    """Replace the MatMuls at positions ``names`` (graph order) by MatMulNBits and the Gathers at ``emb_names``
    by GatherBlockQuantized; ``quant(name, w, block_size, table, eight)`` gives the blocks, 8-bit ones for the
    positions in ``eight``."""
    g = model.graph
    bs, level = kernel
    counts: dict[str, int] = {}
    dropped = []
    for i, node in enumerate(list(g)):
        if i not in names and i not in emb_names:
            continue
        is_emb = i in emb_names
        wv = node.inputs[0 if is_emb else 1]
        w = wv.const_value.numpy()
        b = quant(wv.name, w, bs, is_emb, i in eight)
        pre = f"{wv.name}_{i}"
        zp = _init(g, f"{pre}_zp4", b.zero_points) if b.zero_points is not None else None
        if is_emb:
            v, h = w.shape
            q = _init(g, f"{pre}_q4", b.packed.reshape(v, -1))
            sc = _init(g, f"{pre}_scale4", b.scales)
            new = ir.node("GatherBlockQuantized", [q, node.inputs[1], sc] + ([zp] if zp is not None else []),
                          {"gather_axis": 0, "quantize_axis": 1, "block_size": bs, "bits": 4}, domain=MS_DOMAIN,
                          name=f"{pre}_gbq")
            rule = "quantize-int4-embedding"
        else:
            k, n = w.shape
            q = _init(g, f"{pre}_q{b.bits}", b.packed)
            sc = _init(g, f"{pre}_scale4", b.scales.reshape(-1))
            new = ir.node("MatMulNBits", [node.inputs[0], q, sc] + ([zp] if zp is not None else []),
                          {"K": k, "N": n, "bits": b.bits, "block_size": bs, "accuracy_level": level}, domain=MS_DOMAIN,
                          name=f"{pre}_nbits")
            rule = "quantize-int4-matmul" if b.bits == 4 else "quantize-int4-matmul-8bit"
        news = [new]
        if not is_emb and b.mins is not None:  # exact affine blocks: + ReduceSum(x per block) @ minimums
            rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else 3
            nb = b.mins.shape[0]
            shape = _init(g, f"{pre}_block_shape", np.array([0] * (rank - 1) + [nb, bs], np.int64))
            axes = _init(g, f"{pre}_block_axis", np.array([-1], np.int64))
            mins = _init(g, f"{pre}_mins", b.mins)
            blocks = ir.node("Reshape", [node.inputs[0], shape], name=f"{pre}_blocks")
            sums = ir.node("ReduceSum", [blocks.outputs[0], axes], {"keepdims": 0}, name=f"{pre}_block_sums")
            corr = ir.node("MatMul", [sums.outputs[0], mins], name=f"{pre}_min_correction")
            add = ir.node("Add", [new.outputs[0], corr.outputs[0]], name=f"{pre}_add")
            for v in (new, blocks, sums, corr):
                v.outputs[0].type = node.outputs[0].type
            news = [new, blocks, sums, corr, add]
            rule = "quantize-int4-exact-blocks"
        last = news[-1].outputs[0]
        last.shape, last.type = node.outputs[0].shape, node.outputs[0].type
        ir.convenience.replace_nodes_and_values(g, node, [node], news, [node.outputs[0]], [last])
        counts[rule] = counts.get(rule, 0) + 1
        dropped.append(wv)
    for wv in dropped:
        if not wv.uses() and wv.name in g.initializers and not wv.is_graph_output():
            del g.initializers[wv.name]
    if counts:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return counts


def window_feed(model: ir.Model, window) -> dict[str, np.ndarray]:
    """One calibration window as a feed with an empty past."""
    n = len(window)
    feed = {"input_ids": np.asarray(window, np.int64)[None, :], "attention_mask": np.ones((1, n), np.int64)}
    for v in model.graph.inputs:
        if v.name == "position_ids":
            feed[v.name] = np.arange(n, dtype=np.int64)[None, :]
        elif v.name.startswith("past_key_values."):
            dims = [d if isinstance(d, int) else 0 for d in v.shape]
            dims[0] = 1
            feed[v.name] = np.zeros(dims, np.float32)
    return feed


def _init(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                 const_value=ir.tensor(arr, name=name))
    graph.register_initializer(v)
    return v

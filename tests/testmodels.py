"""Small hand-built ONNX models for tests (onnx.helper is fine here: tests are not rewrites)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from graphopt.engine.registry import GraphoptPass, PassResult


def make_mlp(path: Path | None = None, *, opset: int = 17, seed: int = 0) -> onnx.ModelProto:
    """x[batch,8] -> MatMul -> Add -> Relu -> MatMul -> y[batch,4], with a foldable constant chain
    and an Identity, so cleanup has work to do."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Mul", ["b1", "two"], ["b1x2"], name="fold_me"),
        helper.make_node("Add", ["h0", "b1x2"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("Identity", ["h2"], ["h3"], name="ident"),
        helper.make_node("MatMul", ["h3", "w2"], ["y"], name="mm2"),
    ]
    g = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [w1, b1, w2, two],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="graphopt-tests")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    if path is not None:
        onnx.save(m, str(path))
    return m


def make_shared_matmuls(*, seed: int = 0, d: int = 8, layernorm: bool = False, opset: int = 17) -> onnx.ModelProto:
    """One activation ``a`` read by two MatMuls (what the quantize modules look for)::

        x[batch,seq,d] ─[LayerNormalization(gamma, beta)]─ a ─┬─ MatMul(w1[d,16]) ─ Add(b1) ─ Relu ─ y
                                                               └─ MatMul(w2[d,4]) ─ z

    Channel 0 of ``x`` is scaled by 20 through ``w0`` (an activation outlier, for SmoothQuant).
    """
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((d, 16)) * 0.3).astype(np.float32), "w1"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((d, 4)) * 0.3).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([20.0] + [1.0] * (d - 1), np.float32), "w0"),
    ]
    nodes = [helper.make_node("Mul", ["x", "w0"], ["x0"], name="outlier")]
    if layernorm:
        inits += [numpy_helper.from_array((1 + rng.standard_normal(d) * 0.1).astype(np.float32), "gamma"),
                  numpy_helper.from_array((rng.standard_normal(d) * 0.1).astype(np.float32), "beta")]
        nodes.append(helper.make_node("LayerNormalization", ["x0", "gamma", "beta"], ["a"], name="ln", axis=-1))
    else:
        nodes.append(helper.make_node("Identity", ["x0"], ["a"], name="act"))
    nodes += [
        helper.make_node("MatMul", ["a", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["y"], name="relu"),
        helper.make_node("MatMul", ["a", "w2"], ["z"], name="mm2"),
    ]
    g = helper.make_graph(
        nodes, "shared_matmuls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 16]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "seq", 4])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="graphopt-tests")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def embed_layernorm_prologue(w, *, vocab: int, max_pos: int, hidden: int) -> list[onnx.NodeProto]:
    """The fused-encoder test models' first nodes: int64 inputs cast to int32 into EmbedLayerNormalization,
    giving ``x0`` (embeddings) and ``mask_index``; ``mask32`` is the int32 mask. ``w(name, *shape)`` makes an
    initializer and returns its name."""
    return [
        helper.make_node("Cast", ["input_ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Cast", ["token_type_ids"], ["tt32"], to=TensorProto.INT32),
        helper.make_node("Cast", ["attention_mask"], ["mask32"], to=TensorProto.INT32),
        helper.make_node("EmbedLayerNormalization",
                         ["ids32", "tt32", w("word", vocab, hidden), w("ptab", max_pos, hidden), w("ttab", 2, hidden),
                          w("g0", hidden), w("b0", hidden), "mask32"], ["x0", "mask_index"],
                         domain="com.microsoft", epsilon=1e-5),
    ]


def tiny_bert_feeds(path, n: int = 6, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` right-padded batches of 4 x 16 for the seeded tiny BERT at ``path`` (models/tiny.py; its own input
    names)."""
    import onnx_ir as ir

    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(n):
        lens = rng.integers(3, 17, size=4)
        mask = (np.arange(16)[None, :] < lens[:, None]).astype(np.int64)
        feeds.append({"input_ids": (rng.integers(1, 1000, size=(4, 16)) * mask).astype(np.int64),
                      "attention_mask": mask, "token_type_ids": np.zeros((4, 16), np.int64)})
    names = {v.name for v in ir.load(path).graph.inputs}
    return [{k: v for k, v in f.items() if k in names} for f in feeds]


class RenamesNodes(GraphoptPass):
    """Test-only pass, truly lossless and free at run time: gives every node a new name (``renamed_K``)."""

    name = "test-rename-nodes"

    def call(self, model, ctx):
        for k, node in enumerate(model.graph):
            node.name = f"renamed_{k}"
        return PassResult(model, True)


def summed_head(model, *, seed: int = 5):
    """``model`` (onnx_ir, changed in place and returned) with its LM head ``MatMul`` as the ``Add`` of two MatMuls
    over the same input, ``head_part0`` / ``head_part1`` (the form of q8-tables' nibble head), the same function."""
    g = model.graph
    out = next(o for o in g.outputs if o.name == "logits")
    head = out.producer()
    w = head.inputs[1]
    table = w.const_value.numpy() if w.const_value is not None else w.producer().inputs[0].const_value.numpy().T
    part = np.random.default_rng(seed).standard_normal(table.shape).astype(np.float32) * 0.01
    halves = []
    for i, arr in enumerate((table - part, part)):
        v = ir.Value(name=f"head.part{i}", const_value=ir.tensor(np.ascontiguousarray(arr), name=f"head.part{i}"))
        g.register_initializer(v)
        halves.append(ir.node("MatMul", [head.inputs[0], v], name=f"head_part{i}",
                              outputs=[ir.Value(name=f"logits.part{i}", type=out.type, shape=out.shape)]))
    total = ir.Value(name="logits.sum", type=out.type, shape=out.shape)
    g.insert_after(head, [*halves, ir.node("Add", [h.outputs[0] for h in halves], outputs=[total], name="head_sum")])
    g.outputs[list(g.outputs).index(out)] = total
    g.remove(head, safe=True)
    out.name, total.name = "logits.unused", "logits"
    return model

#!/usr/bin/env python
"""Random-weight Llama-style decoders of a chosen size, written straight to ONNX with external data.

No torch: the forward graph is built from standard ops with onnx-ir (Gather embedding, RMSNorm as
Pow/ReduceMean/Add/Sqrt/Div/Mul, MatMul projections, causal attention via MatMul/Softmax with a
Trilu mask, SiLU MLP as Sigmoid*Mul, a final RMSNorm and an lm_head MatMul). Input ``input_ids``
``[batch, seq]`` int64, output ``logits`` ``[batch, seq, vocab]`` float32. No rotary embedding.

Weights are float32, normal(0, 0.02) from ``numpy.random.default_rng(seed)`` drawn tensor by
tensor in a fixed order (deterministic for a seed and size). Each tensor is written to
``<out>.data`` as soon as it is drawn and referenced as an ``onnx_ir.ExternalTensor``, so the
generator never holds more than one tensor's data (the largest is the embedding or lm_head).

Sizes (``--params``; about, in parameters; vocab 32000):

==========  ======  ============  ======  =====
preset      hidden  intermediate  layers  heads
==========  ======  ============  ======  =====
``0.02b``   256     688           8       4
``0.1b``    768     2048          8       12
``0.4b``    1024    2816          24      16
``1b``      2048    5632          16      16
``2b``      2560    6912          24      20
==========  ======  ============  ======  =====

Usage::

    python models/big_decoder.py --params 0.4b -o /tmp/big/dec-0.4b.onnx
    python models/big_decoder.py --hidden 512 --layers 4 --intermediate 1376 --heads 8 -o x.onnx
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir

OPSET = 18


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int = 32000

    @property
    def params(self) -> int:
        per_layer = 4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


PRESETS: dict[str, Size] = {
    "0.02b": Size(256, 688, 8, 4),
    "0.1b": Size(768, 2048, 8, 12),
    "0.4b": Size(1024, 2816, 24, 16),
    "1b": Size(2048, 5632, 16, 16),
    "2b": Size(2560, 6912, 24, 20),
}


class _Writer:
    """Appends tensors to one external-data file and builds the initializers that point into it."""

    ALIGN = 4096

    def __init__(self, graph: ir.Graph, data_path: Path, rng: np.random.Generator):
        self.graph, self.rng = graph, rng
        self.data_path = data_path
        self.f = open(data_path, "wb")  # noqa: SIM115 (closed by close())

    def close(self) -> None:
        self.f.close()

    def _external(self, name: str, arr: np.ndarray) -> ir.Value:
        pad = (-self.f.tell()) % self.ALIGN
        if pad:
            self.f.write(b"\0" * pad)
        offset = self.f.tell()
        self.f.write(arr.tobytes())
        tensor = ir.ExternalTensor(
            self.data_path.name, offset, arr.nbytes, ir.DataType.FLOAT, shape=ir.Shape(arr.shape), name=name,
            base_dir=self.data_path.parent,
        )
        v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=tensor)
        self.graph.register_initializer(v)
        return v

    def random(self, name: str, shape: tuple[int, ...]) -> ir.Value:
        arr = self.rng.standard_normal(shape, dtype=np.float32)
        arr *= np.float32(0.02)
        v = self._external(name, arr)
        del arr
        return v

    def ones(self, name: str, n: int) -> ir.Value:
        return self._external(name, np.ones((n,), dtype=np.float32))

    def const(self, name: str, arr: np.ndarray) -> ir.Value:
        """A small inline initializer (shapes, scalars)."""
        v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                     const_value=ir.tensor(arr, name=name))
        self.graph.register_initializer(v)
        return v


def build(size: Size, out: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write the decoder of ``size`` to ``out`` (+ ``out.data``); returns the model path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data_path = out.with_name(out.name + ".data")
    h, nh = size.hidden, size.heads
    if h % nh:
        raise SystemExit(f"hidden {h} is not a multiple of heads {nh}")
    hd = h // nh

    batch, seq = ir.SymbolicDim("batch"), ir.SymbolicDim("seq")
    ids = ir.Value(name="input_ids", shape=ir.Shape([batch, seq]), type=ir.TensorType(ir.DataType.INT64))
    logits = None
    graph = ir.Graph([ids], [], nodes=[], opset_imports={"": OPSET}, name="big_decoder")
    tape = ir.tape.Tape(graph)
    w = _Writer(graph, data_path, np.random.default_rng(seed))
    try:
        eps = w.const("eps", np.array(1e-6, dtype=np.float32))
        two = w.const("two", np.array(2.0, dtype=np.float32))
        scale = w.const("attn_scale", np.array(1.0 / np.sqrt(hd), dtype=np.float32))
        neg = w.const("neg_inf", np.array(-1e9, dtype=np.float32))
        heads_shape = w.const("heads_shape", np.array([0, 0, nh, hd], dtype=np.int64))
        merge_shape = w.const("merge_shape", np.array([0, 0, h], dtype=np.int64))
        axes_last = w.const("axes_last", np.array([-1], dtype=np.int64))

        def rmsnorm(x: ir.Value, weight: ir.Value) -> ir.Value:
            var = tape.op("ReduceMean", [tape.op("Pow", [x, two]), axes_last], attributes={"keepdims": 1})
            return tape.op("Mul", [tape.op("Div", [x, tape.op("Sqrt", [tape.op("Add", [var, eps])])]), weight])

        def split_heads(x: ir.Value) -> ir.Value:  # [b, s, h] -> [b, nh, s, hd]
            return tape.op("Transpose", [tape.op("Reshape", [x, heads_shape])], attributes={"perm": [0, 2, 1, 3]})

        x = tape.op("Gather", [w.random("embed_tokens.weight", (size.vocab, h)), ids], attributes={"axis": 0})
        # causal mask [s, s]: 0 on and below the diagonal, -1e9 above
        seq_len = tape.op("Shape", [ids], attributes={"start": 1, "end": 2})
        square = tape.op("Concat", [seq_len, seq_len], attributes={"axis": 0})
        ones = tape.op("ConstantOfShape", [square], attributes={"value": ir.tensor(np.array([1.0], np.float32))})
        one = w.const("one", np.array(1, dtype=np.int64))
        mask = tape.op("Mul", [tape.op("Trilu", [ones, one], attributes={"upper": 1}), neg])
        for i in range(size.layers):
            p = f"layers.{i}."
            n = rmsnorm(x, w.ones(p + "input_layernorm.weight", h))
            q = split_heads(tape.op("MatMul", [n, w.random(p + "self_attn.q_proj.weight", (h, h))]))
            k = split_heads(tape.op("MatMul", [n, w.random(p + "self_attn.k_proj.weight", (h, h))]))
            v = split_heads(tape.op("MatMul", [n, w.random(p + "self_attn.v_proj.weight", (h, h))]))
            kt = tape.op("Transpose", [k], attributes={"perm": [0, 1, 3, 2]})
            scores = tape.op("Add", [tape.op("Mul", [tape.op("MatMul", [q, kt]), scale]), mask])
            attn = tape.op("MatMul", [tape.op("Softmax", [scores], attributes={"axis": -1}), v])
            attn = tape.op("Reshape", [tape.op("Transpose", [attn], attributes={"perm": [0, 2, 1, 3]}), merge_shape])
            x = tape.op("Add", [x, tape.op("MatMul", [attn, w.random(p + "self_attn.o_proj.weight", (h, h))])])
            n = rmsnorm(x, w.ones(p + "post_attention_layernorm.weight", h))
            gate = tape.op("MatMul", [n, w.random(p + "mlp.gate_proj.weight", (h, size.intermediate))])
            up = tape.op("MatMul", [n, w.random(p + "mlp.up_proj.weight", (h, size.intermediate))])
            act = tape.op("Mul", [tape.op("Mul", [gate, tape.op("Sigmoid", [gate])]), up])
            x = tape.op("Add", [x, tape.op("MatMul", [act, w.random(p + "mlp.down_proj.weight", (size.intermediate, h))])])
        x = rmsnorm(x, w.ones("norm.weight", h))
        logits = tape.op("MatMul", [x, w.random("lm_head.weight", (h, size.vocab))])
    finally:
        w.close()
    logits.name = "logits"
    logits.shape = ir.Shape([batch, seq, size.vocab])
    logits.type = ir.TensorType(ir.DataType.FLOAT)
    graph.outputs.append(logits)
    for j, node in enumerate(graph):
        node.name = f"n{j}_{node.op_type}"
    model = ir.Model(graph, ir_version=9, producer_name="graphopt.models.big_decoder")
    ir.save(model, out)  # external tensors are written as references; their data is never read
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", choices=sorted(PRESETS), default="0.1b", help="size preset")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args(argv)
    size = PRESETS[a.params]
    size = dataclasses.replace(size, **{k: getattr(a, k) for k in ("hidden", "intermediate", "layers", "heads", "vocab")
                                        if getattr(a, k) is not None})
    path = build(size, a.out, seed=a.seed)
    print(f"{path}: {size.params / 1e9:.3f} B parameters, {size.params * 4 / 2**30:.2f} GiB of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Micro-benchmark: dense MatMul vs the sparse forms ``sparsify`` emits, one GEMM ``X[M, K] @ W[K, N]``.

Forms: ``blocks RxC`` (``ai.graphopt::BlockSparseMatMul``, balanced blocks of R rows x C columns; ``--blocks``
lists the block shapes), ``neurons`` (a plain MatMul on the kept output columns: what pruning whole FFN
neurons leaves), ``2:4`` (``ai.graphopt::NMSparseMatMul``, 50% only), ``unstructured`` (zeros in a dense
MatMul: the same kernel as dense). Shapes: MiniLM's FFN (W1 384x1536, W2 1536x384) and BERT-base's
(768x3072, 3072x768); M in {1, 16, 128}. All sessions of one (shape, M) are timed
interleaved (``graphopt.bench.bench_sessions``, spinning off, one thread); the table gives medians and
dense/form ratios.

    python tools/bench_sparse_gemm.py [--rounds 15] [--threads 1] [--blocks 32x32,32x128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import onnx_ir as ir

from graphopt.bench import bench_sessions, open_sessions, speedups
from graphopt.runtime import custom_ops

SHAPES = {"minilm": (384, 1536), "minilm-w2": (1536, 384), "bert-base": (768, 3072), "bert-base-w2": (3072, 768)}
SPARSITIES = (0.5, 0.75, 0.9)


def _model(k: int, n_out: int, op: str, consts: dict[str, np.ndarray], attrs: dict[str, int]) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape(["M", k]), type=ir.TensorType(ir.DataType.FLOAT))
    vals = [ir.Value(name=name, const_value=ir.tensor(a, name=name)) for name, a in consts.items()]
    y = ir.Value(name="y", shape=ir.Shape(["M", n_out]), type=ir.TensorType(ir.DataType.FLOAT))
    domain = custom_ops.DOMAIN if op != "MatMul" else ""
    node = ir.Node(domain, op, [x, *vals], attributes=[ir.AttrInt64(a, v) for a, v in attrs.items()], outputs=[y])
    model = ir.Model(ir.Graph([x], [y], nodes=[node], initializers=vals, opset_imports={"": 17}, name="g"),
                     ir_version=10)
    custom_ops.attach(model)
    return model


def forms(k: int, n: int, blocks: list[tuple[int, int]], rng: np.random.Generator) -> dict[str, ir.Model]:
    """The models compared for one weight shape (``blocks``: (rows, cols) block shapes)."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    out = {"dense": _model(k, n, "MatMul", {"w": w}, {})}
    for s in SPARSITIES:
        for br, bc in blocks:
            kb, nb = k // br, n // bc
            keep = np.zeros((kb, nb), bool)
            kept = max(1, round(kb * (1 - s)))
            for j in range(nb):
                keep[rng.choice(kb, size=kept, replace=False), j] = True
            wb, idx = custom_ops.pack_blocks(w * np.kron(keep, np.ones((br, bc), bool)), keep, br, bc)
            out[f"blocks {br}x{bc} {s:.0%}"] = _model(k, n, "BlockSparseMatMul", {"wb": wb, "idx": idx},
                                                     {"block_size": br})
        cols = max(1, round(n * (1 - s)))
        out[f"neurons {s:.0%}"] = _model(k, cols, "MatMul", {"w": np.ascontiguousarray(w[:, :cols])}, {})
    keep = np.zeros((k // 4, 4, n), bool)
    keep[:, :2, :] = True
    keep = rng.permuted(keep, axis=1).reshape(k, n)
    vals, pos = custom_ops.pack_nm(np.where(keep, w, 0), keep)
    out["2:4 50%"] = _model(k, n, "NMSparseMatMul", {"v": vals, "p": pos}, {"n": 2, "m": 4})
    out["unstructured 75%"] = _model(k, n, "MatMul", {"w": np.where(rng.random((k, n)) < 0.75, 0, w)
                                                       .astype(np.float32)}, {})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", default="32x32,32x128", help="block shapes, rows x cols, comma-separated")
    ap.add_argument("--ms", default="1,16,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: the calling thread's CPU time (one thread: robust to other jobs on the cores)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
        models = forms(k, n, blocks, rng)
        sessions = open_sessions(models, threads=args.threads)
        for m_rows in (int(v) for v in args.ms.split(",")):
            feeds = [{"x": rng.standard_normal((m_rows, k)).astype(np.float32)}]
            reps = max(1, 64 // m_rows)  # small M: several runs per timed turn
            res = bench_sessions(sessions, feeds * reps, rounds=args.rounds, warmup=2, clock=args.clock)
            speedup = speedups(res, base="dense")
            print(f"\n{shape} W[{k}x{n}] M={m_rows}  (median of {args.rounds} interleaved rounds, {reps} runs each)")
            for r in res:
                us = r.p50 / reps * 1e6
                print(f"  {r.name:22s} {us:9.1f} us   {speedup[r.name]:5.2f}x")
                rows.append({"shape": shape, "K": k, "N": n, "M": m_rows, "form": r.name, "us": round(us, 1),
                             "speedup": round(speedup[r.name], 3)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

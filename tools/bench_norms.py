#!/usr/bin/env python
"""Microbenchmark of residual LayerNorm forms on ONNX Runtime's CPU provider (why ``fuse`` emits Sum + LayerNorm).

A chain of 12 residual norms at hidden 384 (``o_i = norm(y + bias_i + o_{i-1})``), in each form:

    skip-ln           com.microsoft SkipLayerNormalization(y, x, gamma, beta, bias)
    add-ln@basic      Add + Add + LayerNormalization, ORT basic optimizations (left unfused)
    add-ln@all        the same at ORT_ENABLE_ALL (ORT turns it back into SkipLayerNormalization)
    sum-ln            Sum(y, bias, x) + LayerNormalization (what ``fuse`` emits on CPU)
    skip-simplified   com.microsoft SkipSimplifiedLayerNormalization
    sum-simplified    Sum + SimplifiedLayerNormalization

All sessions in one process, 1 intra-op thread, spinning off, interleaved round-robin
(graphopt.bench.bench_sessions), thread CPU time, medians; outputs are checked equal first.

    .venv/bin/python tools/bench_norms.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

LAYERS, HIDDEN = 12, 384
FORMS = ("skip-ln", "add-ln@basic", "add-ln@all", "sum-ln", "skip-simplified", "sum-simplified")


def chain(form: str) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    from graphopt.opsets import MS_DOMAIN

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(LAYERS):
        for name in ("g", "b", "bias"):
            arr = rng.standard_normal(HIDDEN).astype(np.float32) * 0.1 + (1.0 if name == "g" else 0.0)
            inits.append(numpy_helper.from_array(arr, f"{name}{i}"))
        out = f"o{i}"
        if form == "skip-ln":
            nodes.append(helper.make_node("SkipLayerNormalization", ["y", x, f"g{i}", f"b{i}", f"bias{i}"], [out],
                                          domain=MS_DOMAIN, epsilon=1e-12))
        elif form == "skip-simplified":
            nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", ["y", x, f"g{i}", f"bias{i}"], [out],
                                          domain=MS_DOMAIN, epsilon=1e-12))
        elif form.startswith("add-ln"):
            nodes += [helper.make_node("Add", ["y", f"bias{i}"], [f"a{i}"]),
                      helper.make_node("Add", [f"a{i}", x], [f"c{i}"]),
                      helper.make_node("LayerNormalization", [f"c{i}", f"g{i}", f"b{i}"], [out], axis=-1, epsilon=1e-12)]
        else:  # sum-ln, sum-simplified
            nodes.append(helper.make_node("Sum", ["y", f"bias{i}", x], [f"c{i}"]))
            if form == "sum-ln":
                nodes.append(helper.make_node("LayerNormalization", [f"c{i}", f"g{i}", f"b{i}"], [out], axis=-1,
                                              epsilon=1e-12))
            else:
                nodes.append(helper.make_node("SimplifiedLayerNormalization", [f"c{i}", f"g{i}"], [out], axis=-1,
                                              epsilon=1e-12))
        x = out
    dims = ["B", "S", HIDDEN]
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
                                            helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
    return model.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)

    from graphopt.bench import Table, bench_sessions
    from graphopt.runtime.session import make_session

    sessions = {f: make_session(chain(f), threads=1, spinning=False, level="basic" if f.endswith("@basic") else None)
                for f in FORMS}
    rng = np.random.default_rng(1)
    table = Table(["form", *(f"{b}x{s} ms" for b, s in ((1, 128), (32, 68)))])
    table.header()
    rows: dict[str, list[str]] = {f: [] for f in FORMS}
    for shape in ((1, 128), (32, 68)):
        feed = {"x": rng.standard_normal((*shape, HIDDEN)).astype(np.float32),
                "y": rng.standard_normal((*shape, HIDDEN)).astype(np.float32)}
        for group in (FORMS[:4], FORMS[4:]):  # each family must agree before it is timed
            outs = [sessions[f].run(None, feed)[0] for f in group]
            worst = max(float(np.abs(o - outs[0]).max()) for o in outs)
            if worst > 1e-3:
                print(f"forms {group} disagree: max diff {worst:.2e}", file=sys.stderr)
                return 1
        for r in bench_sessions(sessions, [feed], rounds=args.rounds, warmup=2, clock="cpu"):
            rows[r.name].append(f"{r.p50 * 1e3:.2f}")
    for f in FORMS:
        table.row(f, *rows[f])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

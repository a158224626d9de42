#!/usr/bin/env python
"""int8 efficiency at 1 thread: the int8 GEMM rate a quantized model achieves against its GEMMs alone.

For each model: an ORT profile (1 intra-op thread) over the held-back batches gives the time per op type
and the shape of every int8 GEMM it runs (``MatMulIntegerToFloat``, ``MatMulInteger``,
``DynamicQuantizeMatMul``: M from the activation, K and N from the weight); the model's int8 GEMM ops per
round are ``2*M*K*N`` summed over them. A *GEMMs-alone* model is then built with exactly those GEMMs
(one ``MatMulIntegerToFloat`` per GEMM of the model, same K, N, bias or not, fed random u8 activations of
each batch's M) and, for reference, the same with ``MatMulInteger`` (int32 out, no dequantization). All
models and their GEMMs-alone models are timed in one process, round-robin, spinning off, 1 intra-op
thread (``graphopt.bench``), by the calling thread's CPU time by default (``--clock cpu``):

    efficiency = (GEMM ops / model time) / (GEMM ops / GEMMs-alone time) = GEMMs-alone time / model time

so it is the share of the model's time its int8 GEMMs would take at the rate they reach alone.

Workload: ``tools/workload.py`` sentences in random arrival order (as ``tools/bench_quant.py``), batch
32; the first ``--calib`` sentences calibrate ``--build``'s int8 recipe (the pipeline uses half of them to
calibrate and half to confirm the budget), the rest are held back for timing and accuracy. Accuracy:
per-token cosine (mean / min, as the quantize budget) and mean-pooled sentence cosine (mean / min)
against the fp32 ONNX export on the held-back batches.

Usage::

    python tools/bench_int8_efficiency.py --build /tmp/int8eff [MODEL.onnx ...] [--rounds 10] [--json out.json]

``--build DIR`` writes DIR/int8.onnx (``--recipe int8`` of the dynamo-sdpa MiniLM export, the current
code) and benches it first; further MODEL paths (for example the same recipe built by older code) are
benched beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "models"))
sys.path.insert(0, str(REPO / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workload import token_batches  # noqa: E402

GEMM_OPS = ("MatMulIntegerToFloat", "MatMulInteger", "DynamicQuantizeMatMul")


def profile(path: str, feeds: list[dict[str, np.ndarray]], runs: int = 2) -> dict:
    """ORT profile at 1 thread: kernel ms per op type per round, calls per round, and the int8 GEMMs of
    each feed as (node, M, K, N, has_bias) in execution order."""
    import onnxruntime as ort

    from graphopt.bench.harness import round_robin
    from graphopt.runtime import session as runtime

    with tempfile.TemporaryDirectory(prefix="int8eff-prof-") as d:
        so = runtime.session_options(threads=1, spinning=False)
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(d, "p")
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        wanted = {i.name for i in sess.get_inputs()}
        # one warm-up round, not profiled separately: ORT profiles every run, we drop the first round
        round_robin({"profile": [lambda f=f: sess.run(None, {k: v for k, v in f.items() if k in wanted})
                                 for f in feeds]}, rounds=runs, warmup=1)
        events = json.load(open(sess.end_profiling()))
    model_runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    first_timed = model_runs[len(feeds)]["ts"] if len(model_runs) > len(feeds) else 0
    per_op: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    gemms: list[list[tuple]] = [[] for _ in feeds]
    run_starts = [e["ts"] for e in model_runs]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        op = e["args"]["op_name"]
        if e["ts"] >= first_timed:
            per_op[op] += e["dur"]
            calls[op] += 1
        if op in GEMM_OPS and e["ts"] < first_timed:  # shapes from the first (warm-up) round, one list per feed
            i = int(np.searchsorted(run_starts, e["ts"], side="right")) - 1
            x = next(iter(e["args"]["input_type_shape"][0].values()))
            y = next(iter(e["args"]["output_type_shape"][0].values()))
            gemms[i].append((e["name"][: -len("_kernel_time")], int(np.prod(x[:-1])), int(x[-1]), int(y[-1])))
    total_run = sum(e["dur"] for e in model_runs if e["ts"] >= first_timed) / runs
    return {
        "per_op_ms": {k: v / 1e3 / runs for k, v in per_op.most_common()},
        "calls": {k: v // runs for k, v in calls.items()},
        "run_ms": total_run / 1e3,
        "gemms": gemms,
    }


def gemm_bias(path: str) -> dict[str, bool]:
    """Node name -> whether that int8 GEMM node has a bias input."""
    import onnx

    m = onnx.load(path, load_external_data=False)
    out = {}
    for n in m.graph.node:
        if n.op_type in GEMM_OPS:
            i = 6 if n.op_type == "MatMulIntegerToFloat" else 4
            out[n.name] = len(n.input) > i and bool(n.input[i])
    return out


def gemms_alone(gemms: list[list[tuple]], bias: dict[str, bool], op: str, tag: str
                ) -> tuple[bytes, list[dict[str, np.ndarray]]]:
    """A model running the given GEMMs side by side (one input each), and its feeds per batch."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    first = gemms[0]
    nodes, inits, inputs, outputs = [], [], [], []
    for j, (name, _, k, n) in enumerate(first):
        x, w, y = f"{tag}_x{j}", f"{tag}_w{j}", f"{tag}_y{j}"
        inputs.append(helper.make_tensor_value_info(x, TensorProto.UINT8, ["M", k]))
        inits.append(numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), w))
        zp = numpy_helper.from_array(np.array(128, np.uint8), f"{tag}_zp{j}")
        inits.append(zp)
        if op == "MatMulInteger":
            nodes.append(helper.make_node("MatMulInteger", [x, w, zp.name], [y]))
            outputs.append(helper.make_tensor_value_info(y, TensorProto.INT32, ["M", n]))
            continue
        xs = numpy_helper.from_array(np.array(0.02, np.float32), f"{tag}_xs{j}")
        ws = numpy_helper.from_array(np.full(n, 0.01, np.float32), f"{tag}_ws{j}")
        ins = [x, w, xs.name, ws.name, zp.name, "", ""]
        inits += [xs, ws]
        if bias.get(name):
            b = numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"{tag}_b{j}")
            inits.append(b)
            ins[6] = b.name
        nodes.append(helper.make_node("MatMulIntegerToFloat", ins, [y], domain="com.microsoft"))
        outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, ["M", n]))
    graph = helper.make_graph(nodes, "gemms_alone", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    feeds = []
    for batch in gemms:
        if [g[2:] for g in batch] != [g[2:] for g in first]:
            raise SystemExit("the model runs different GEMMs on different batches: not supported")
        feeds.append({f"{tag}_x{j}": rng.integers(0, 256, (m, k)).astype(np.uint8)
                      for j, (_, m, k, _) in enumerate(batch)})
    return model.SerializeToString(), feeds


def _pool(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    return (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)


def accuracy(path: str, held: list[dict[str, np.ndarray]], ref: list[dict[str, np.ndarray]]) -> dict:
    from graphopt.data.metrics import compare
    from graphopt.runtime import session as runtime

    sess = runtime.make_session(path, threads=1)
    got = runtime.run(sess, held)
    c = compare(got, ref, held)
    g = np.concatenate([_pool(o["last_hidden_state"], f["attention_mask"]) for o, f in zip(got, held)])
    r = np.concatenate([_pool(o["last_hidden_state"], f["attention_mask"]) for o, f in zip(ref, held)])
    sent = (g * r).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1))
    return {"token_cosine": c.worst("cosine"), "token_cosine_min": c.worst("cosine_min"),
            "sentence_cosine": float(sent.mean()), "sentence_cosine_min": float(sent.min())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="int8 models to bench (after --build's)")
    ap.add_argument("--build", help="folder: build the int8 recipe of the MiniLM dynamo-sdpa export here first")
    ap.add_argument("-n", type=int, default=400, help="sentences in all")
    ap.add_argument("--calib", type=int, default=192, help="calibration sentences (the rest are held back)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--profile-runs", type=int, default=2, help="profiled rounds per model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    import minilm
    import transformers
    import workload

    from graphopt import io
    from graphopt.bench import Table, bench_sessions, print_table
    from graphopt.runtime import session as runtime

    tok = transformers.AutoTokenizer.from_pretrained(minilm.source_folder())
    sentences = workload.generate(args.n, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    sentences = [sentences[i] for i in rng.permutation(len(sentences))]  # random arrival order
    calib, held = token_batches(tok, sentences[: args.calib]), token_batches(tok, sentences[args.calib:])
    fp32 = minilm.build("dynamo", "sdpa")
    paths: dict[str, str] = {}
    if args.build:
        from graphopt.engine.options import OptimizeOptions
        from graphopt.engine.pipeline import optimize
        from graphopt.engine.recipe import load

        out = Path(args.build)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        res = optimize(str(fp32), OptimizeOptions(recipe=load("int8"), feeds=calib))
        if not res.report.ok:
            raise SystemExit("the int8 recipe failed: " + "; ".join(p.error or "" for p in res.report.passes))
        io.save(res.model, out / "int8.onnx")
        paths["int8 recipe (this code)"] = str(out / "int8.onnx")
        print(f"built {out / 'int8.onnx'} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        for p in res.report.passes:
            if p.name == "quantize":
                print("  " + "\n  ".join(p.notes[-3:]), file=sys.stderr)
    for p in args.models:
        name = Path(p).stem
        while name in paths:
            name += "'"
        paths[name] = p
    if not paths:
        raise SystemExit("nothing to bench: give --build DIR and/or model paths")

    ref = runtime.run(runtime.make_session(str(fp32), threads=1), held)
    rows, sessions, feeds = [], {}, [dict(f) for f in held]
    for i, (name, path) in enumerate(paths.items()):
        prof = profile(path, held, args.profile_runs)
        bias = gemm_bias(path)
        ops = sum(2 * m * k * n for batch in prof["gemms"] for _, m, k, n in batch)
        row = {"model": name, "path": path, "gemm_gop_per_round": ops / 1e9, "gemms_per_batch": len(prof["gemms"][0]),
               "profile": prof, **accuracy(path, held, ref)}
        rows.append(row)
        sessions[name] = runtime.make_session(path, threads=1, spinning=False)
        variants = [("MatMulIntegerToFloat", "alone")] + ([("MatMulInteger", "alone_mmi")] if i == 0 else [])
        for op, suffix in variants:
            data, gfeeds = gemms_alone(prof["gemms"], bias, op, f"m{i}_{suffix}")
            sessions[f"{name}: GEMMs alone ({op})"] = runtime.make_session(data, threads=1, spinning=False)
            for f, g in zip(feeds, gfeeds):
                f.update(g)
    load = os.getloadavg()
    results = {r.name: r for r in bench_sessions(sessions, feeds, rounds=args.rounds, warmup=1, clock=args.clock)}
    print(f"\n{len(held)} held-back batches of 32 per round, {args.rounds} rounds, clock {args.clock}, 1 thread; "
          f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print()
    table = Table(["model", "round ms", "sentences/s", "int8 GEMM GOP/round", "model GOP/s", "GEMMs alone GOP/s (MMI2F)",
                   "**efficiency**", "token cos / min", "sentence cos / min"])
    table.header()
    for i, row in enumerate(rows):
        r = results[row["model"]]
        alone = results[f"{row['model']}: GEMMs alone (MatMulIntegerToFloat)"]
        gop = row["gemm_gop_per_round"]
        row.update(round_ms=1e3 * r.p50, sentences_per_s=r.throughput, model_gops=gop / r.p50,
                   alone_ms=1e3 * alone.p50, alone_gops=gop / alone.p50, efficiency=alone.p50 / r.p50)
        if i == 0:
            mmi = results[f"{row['model']}: GEMMs alone (MatMulInteger)"]
            row.update(alone_matmulinteger_gops=gop / mmi.p50, efficiency_vs_matmulinteger=mmi.p50 / r.p50)
        table.row(row["model"], f"{row['round_ms']:.1f}", f"{row['sentences_per_s']:.1f}", f"{gop:.2f}",
                  f"{row['model_gops']:.0f}", f"{row['alone_gops']:.0f}", f"**{row['efficiency']:.1%}**",
                  f"{row['token_cosine']:.4f} / {row['token_cosine_min']:.4f}",
                  f"{row['sentence_cosine']:.4f} / {row['sentence_cosine_min']:.4f}")
    if "alone_matmulinteger_gops" in rows[0]:
        print(f"\n(first model: GEMMs alone as MatMulInteger, int32 out: {rows[0]['alone_matmulinteger_gops']:.0f} GOP/s; "
              f"efficiency against it {rows[0]['efficiency_vs_matmulinteger']:.1%})")
    for row in rows:
        prof = row["profile"]
        tot = sum(prof["per_op_ms"].values())
        gemm = sum(v for k, v in prof["per_op_ms"].items() if k in GEMM_OPS)
        print(f"\nprofile of {row['model']} (ORT, 1 thread, per round): model_run {prof['run_ms']:.1f} ms, kernels "
              f"{tot:.1f} ms, int8 GEMM kernels {gemm:.1f} ms ({gemm / tot:.1%}); {row['gemms_per_batch']} GEMMs per batch")
        print_table(["op", "ms / round", "share of kernel time", "calls / round"],
                    [[op, f"{ms:.1f}", f"{ms / tot:.1%}", prof["calls"][op]] for op, ms in prof["per_op_ms"].items()
                     if ms / tot >= 0.003])
        del prof["gemms"]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

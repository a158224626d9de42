#!/usr/bin/env python
"""Quantization benchmark on MiniLM: ORT's quantizers against graphopt's ``quantize`` pass.

Variants, all from one fp32 fused MiniLM (``--source graphopt``, the default: ``cleanup,fuse`` of
graphopt on the ``--exporter`` export; ``--source ort``: ORT's transformers optimizer on the TorchScript
eager export): fp32 fused; ORT ``quantize_dynamic`` per-tensor and per-channel; ORT ``quantize_static``
(QDQ); graphopt ``quantize`` default (auto: finds the configuration itself), dynamic, static without
SmoothQuant, static with SmoothQuant, and int4 (MatMulNBits, accuracy_level 4, int8 embeddings).
ORT's quantizers get the fused model with ``qkv_hidden_sizes`` of equal thirds removed (the default
split; ORT's QAttention has no such attribute and its quantizer copies it over).

Sentences come from ``tools/workload.py``: the first ``--calib`` are the calibration part (graphopt,
like ``graphopt optimize --calib``, calibrates on its first half and confirms the budget on the
second; ORT's static quantizer calibrates on all of it), the rest are held back for the table only. Accuracy is the cosine of sentence embeddings (mean-pooled last_hidden_state over real
tokens, as sentence-transformers does) against the fp32 PyTorch model on the held-back sentences.
Speed: batch 32 in random order, every variant loaded in one process and run round-robin, spinning
off, 1 thread, timed by the calling thread's CPU time by default (``--clock cpu``, as
``tools/bench_fusion.py``: waiting for a core held by other jobs is not counted).

Usage::

    python tools/bench_quant.py [-n 400] [--calib 192] [--rounds 6] [--clock cpu] [--h2h-rounds 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
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


def _pool(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    return (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)


def _cosines(got: list[np.ndarray], ref: list[np.ndarray]) -> np.ndarray:
    g, r = np.concatenate(got), np.concatenate(ref)
    return (g * r).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1))


def _bench(paths: dict[str, Path], feeds: list[dict[str, np.ndarray]], rounds: int, clock: str) -> list[dict]:
    """Round-robin over the models (``graphopt.bench``), every held-back batch per turn; median per model."""
    from graphopt.bench import bench_sessions, open_sessions

    sessions = open_sessions({n: str(p) for n, p in paths.items()}, optimize=True)
    results = bench_sessions(sessions, feeds, rounds=rounds, warmup=1, clock=clock)
    return [{"name": r.name, "p50": r.p50, "throughput": r.throughput} for r in results]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=400, help="sentences in all")
    ap.add_argument("--calib", type=int, default=192,
                    help="calibration sentences (graphopt: half to calibrate, half to confirm; the rest are held back)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--out", help="folder for the quantized models (default: a temp folder)")
    ap.add_argument("--source", choices=("graphopt", "ort"), default="graphopt", help="who fuses the fp32 model")
    ap.add_argument("--exporter", default="dynamo-sdpa", help="MiniLM export for --source graphopt")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="thread CPU time or wall time")
    ap.add_argument("--h2h-rounds", type=int, default=0,
                    help="then bench fp32, ORT dynamic per-channel and graphopt default alone for this many rounds")
    ap.add_argument("--packed", action="store_true",
                    help="also the default recipe's packed model (remove-padding), ORT dynamic and graphopt "
                         "quantize on it (the `int8` recipe)")
    ap.add_argument("--only", default="", help="comma-separated substrings: bench only matching variants")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import minilm
    import onnx
    import torch
    import transformers
    import workload
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.transformers.optimizer import optimize_model

    from graphopt import io
    from graphopt.bench import print_table
    from graphopt.data.metrics import DEFAULT_BUDGET, parse_budget
    from graphopt.engine.registry import PassContext
    from graphopt.rewrites.quantize import QuantizePass
    from graphopt.runtime import session as runtime

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-quant-"))
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # ORT's quantizers write temp files into the current folder
    src = minilm.source_folder()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    sentences = workload.generate(args.n, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    sentences = [sentences[i] for i in rng.permutation(len(sentences))]  # random arrival order
    calib = token_batches(tok, sentences[: args.calib])
    held = token_batches(tok, sentences[args.calib:])
    # as `graphopt optimize --calib DIR` does: the pass calibrates on the first half of the calibration
    # batches and confirms its budget on the second; the held-back batches are used by nothing but the table
    k = max(1, len(calib) // 2)
    calib_part, confirm = calib[:k], calib[k:] or calib

    # fp32 PyTorch reference sentence embeddings on the held-back batches
    model = transformers.AutoModel.from_pretrained(src).eval()
    with torch.no_grad():
        ref = [_pool(model(**{k: torch.from_numpy(v) for k, v in f.items()}).last_hidden_state.numpy(),
                     f["attention_mask"]) for f in held]

    fused = out / "fp32-fused.onnx"
    if args.source == "ort":
        optimize_model(str(minilm.build("torchscript", "eager")), model_type="bert", num_heads=12,
                       hidden_size=384).save_model_to_file(str(fused))
        fp_name = "fp32 fused (ORT optimizer, torchscript eager)"
    else:
        from graphopt.engine.options import OptimizeOptions
        from graphopt.engine.pipeline import optimize

        exporter, attn = args.exporter.split("-")
        res = optimize(minilm.build(exporter, attn), OptimizeOptions(passes="cleanup,fuse",
                                                                     verify_level="structure"))
        io.save(res.model, fused)
        fp_name = f"fp32 fused (graphopt fuse, {args.exporter})"
    # ORT's quantizers copy Attention attributes onto QAttention, which has no qkv_hidden_sizes
    ort_in = out / "fp32-fused-for-ort.onnx"
    proto = onnx.load(str(fused))
    for n in proto.graph.node:
        keep = [a for a in n.attribute if not (n.op_type == "Attention" and a.name == "qkv_hidden_sizes"
                                              and len(set(a.ints)) == 1)]
        del n.attribute[:]
        n.attribute.extend(keep)
    onnx.save(proto, str(ort_in))
    paths: dict[str, Path] = {fp_name: fused}
    packed = None
    if args.packed:
        # the default recipe's output (cleanup, fuse, remove-padding): the fp32 model the `int8` recipe quantizes
        from graphopt.engine.options import OptimizeOptions
        from graphopt.engine.pipeline import optimize

        packed = out / "fp32-packed.onnx"
        io.save(optimize(fused, OptimizeOptions(passes="remove-padding",
                                                verify_level="structure")).model, packed)
        paths["fp32 fused + remove-padding (graphopt default recipe)"] = packed
    fp_opts = {"DefaultTensorType": onnx.TensorProto.FLOAT}
    for pc in (False, True):
        p = out / f"ort-dynamic-{'pc' if pc else 'pt'}.onnx"
        quantize_dynamic(str(ort_in), str(p), per_channel=pc, weight_type=QuantType.QInt8, extra_options=fp_opts)
        paths[f"ORT quantize_dynamic per-{'channel' if pc else 'tensor'}"] = p
    if packed is not None:  # attribution: ORT's best quantizer on graphopt's packed model
        p = out / "ort-dynamic-pc-packed.onnx"
        quantize_dynamic(str(packed), str(p), per_channel=True, weight_type=QuantType.QInt8, extra_options=fp_opts)
        paths["ORT quantize_dynamic per-channel on the packed model"] = p

    class _Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            return next(self.it, None)

    p = out / "ort-static-qdq.onnx"
    quantize_static(str(ort_in), str(p), _Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, extra_options=fp_opts)
    paths["ORT quantize_static QDQ per-channel"] = p

    notes: dict[str, list[str]] = {}
    variants = {
        "graphopt quantize (default: auto)": {},
        "graphopt dynamic": {"mode": "dynamic", "smoothquant": "false"},
        "graphopt static (no SmoothQuant)": {"mode": "static", "smoothquant": "false"},
        "graphopt static + SmoothQuant": {"mode": "static", "smoothquant": "true"},
        "graphopt int4 (GPTQ, acc 4)": {"mode": "int4", "accuracy_level": 4},
        "graphopt int4 (RTN, acc 4)": {"mode": "int4", "accuracy_level": 4, "int4_method": "rtn"},
    }
    if packed is not None:
        variants["graphopt int8 recipe (default recipe + quantize auto)"] = {"_source": packed}
    budget = parse_budget(DEFAULT_BUDGET)
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    if only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in only)}
    for name, opts in variants.items():
        t0 = time.perf_counter()
        opts = dict(opts)
        m = io.load(opts.pop("_source", fused))
        ctx = PassContext(provider="cpu", calib_feeds=calib_part, feeds=confirm, budget=budget)
        res = QuantizePass(sensitivity_feeds=1, **opts)(m, ctx)
        notes[name] = [f"{time.perf_counter() - t0:.0f}s; modified={res.modified}", *res.notes]
        p = out / (name.replace(" ", "_").replace("(", "").replace(")", "").replace(":", "").replace(",", "")
                   + ".onnx")
        io.save(res.model, p)
        paths[name] = p
        print(f"quantized {name} in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    rows = []
    for name, p in paths.items():
        sess = runtime.make_session(p, threads=1)
        got = [_pool(o["last_hidden_state"], f["attention_mask"])
               for o, f in zip(runtime.run(sess, held, outputs=["last_hidden_state"]), held)]
        cos = _cosines(got, ref)
        size = sum(f.stat().st_size for f in out.glob(p.name + "*"))
        rows.append({"variant": name, "size_mb": size / 1e6, "cosine_mean": float(cos.mean()),
                     "cosine_min": float(cos.min())})
    res = _bench(paths, held, args.rounds, args.clock)
    base = res[0]["p50"]
    ort_pc = res[list(paths).index("ORT quantize_dynamic per-channel")]["p50"]
    for row, r in zip(rows, res):
        row.update(sentences_per_s=r["throughput"], vs_fp32=base / r["p50"], vs_ort_per_channel=ort_pc / r["p50"])
    print(f"clock: {args.clock}; {args.rounds} rounds of {len(held)} held-back batches")
    print_table(["variant", "sentences/s", "× fp32", "× ORT dyn per-channel", "size MB", "cosine mean", "cosine min"],
                [[row["variant"], f"{row['sentences_per_s']:.1f}", f"{row['vs_fp32']:.2f}",
                  f"{row['vs_ort_per_channel']:.2f}", f"{row['size_mb']:.1f}", f"{row['cosine_mean']:.4f}",
                  f"{row['cosine_min']:.4f}"] for row in rows])
    if args.h2h_rounds:  # fewer models per round: less drift between them on a shared machine
        h2h = [n for n in paths if n.startswith("fp32 fused (") or n in (
            "ORT quantize_dynamic per-channel", "graphopt quantize (default: auto)",
            "graphopt int8 recipe (default recipe + quantize auto)")]
        res2 = _bench({n: paths[n] for n in h2h}, held, args.h2h_rounds, args.clock)
        base2, ort2 = res2[0]["p50"], res2[1]["p50"]
        print(f"\nhead-to-head ({args.h2h_rounds} rounds):")
        for r in res2:
            print(f"  {r['name']}: {r['throughput']:.1f} sentences/s, x{base2 / r['p50']:.2f} fp32, "
                  f"x{ort2 / r['p50']:.2f} ORT dynamic per-channel")
        rows.append({"head_to_head": [{"variant": r["name"], "sentences_per_s": r["throughput"],
                                       "vs_fp32": base2 / r["p50"], "vs_ort_per_channel": ort2 / r["p50"]}
                                      for r in res2]})
    for name, ns in notes.items():
        print(f"\n{name}:\n  " + "\n  ".join(ns))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

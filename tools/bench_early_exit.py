#!/usr/bin/env python
"""Benchmark ``early-exit`` on the MiniLM sentiment classifier (models/minilm_classifier.py), CPU.

Data: every sentence the classifier's templates make (``dataset(seed=1, per_label=800)``: 1600), in
the dataset's shuffled order; the first half calibrates (exit heads, temperatures, thresholds: the
pass splits it into fit / tune / confirm rows), the second half is held back for agreement and timing.

Variants (all made from the same fused model: ``cleanup,fuse``):

    full          the fused model (the baseline every ratio is against)
    b0.99/b0.97   early-exit calibrated to top1>=0.99 / 0.97, mode=batch
    r0.99/r0.97   the same, mode=row
    at-Lk         every row leaves at layer k (threshold 0): the trade-off curve's fixed points

Measured: argmax agreement with ``full`` and the exit-layer histogram on the held-back sentences,
one by one (batch 1) and in batches of 32, and latency interleaved with ``graphopt.bench.bench_sessions`` (ORT all
optimizations, 1 intra-op thread, spinning off, per-thread CPU time so other jobs on the VM don't
count): batch 1 over ``--batch1`` held-back sentences one by one, and row mode at batch 32 over
the held-back batches. Writes a markdown table on stdout, JSON (``--json``) and the plot (``--plot``,
matplotlib).

Usage::

    python tools/bench_early_exit.py [--workload templates|mixed] [--rounds 7] [--batch1 64]
                                     [--calib-pairs 1] [--confidence 0.95]
                                     [--plot docs/early_exit.png] [--json out.json]

``--workload mixed`` joins two template sentences per item (the second drawn at random, so half the
items mix a positive and a negative sentence): the full model is less sure, exits must be chosen.

Files mode (models made by ``graphopt optimize``, e.g. the default recipe's output against
``--passes ...,early-exit``): ``--model NAME=PATH`` (repeatable; the first is the baseline) with
``--text FILE`` (one held-back sentence a line) and ``--tokenizer DIR``. Every sentence is run alone
(batch 1) through every model: top-1 agreement with the baseline on ``logits`` (and the exit-layer
histogram where a model has an ``exit_layer`` output); then the first ``--batch1`` sentences are timed
one by one, round-robin, CPU time, medians::

    python tools/bench_early_exit.py --model base=base.onnx --model ee0.99=ee.onnx \
        --text feeds/test.txt --tokenizer ~/.cache/graphopt/models/minilm-topics --batch1 120
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("bench_early_exit")


def _data(workload: str, calib_pairs: int = 1):
    sys.path.insert(0, str(ROOT / "models"))
    import minilm_classifier as mc  # type: ignore[import-not-found]

    from graphopt.exporters import text_feeds

    path = Path(mc.build())
    tok = text_feeds.load_tokenizer(mc.train_folder())
    train, test = mc.dataset(seed=1, per_label=800)
    lines = [t for t, _ in train + test]
    if workload == "mixed":  # two template sentences each, half of them of opposite sentiment: harder
        rng = np.random.default_rng(1)
        items = train + test
        lines = []
        for i in range(len(items)):
            a, b = items[i], items[int(rng.integers(len(items)))]
            lines.append(f"{a[0]} {b[0]}")
    half = len(lines) // 2
    calib_lines = lines[:half]
    if workload == "mixed" and calib_pairs > 1:  # more calibration rows: first sentences of the calib half only
        rng = np.random.default_rng(2)
        items = train + test
        for _ in range(calib_pairs - 1):
            calib_lines += [f"{items[i][0]} {items[int(rng.integers(len(items)))][0]}" for i in range(half)]
    calib, _ = text_feeds.text_feeds(tok, calib_lines, batch=32, order="file")
    held, _ = text_feeds.text_feeds(tok, lines[half:], batch=32, order="file")
    return path, tok, lines[half:], calib, held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch1", type=int, default=64, help="held-back sentences timed one by one")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workload", choices=("templates", "mixed"), default="templates",
                    help="templates: the classifier's sentences; mixed: pairs of them (half with opposite labels)")
    ap.add_argument("--calib-pairs", type=int, default=1,
                    help="mixed: pairs made per calibration first sentence (more calibration rows; held-back unchanged)")
    ap.add_argument("--confidence", type=float, default=0.95,
                    help="early-exit.confidence: lower-bound confidence of the tune agreement (0 = plain)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                    help="files mode: a model to compare (the first is the baseline)")
    ap.add_argument("--text", type=Path, help="files mode: held-back sentences, one a line")
    ap.add_argument("--tokenizer", type=Path, help="files mode: the tokenizer's folder")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.model:
        if not (args.text and args.tokenizer) or any("=" not in m for m in args.model):
            ap.error("files mode needs --model NAME=PATH (one or more), --text and --tokenizer")
        return _files(dict(m.split("=", 1) for m in args.model), args.text, args.tokenizer, args.batch1,
                      args.rounds, args.json)

    from graphopt import bench
    from graphopt.data import metrics
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.registry import PassContext
    from graphopt.exporters import text_feeds
    from graphopt.rewrites.early_exit import EarlyExitPass
    from graphopt.runtime import session as runtime

    path, tok, held_lines, calib, held = _data(args.workload, args.calib_pairs)
    fused = pipeline.optimize(str(path), OptimizeOptions(passes="cleanup,fuse",
                                                         verify_level="structure")).model
    proto = ir.to_proto(fused)
    variants: dict[str, ir.Model] = {"full": fused}
    notes: dict[str, list[str]] = {}
    for target in (0.99, 0.97):
        for mode in ("batch", "row"):
            name = f"{mode[0]}{target}"
            m = ir.from_proto(proto)
            r = EarlyExitPass(mode=mode, exit_output="exit_layer", confidence=args.confidence)(
                m, PassContext(calib_feeds=calib, budget=metrics.parse_budget(f"top1>={target}")))
            notes[name] = r.notes
            logger.info("%s: %s", name, " | ".join(r.notes))
            if r.modified:
                variants[name] = m
    for k in range(1, 6):
        m = ir.from_proto(proto)
        r = EarlyExitPass(layers=str(k), threshold=0.0, exit_output="exit_layer")(m, PassContext(calib_feeds=calib))
        if r.modified:
            variants[f"at-L{k}"] = m
    sessions = bench.open_sessions(variants)
    # fidelity on held-back data
    ref = runtime.run(sessions["full"], held)
    rows = {}
    for n, s in sessions.items():
        got = runtime.run(s, held)
        agree = metrics.compare(got, ref, held, outputs=["logits"]).worst("top1")
        ex = np.concatenate([g["exit_layer"] for g in got]) if "exit_layer" in got[0] else np.full(800, 6)
        rows[n] = {"agreement": agree, "histogram": np.bincount(ex, minlength=7)[1:].tolist(),
                   "mean_exit_layer": float(ex.mean())}
    # fidelity at batch 1 (every held-back sentence alone: what mode=batch decides per sentence)
    singles, _ = text_feeds.text_feeds(tok, held_lines, batch=1, order="file")
    ref1 = runtime.run(sessions["full"], singles)
    for n, s in sessions.items():
        got = runtime.run(s, singles)
        rows[n]["agreement_b1"] = metrics.compare(got, ref1, singles, outputs=["logits"]).worst("top1")
        if "exit_layer" in got[0]:
            ex = np.concatenate([g["exit_layer"] for g in got])
            rows[n]["histogram_b1"] = np.bincount(ex, minlength=7)[1:].tolist()
    # latency: batch 1 (mode=batch models), batch 32 (mode=row models)
    one = singles[: args.batch1]
    b1_names = ["full", "b0.99", "b0.97"] + [f"at-L{k}" for k in range(1, 6)]
    b1 = bench.bench_sessions({n: sessions[n] for n in b1_names if n in sessions}, one, rounds=args.rounds,
                              clock="cpu")
    b32_names = ["full", "r0.99", "r0.97", "b0.99", "b0.97"]
    b32 = bench.bench_sessions({n: sessions[n] for n in b32_names if n in sessions}, held, rounds=args.rounds,
                               clock="cpu")
    for res, key in ((b1, "batch1"), (b32, "batch32")):
        for r, speedup in zip(res, bench.speedups(res).values()):
            rows[r.name][f"{key}_ms"] = 1e3 * r.p50 / len(one if key == "batch1" else held)
            rows[r.name][f"{key}_speedup"] = speedup
    table = bench.Table(["variant", "top1 @b1", "exits L1..L6 @b1", "batch 1 ms/sentence", "speedup b1", "top1 @b32",
                         "exits L1..L6 @b32", "batch 32 ms/batch", "speedup b32"])
    table.header()
    for n, r in rows.items():
        b1s = [f"{r['batch1_ms']:.2f}", f"{r['batch1_speedup']:.2f}x"] if "batch1_ms" in r else ["-", "-"]
        b32s = [f"{r['batch32_ms']:.1f}", f"{r['batch32_speedup']:.2f}x"] if "batch32_ms" in r else ["-", "-"]
        table.row(n, f"{r['agreement_b1']:.4f}", r.get("histogram_b1", "-"), *b1s, f"{r['agreement']:.4f}",
                  r["histogram"], *b32s)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "notes": notes}, indent=2) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for key, marker, label in (("batch1", "o", "batch 1"), ("batch32", "s", "batch 32")):
            agree = "agreement_b1" if key == "batch1" else "agreement"
            pts = [(r[f"{key}_speedup"], r[agree], n) for n, r in rows.items() if f"{key}_speedup" in r]
            ax.scatter([p[0] for p in pts], [100 * p[1] for p in pts], marker=marker, label=label)
            for x, y, n in pts:
                ax.annotate(n, (x, 100 * y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(99, color="gray", lw=0.6, ls="--")
        ax.axhline(97, color="gray", lw=0.6, ls=":")
        ax.set_xlabel("speedup vs the full fused model (CPU time, median)")
        ax.set_ylabel("held-back argmax agreement (%)")
        ax.set_title(f"early-exit on the MiniLM sentiment classifier ({args.workload})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


def _files(models: dict[str, str], text: Path, tokenizer: Path, n_timed: int, rounds: int, out: Path | None) -> int:
    """Files mode (see the module docstring): agreement at batch 1 on every sentence, timing on the first ones."""
    import os

    from graphopt import bench
    from graphopt.data import metrics
    from graphopt.exporters import text_feeds
    from graphopt.runtime import session as runtime

    lines = [t for t in text.read_text().splitlines() if t.strip()]
    singles, _ = text_feeds.text_feeds(text_feeds.load_tokenizer(tokenizer), lines, batch=1, order="file")
    sessions = bench.open_sessions(models)
    names = list(models)
    ref = runtime.run(sessions[names[0]], singles, outputs=["logits"])
    rows: dict[str, dict] = {}
    for n in names:
        got = runtime.run(sessions[n], singles)
        rows[n] = {"agreement": metrics.compare(got, ref, singles, outputs=["logits"]).worst("top1")}
        if "exit_layer" in got[0]:
            ex = np.concatenate([g["exit_layer"] for g in got])
            rows[n]["histogram"] = np.bincount(ex).tolist()[1:]
            rows[n]["mean_exit_layer"] = float(ex.mean())
    timed = singles[:n_timed]
    res = bench.bench_sessions(sessions, timed, rounds=rounds, clock="cpu")
    for r, speedup in zip(res, bench.speedups(res).values()):
        rows[r.name].update(ms=1e3 * r.p50 / len(timed), speedup=speedup)
    load = os.getloadavg()
    print(f"{len(lines)} held-back sentences at batch 1; {len(timed)} timed x {rounds} rounds (CPU time, 1 thread); "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    table = bench.Table(["model", "top-1 agreement", "ms/sentence", f"speed vs {names[0]}", "exit layers"])
    table.header()
    for n, r in rows.items():
        table.row(n, f"{r['agreement']:.4f}", f"{r['ms']:.2f}", f"{r['speedup']:.2f}x", r.get("histogram", "-"))
    if out:
        out.write_text(json.dumps({"rows": rows, "sentences": len(lines), "timed": len(timed), "load": load},
                                  indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Head-pruning benchmark on MiniLM: ranking quality, the budget run, latency, and pruning under int8.

Feeds are ``.npz`` folders from ``graphopt feeds`` on ``tools/workload.py`` sentences (see
docs/benchmarks.md): ``--calib DIR`` (split like ``graphopt optimize --calib``: first half calibrates,
second half is held back) and ``--work DIR`` (batches of 32 in arrival order, for speed).

``quality``: one ablation ranking, then at each ``--ratios`` the held-back cosine (graphopt's budget
metric: per-token cosine of last_hidden_state over real tokens) and the mean-pooled sentence-embedding
cosine, for ablation / local / random (``--seeds``) ranking, each with and without compensation.

``speed``: ``graphopt optimize`` default recipe (cleanup, fuse, remove-padding) with and without
``prune-heads`` under ``--budget``; both models in one process, spinning off, interleaved
(``graphopt.bench.bench_sessions``, ``--clock cpu`` by default: the calling thread's CPU time with one
intra-op thread), at batch 1x128 and on the workload; ``--recipe int8`` compares
the ``int8`` recipe against ``prune-int8`` instead.

Usage::

    python tools/bench_prune.py quality --model M.onnx --calib DIR [--ratios 0.125,0.25,0.375] [--seeds 3]
                                        [--iterative N]
    python tools/bench_prune.py speed --model M.onnx --calib DIR --work DIR [--budget cosine>=0.98]
                                      [--recipe int8] [--threads 1] [--rounds 20] [--clock cpu|wall]
                                      [--save-dir DIR] [--json out.json]
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _pooled_cosine(got, ref, feeds) -> float:
    cs = []
    for g, r, f in zip(got, ref, feeds):
        m = f["attention_mask"][..., None].astype(np.float32)
        gp = (g["last_hidden_state"] * m).sum(1) / m.sum(1)
        rp = (r["last_hidden_state"] * m).sum(1) / m.sum(1)
        cs.append((gp * rp).sum(1) / (np.linalg.norm(gp, axis=1) * np.linalg.norm(rp, axis=1)))
    return float(np.concatenate(cs).mean())


def _fused(model: str, passes: str = "cleanup,fuse,remove-padding"):
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    res = pipeline.optimize(model, OptimizeOptions(passes=passes, verify_level="structure"))
    return res.model


def quality(args) -> dict:
    from graphopt.data import feeds as feeds_mod
    from graphopt.data.metrics import compare, parse_budget
    from graphopt.rewrites.common.lossy import BudgetSearch
    from graphopt.rewrites.prune_heads import PruneHeadsPass, _Run
    from graphopt.rewrites.prune_heads.layers import find_layers

    model = _fused(args.model)
    calib, held = feeds_mod.split_feeds(feeds_mod.load_dir(args.calib))
    layers = find_layers(model)
    total = sum(la.num_heads for la in layers)
    t0 = time.perf_counter()
    run = _Run(PruneHeadsPass(rank_feeds=args.rank_feeds), model, layers,
               BudgetSearch("prune-heads", parse_budget("cosine>=0.98"), calib=calib, held=held))
    run.prepare()
    t_prep = time.perf_counter() - t0
    orders = {}
    t0 = time.perf_counter()
    orders["ablation"] = run.order(run.importance())
    t_abl = time.perf_counter() - t0
    if args.iterative:
        kmax = max(int(round(float(r) * total)) for r in args.ratios.split(","))
        t0 = time.perf_counter()
        run.opts = PruneHeadsPass(rank_feeds=args.rank_feeds, iterative=args.iterative)
        orders[f"ablation-iterative-{args.iterative}"] = run.iterative_order(kmax)
        print(f"iterative ranking ({args.iterative} per round, {kmax} heads): {time.perf_counter() - t0:.0f} s",
              flush=True)
    for name, opts in [("local", {"importance": "local"})] + [
            (f"random-{s}", {"importance": "random", "seed": s}) for s in range(args.seeds)]:
        run.opts = PruneHeadsPass(**opts)
        orders[name] = run.order(run.importance())
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        k = int(round(ratio * total))
        for name, order in orders.items():
            for comp in (False, True):
                got = run.probe.run(held, run.masks(order[:k]), *(run.refit(order[:k]) if comp else (None, None)))
                c = compare(got, run.s.ref_held, held)
                rows.append({"ratio": ratio, "heads": k, "ranking": name, "compensate": comp,
                             "cosine": round(c.worst("cosine"), 5), "cosine_min": round(c.worst("cosine_min"), 5),
                             "pooled": round(_pooled_cosine(got, run.s.ref_held, held), 5)})
                print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows, "prepare_s": round(t_prep, 1), "ablation_s": round(t_abl, 1), "total_heads": total}


def speed(args) -> dict:
    from graphopt.bench import bench_sessions, by_name, open_sessions, speedups
    from graphopt.data import feeds as feeds_mod
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.recipe import load as load_recipe

    base_recipe, pruned_recipe = ("int8", "prune-int8") if args.recipe == "int8" else (None, None)
    budget = args.budget or None
    out = {}
    t0 = time.perf_counter()
    saved = Path(args.save_dir) if args.save_dir else None
    if saved and (saved / "base.onnx").exists() and (saved / "pruned.onnx").exists():
        import onnx_ir as ir

        models = {tag: ir.load(saved / f"{tag}.onnx") for tag in ("base", "pruned")}
        prev = json.loads((saved / "reports.json").read_text())
        out.update(prev)
        print(f"loaded the models from {saved}", flush=True)
    elif base_recipe:
        base = pipeline.optimize(args.model, OptimizeOptions(recipe=load_recipe(base_recipe),
                                                             calib=args.calib, budget=budget))
        pruned = pipeline.optimize(args.model, OptimizeOptions(recipe=load_recipe(pruned_recipe),
                                                               calib=args.calib, budget=budget))
    else:
        base = pipeline.optimize(args.model, OptimizeOptions(passes="cleanup,fuse,remove-padding",
                                                             calib=args.calib))
        pruned = pipeline.optimize(args.model, OptimizeOptions(
            passes="cleanup,fuse,remove-padding,prune-heads", calib=args.calib, budget=budget))
    if "base" not in out:
        out["optimize_s"] = round(time.perf_counter() - t0, 1)
        for tag, res in (("base", base), ("pruned", pruned)):
            out[tag] = {"ok": res.ok, "final": res.report.final,
                        "passes": [{"name": p.name, "status": p.status, "notes": p.notes,
                                    "rule_counts": p.rule_counts, "verification": p.verification}
                                   for p in res.report.passes if not p.exact]}
        models = {"base": base.model, "pruned": pruned.model}
        if saved:
            import onnx_ir as ir

            saved.mkdir(parents=True, exist_ok=True)
            for tag, m in models.items():
                ir.save(m, saved / f"{tag}.onnx")
            (saved / "reports.json").write_text(json.dumps({k: out[k] for k in ("optimize_s", "base", "pruned")},
                                                           default=str))
    print(json.dumps({k: out[k] for k in ("base", "pruned")}, indent=1, default=str), flush=True)
    sessions = open_sessions(models, threads=args.threads)
    rng = np.random.default_rng(0)
    one = {"input_ids": rng.integers(1000, 2000, (1, 128)).astype(np.int64),
           "attention_mask": np.ones((1, 128), np.int64), "token_type_ids": np.zeros((1, 128), np.int64)}
    work = feeds_mod.load_dir(args.work)
    for name, feeds, rounds in (("batch1x128", [one] * 8, args.rounds), ("workload", work, args.rounds)):
        res = bench_sessions(sessions, feeds, rounds=rounds, warmup=2, clock=args.clock)
        by = by_name(res)
        out[name] = {n: {"p50_ms": round(r.p50 * 1e3, 2), "items_per_s": round(r.throughput, 1)}
                     for n, r in by.items()}
        out[name]["speedup"] = round(speedups(res, base="base")["pruned"], 3)
        print(name, json.dumps(out[name]), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["quality", "speed"])
    ap.add_argument("--model", default=str(Path.home() / ".cache/graphopt/models/minilm-torchscript-eager.onnx"))
    ap.add_argument("--calib", required=True)
    ap.add_argument("--work")
    ap.add_argument("--ratios", default="0.125,0.25,0.375")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rank-feeds", type=int, default=2)
    ap.add_argument("--iterative", type=int, default=0, help="also rank by re-ranking every N removed heads")
    ap.add_argument("--budget", action="append")
    ap.add_argument("--recipe", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                    help="cpu: the calling thread's CPU time (1 intra-op thread: waiting for a busy core is not counted)")
    ap.add_argument("--save-dir", help="save the two models here; reuse them when present (bench only)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory():
        out = quality(args) if args.what == "quality" else speed(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

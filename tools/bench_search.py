#!/usr/bin/env python
"""``optimize --search`` on MiniLM against the ``int8`` recipe, interleaved, on unseen workload sentences.

1. Sentences from ``tools/workload.py`` (random arrival order), tokenized with MiniLM's tokenizer in
   batches of 32: the first ``--calib`` sentences are the calibration folder (``graphopt optimize
   --calib``: the pipeline and the search calibrate on its first half and hold back the second half),
   the rest are *unseen*: used by nothing but this table.
2. ``graphopt optimize MODEL --recipe int8`` and ``graphopt optimize MODEL --search`` (``--time-limit``,
   ``--workers``), both under ``--budget`` (default ``cosine>=0.99`` and ``cosine_min>=0.97``), through
   the Python API the CLI wraps. ``--chosen DIR`` reuses the outputs of an earlier run instead.
3. The default recipe (lossless), the ``int8`` recipe and the chosen model: one process, 1 thread,
   spinning off, round-robin (``graphopt.bench.bench_sessions``, ``--clock cpu`` by default), on the
   unseen batches; quality on the same batches against the input model (graphopt's budget metrics:
   per-token cosine / cosine_min of last_hidden_state over real tokens) and the mean-pooled sentence
   embedding cosine.

Usage::

    python tools/bench_search.py --out /tmp/bsearch [-n 400] [--calib 192] [--time-limit 10m] [--workers 1]
                                 [--rounds 10] [--chosen DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "models"))
sys.path.insert(0, str(REPO / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workload import token_batches  # noqa: E402


def _pooled(outs, feeds) -> np.ndarray:
    res = []
    for o, f in zip(outs, feeds):
        m = f["attention_mask"][..., None].astype(np.float32)
        res.append((o["last_hidden_state"] * m).sum(1) / m.sum(1))
    return np.concatenate(res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="work folder (feeds, models, search outputs)")
    ap.add_argument("--model", help="input ONNX (default: the MiniLM dynamo-sdpa export)")
    ap.add_argument("-n", type=int, default=400)
    ap.add_argument("--calib", type=int, default=192, help="calibration sentences (the rest are unseen)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", action="append", default=None)
    ap.add_argument("--time-limit", default="10m")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--search-passes", help="the lossy passes to search (default: all)")
    ap.add_argument("--name", default="chosen", help="file stem of the search outputs in --out")
    ap.add_argument("--chosen", help="reuse the search outputs (--name) in this folder (no new search)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    budget = args.budget or ["cosine>=0.99", "cosine_min>=0.97"]

    import minilm
    import transformers
    import workload

    from graphopt import io
    from graphopt import search as search_mod
    from graphopt.bench import Table, bench_sessions, by_name, open_sessions, print_table, speedups
    from graphopt.data import feeds as feeds_mod
    from graphopt.data.metrics import compare
    from graphopt.engine import pipeline
    from graphopt.engine import recipe as recipe_mod
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.verify import run_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else minilm.build("dynamo", "sdpa")
    tok = transformers.AutoTokenizer.from_pretrained(minilm.source_folder())
    sentences = workload.generate(args.n, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    sentences = [sentences[i] for i in rng.permutation(len(sentences))]
    calib_dir = out / "calib"
    if not calib_dir.exists():
        feeds_mod.save_dir(token_batches(tok, sentences[: args.calib]), calib_dir)
    unseen = token_batches(tok, sentences[args.calib:])

    t0 = time.perf_counter()
    paths = {"lossless (default recipe)": out / "default.onnx", "int8 recipe": out / "int8.onnx"}
    for name, rec in (("lossless (default recipe)", "default"), ("int8 recipe", "int8")):
        if not paths[name].exists():
            res = pipeline.optimize(model, OptimizeOptions(recipe=recipe_mod.load(rec), calib=calib_dir,
                                                           budget=budget))
            assert res.ok, res.report.failed()
            io.save(res.model, paths[name])
    print(f"recipes in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    chosen_dir = Path(args.chosen) if args.chosen else out
    report_path = chosen_dir / f"{args.name}.search.json"
    fams = args.search_passes.split(",") if args.search_passes else None
    if not args.chosen:
        t0 = time.perf_counter()

        def progress(kind: str, info: dict) -> None:
            if kind == "trial":
                t = info["trial"]
                print(f"  {t.name}: {t.status} {t.speedup} {t.held.get('cosine')} {t.held.get('cosine_min')} "
                      f"{t.reason[:120]} [{t.seconds:.0f} s]", file=sys.stderr, flush=True)

        result = search_mod.search(model, calib=calib_dir, budget=budget, time_limit=args.time_limit,
                                   workers=args.workers, families=fams, on_event=progress)
        try:
            search_mod.write(result, chosen_dir / f"{args.name}.onnx", report=report_path, calib=calib_dir)
        except Exception as e:  # nothing met the budget: the report still says why
            print(f"search: {e}", file=sys.stderr)
        print(f"search in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    rep = json.loads(report_path.read_text())
    if rep["chosen"] and (chosen_dir / f"{args.name}.onnx").exists():
        paths[f"chosen: {rep['chosen']}"] = chosen_dir / f"{args.name}.onnx"

    ref = list(run_model(str(model), unseen))
    ref_pool = _pooled(ref, unseen)
    rows = []
    for name, p in paths.items():
        got = list(run_model(io.load(p), unseen))
        c = compare(got, ref, unseen).summary()
        g = _pooled(got, unseen)
        emb = (g * ref_pool).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(ref_pool, axis=1))
        rows.append({"model": name, "cosine": c["cosine"], "cosine_min": c["cosine_min"],
                     "embedding_cosine": float(emb.mean()), "embedding_cosine_min": float(emb.min())})
    sessions = open_sessions({n: str(p) for n, p in paths.items()}, optimize=True)
    res = bench_sessions(sessions, unseen, rounds=args.rounds, warmup=1, clock=args.clock)
    by, vs_int8 = by_name(res), speedups(res, base="int8 recipe")
    for row in rows:
        row.update(sentences_per_s=by[row["model"]].throughput, vs_int8=vs_int8[row["model"]])
    print(f"\nunseen: {len(unseen)} batches of 32; {args.rounds} rounds, clock {args.clock}, 1 thread")
    print_table(["model", "sentences/s", "× int8 recipe", "token cosine", "token cosine_min", "embedding cosine",
                 "embedding min"],
                [[row["model"], f"{row['sentences_per_s']:.1f}", f"{row['vs_int8']:.3f}", f"{row['cosine']:.5f}",
                  f"{row['cosine_min']:.5f}", f"{row['embedding_cosine']:.5f}", f"{row['embedding_cosine_min']:.5f}"]
                 for row in rows])
    print(f"\nsearch ({rep['workers']}, {rep['seconds']} s of {rep['time_limit']} s; budget {rep['budget']}; "
          f"Pareto: {', '.join(p['name'] for p in rep['pareto'])}):")
    table = Table(["candidate", "status", "× lossless (trial)", "× lossless (final duel)", "held-back cosine",
                   "held-back cosine_min", "why not"])
    table.header()
    for t in rep["candidates"]:
        def f(v):
            return f"{v:.3f}" if isinstance(v, float) else "-"

        def g(v):
            return f"{v:.5f}" if isinstance(v, float) else "-"

        why = t["reason"][:90] if not t["meets_budget"] else (f"same model as {t['same_as']}" if t.get("same_as") else "")
        table.row(t["name"], t["status"], f(t["speedup"]), f(t["duel_speedup"]), g(t["held"].get("cosine")),
                  g(t["held"].get("cosine_min")), why)
    for n in rep["notes"]:
        print(f"- {n}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "search": rep}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

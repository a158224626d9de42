#!/usr/bin/env python
"""Which ONNX Runtime session options make graphopt's packed models fast: measured, not assumed.

For the default recipe's output (``remove-padding``: independent length groups, one attention per group
and layer) and the ``int8`` recipe's output of the MiniLM dynamo-sdpa export, on ``tools/workload.py``
sentences (random arrival order, batch 32, the held-back part as in ``tools/bench_quant.py``), every
configuration is a session of its own and all are timed in one process, round-robin, spinning off, by
wall time (several threads):

- at ``--threads`` T: ``sequential`` (T intra-op threads, the default), ``parallel`` with T inter-op
  threads and 1 intra-op thread (groups side by side, each kernel single-threaded), and ``parallel``
  with T inter-op and T intra-op threads;
- at 1 thread, sequential: graph optimization level ``basic``, ``extended`` and ``all``.

Usage::

    python tools/bench_session_options.py --out /tmp/sessopt [--int8 MODEL] [--threads 2] [--rounds 8]

(``--int8``: an existing ``int8`` recipe output, else it is built with calibration on the first
``--calib`` sentences.) Prints the load average before and after: on a shared machine read the ratios
within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "models"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the models")
    ap.add_argument("--int8", help="an int8 recipe output to use instead of building one")
    ap.add_argument("-n", type=int, default=400)
    ap.add_argument("--calib", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import minilm
    import transformers
    import workload
    from workload import token_batches

    from graphopt import io
    from graphopt.bench import Table, bench_sessions, by_name
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.pipeline import optimize
    from graphopt.engine.recipe import load
    from graphopt.runtime import session as runtime

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(minilm.source_folder())
    sentences = workload.generate(args.n, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    sentences = [sentences[i] for i in rng.permutation(len(sentences))]
    calib, held = token_batches(tok, sentences[: args.calib]), token_batches(tok, sentences[args.calib:])
    fp32 = minilm.build("dynamo", "sdpa")
    models = {}
    default = out / "default.onnx"
    if not default.exists():
        io.save(optimize(str(fp32), OptimizeOptions(verify_level="structure")).model, default)
    models["default recipe"] = str(default)
    int8 = Path(args.int8) if args.int8 else out / "int8.onnx"
    if not int8.exists():
        res = optimize(str(fp32), OptimizeOptions(recipe=load("int8"), feeds=calib))
        io.save(res.model, int8)
    models["int8 recipe"] = str(int8)

    t = args.threads
    configs = {
        f"sequential, intra {t}": {"threads": t},
        f"parallel, inter {t}, intra 1": {"threads": 1, "execution_mode": "parallel", "inter_op_threads": t},
        f"parallel, inter {t}, intra {t}": {"threads": t, "execution_mode": "parallel", "inter_op_threads": t},
    }
    levels = {f"1 thread, level {lv}": {"threads": 1, "level": lv} for lv in ("basic", "extended", "all")}
    rows = []
    for title, cfgs in ((f"{t} threads: execution mode", configs), ("1 thread: graph optimization level", levels)):
        sessions = {f"{m} | {c}": runtime.make_session(p, spinning=False, **kw)
                    for m, p in models.items() for c, kw in cfgs.items()}
        load_before = os.getloadavg()[0]
        res = bench_sessions(sessions, held, rounds=args.rounds, warmup=1, clock="wall")
        print(f"\n{title}: {args.rounds} rounds of {len(held)} batches, wall clock; load average "
              f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}")
        table = Table(["model", "configuration", "round ms", "sentences/s", "× first configuration"])
        table.header()
        by = by_name(res)
        for m in models:
            first = by[f"{m} | {next(iter(cfgs))}"]
            for c in cfgs:
                r = by[f"{m} | {c}"]
                table.row(m, c, f"{1e3 * r.p50:.1f}", f"{r.throughput:.1f}", f"{r.speedup_over(first):.2f}")
                rows.append({"model": m, "config": c, "p50_ms": 1e3 * r.p50, "sentences_per_s": r.throughput,
                             "vs_first": r.speedup_over(first), "load_before": load_before})
        del sessions
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the default recipe on the model corpus (``models/corpus.py``): original vs optimized.

For every corpus model, in one process: optimize with the default recipe (numeric verification on the
model's real-looking feeds), then load the original and the optimized model (CPU, ORT_ENABLE_ALL,
``--threads`` intra-op threads, spinning off) and time them interleaved round-robin with
``graphopt.bench.bench_sessions`` on the same feeds. Each round runs the feeds ``repeat`` times, where
``repeat`` makes a round last at least ``--round-ms`` (tiny tabular models take microseconds).

Reported per model: median round time of each, and the median over rounds of the paired ratio
original/optimized (> 1: the optimized model is faster), and the final verification's max_abs
against the input. ``--clock cpu`` (the default, with one
thread) times the calling thread's CPU time, so waiting for a core other jobs hold is not counted.

    .venv/bin/python tools/bench_corpus.py [--rounds 40] [--threads 1] [--clock cpu] [--only NAME,..] [--json out.json]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "models"))

import corpus  # noqa: E402

from graphopt import io  # noqa: E402
from graphopt.bench import harness, session_bench  # noqa: E402
from graphopt.engine import pipeline  # noqa: E402
from graphopt.engine.options import OptimizeOptions  # noqa: E402

logger = logging.getLogger(__name__)


def bench_entry(entry, *, rounds: int, threads: int, clock: str, round_ms: float, workdir: Path) -> dict:
    src = entry.locate()
    feeds = corpus.realistic_feeds(entry)
    row = {"model": entry.name, "kind": entry.kind, "source": f"{entry.dist}:{entry.path or '(built)'}"}
    t0 = time.perf_counter()
    try:
        res = pipeline.optimize(src, OptimizeOptions(feeds=feeds))
    except Exception as e:  # noqa: BLE001 - a benchmark row, not a crash
        msg = getattr(e, "message", str(e)).replace(str(src), Path(src).name)
        row["error"] = f"{type(e).__name__}: {msg[:160]}"
        return row
    row["optimize_s"] = round(time.perf_counter() - t0, 2)
    if not res.ok:
        row["error"] = "; ".join(f"{p.name}: {p.error}" for p in res.report.failed())[:200]
        return row
    out = io.save(res.model, workdir / f"{entry.name}.opt.onnx")
    row["nodes"] = f"{res.report.nodes_before} -> {res.report.nodes_after}"
    row["final"] = res.report.final
    sessions = session_bench.open_sessions({"original": src, "optimized": out}, threads=threads, optimize=True)
    repeat = harness.repeats_for(lambda: [sessions["original"].run(None, f) for f in feeds], round_ms / 1e3)
    by = harness.by_name(session_bench.bench_sessions(sessions, feeds * repeat, rounds=rounds, warmup=2,
                                                      clock=clock))
    ratios = harness.paired_ratios(by["original"], by["optimized"])
    calls = len(feeds) * repeat
    row.update({
        "original_ms": 1e3 * by["original"].p50 / calls,
        "optimized_ms": 1e3 * by["optimized"].p50 / calls,
        "speedup": harness.median(ratios),
        "speedup_p10_p90": [harness.percentile(ratios, 10), harness.percentile(ratios, 90)],
        "rounds": len(ratios),
        "runs_per_round": calls,
    })
    return row


def _max_abs(final: dict) -> str:
    """The verification's worst absolute difference of the optimized model against the input."""
    v = (final or {}).get("max_abs")
    return "—" if v is None else f"{v:.1e}" if v else "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--round-ms", type=float, default=20.0, help="least time one round of one model runs")
    ap.add_argument("--only", help="comma-separated corpus names")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (other threads' work would not be counted)")
    entries = corpus.ENTRIES
    if args.only:
        names = args.only.split(",")
        entries = [corpus.BY_NAME[n] for n in names]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-corpus-") as tmp:
        for e in entries:
            row = bench_entry(e, rounds=args.rounds, threads=args.threads, clock=args.clock,
                              round_ms=args.round_ms, workdir=Path(tmp))
            rows.append(row)
            if "error" in row:
                print(f"{e.name:20} ERROR {row['error']}", flush=True)
            else:
                lo, hi = row["speedup_p10_p90"]
                print(f"{e.name:20} {row['nodes']:>12}  orig {row['original_ms']:8.3f} ms  opt {row['optimized_ms']:8.3f} ms"
                      f"  speedup {row['speedup']:.3f} (p10-p90 {lo:.2f}-{hi:.2f}, {row['rounds']} rounds)", flush=True)
    if args.json:
        harness.write_json(args.json, {"args": vars(args) | {"json": str(args.json)}, "rows": rows}, default=str)
    print()
    table = harness.Table(["model", "kind", "nodes", "original ms/run", "optimized ms/run", "speedup (median paired)",
                           "p10-p90", "max_abs vs input"])
    table.header()
    for r in rows:
        if "error" in r:
            table.row(r["model"], r["kind"], "—", "—", "—", f"error: {r['error']}", "", "")
        else:
            lo, hi = r["speedup_p10_p90"]
            table.row(r["model"], r["kind"], r["nodes"], f"{r['original_ms']:.3f}", f"{r['optimized_ms']:.3f}",
                      f"{r['speedup']:.3f}", f"{lo:.2f}-{hi:.2f}", _max_abs(r["final"]))


if __name__ == "__main__":
    main()

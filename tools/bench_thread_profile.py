#!/usr/bin/env python
"""Thread scaling from ORT profiles: measured at a few intra-op thread counts, estimated for more cores.

For each model (the first is the baseline, typically the plain export) one ORT CPU session per thread
count in ``--threads`` (default 1,2) is opened with ``graphopt.runtime.session.session_options(threads=N,
spinning=False)`` plus the settings recorded in the model's metadata (as ``graphopt bench``), with
ORT's profiler on. All sessions run interleaved round-robin (``graphopt.bench.bench_sessions``): one
warm-up round, then ``--rounds`` rounds, each running every model at every thread count once over all
``--calib`` feeds (the order rotating per round). From each session's profile, per timed round: kernel
ms per op type (``Node`` events ending in ``_kernel_time``), calls, and ``model_run`` ms; the framework
overhead is model_run minus the sum of kernels. Medians over the rounds are used. Each session's
*cores busy* (the process's CPU time over wall time while it ran; spinning is off, so idle pool threads
add nothing) shows whether a multi-thread session got its cores: a session at 2 threads near 1.0 ran on
a busy machine and is flagged.

The estimate: per op type, Amdahl's law t(n) = t1*((1-p) + p/n) is fitted to the measured thread
counts by least squares with p kept within [0, 1] (non-negative least squares on the serial part
t1*(1-p) and the parallel part t1*p; with only 1 and 2 threads and t1/2 <= t2 <= t1 it is exact,
p = 2*(1 - t2/t1)). The framework overhead is taken as serial (p = 0, its mean over the measured counts):
ORT's sequential executor does that work (node scheduling, allocation, feeding inputs, fences) on the
calling thread whatever the intra-op thread count, and a p fitted to two noisy values of a small
quantity would extrapolate their noise (its fitted p is in the JSON for reference). The model's
estimated round time at ``--estimate`` counts (default 4,8,16) is the sum over op types plus the
overhead; its estimated scaling is the fitted 1-thread time over that, and each model's scaling is
divided by the baseline's (the issue-20 goal: at least 0.92).

What the estimate ignores: memory bandwidth and shared caches (a GEMM that scales 2x on 2 cores need not
on 16), hyperthreads (vCPUs that are SMT siblings do not add a core's worth of compute), the cost of a
parallel section growing with the thread count (waking and joining more threads per op), and small ops
that ORT does not split at all (their p comes out near 0 already, but an op split into 2 chunks at 2
threads may not be split into 16). It is an Amdahl extrapolation from the measured points, an
upper-bound-ish estimate, not a measurement. Profiling itself adds a little time per node, which
weighs more on graphs with many small nodes; and on a shared machine the 2-thread times include waiting
for a core.

Usage::

    python tools/bench_thread_profile.py BASE.onnx MODEL.onnx ... --calib FEEDS/ [--threads 1,2]
        [--estimate 4,8,16] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from graphopt.bench.harness import Table, markdown_row, median, time_call

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CAVEATS = ("The estimate is an Amdahl extrapolation per op type from the measured thread counts (an "
           "upper-bound-ish estimate, not a measurement): it ignores memory bandwidth and shared caches, "
           "hyperthreads, the per-op parallel-section overhead growing with the thread count, and small ops "
           "that ORT does not split further; the framework overhead is taken as serial.")


# ------------------------------------------------------------- the estimate (pure)


def fit_amdahl(times: Mapping[int, float]) -> tuple[float, float]:
    """``(t1, p)`` of t(n) = t1*((1-p) + p/n) fitted to ``{thread count: time}`` by least squares, with
    p within [0, 1] (non-negative least squares on the serial part t1*(1-p) and the parallel part t1*p).
    Needs at least two distinct thread counts."""
    from scipy.optimize import nnls

    counts = sorted(times)
    if len(counts) < 2:
        raise ValueError("an Amdahl fit needs times at two or more thread counts")
    a = np.array([[1.0, 1.0 / n] for n in counts])
    y = np.array([max(float(times[n]), 0.0) for n in counts])
    (serial, parallel), _ = nnls(a, y)
    t1 = float(serial + parallel)
    return (t1, float(parallel / t1)) if t1 > 0 else (0.0, 0.0)


def amdahl(t1: float, p: float, n: int) -> float:
    """t(n) = t1*((1-p) + p/n)."""
    return t1 * ((1.0 - p) + p / n)


def estimate(per_op: Mapping[str, Mapping[int, float]], overhead: Mapping[int, float],
             counts: Sequence[int]) -> dict:
    """The estimated time of one model at each of ``counts`` (and at 1 thread) from its measured times.

    ``per_op``: op type -> {thread count: ms}; ``overhead``: {thread count: ms} outside kernels (taken as
    serial: its mean over the measured counts). Returns ``{"ops": {op: {"t1", "p", "ms": {n: ms}}},
    "overhead": {"ms", "p_if_fitted"}, "round_ms": {n: ms}, "scaling": {n: round_ms[1] / round_ms[n]}}``;
    op types missing at some measured count count as 0 ms there.
    """
    measured = sorted({n for t in per_op.values() for n in t} | set(overhead))
    at = sorted({1, *measured, *counts})
    ops = {}
    for op, t in per_op.items():
        t1, p = fit_amdahl({n: t.get(n, 0.0) for n in measured})
        ops[op] = {"t1": t1, "p": p, "ms": {n: amdahl(t1, p, n) for n in at}}
    over = float(np.mean([max(overhead[n], 0.0) for n in measured])) if overhead else 0.0
    over_p = fit_amdahl({n: overhead[n] for n in measured})[1] if len(overhead) >= 2 else 0.0
    round_ms = {n: sum(o["ms"][n] for o in ops.values()) + over for n in at}
    return {"ops": ops, "overhead": {"ms": over, "p_if_fitted": over_p}, "round_ms": round_ms,
            "scaling": {n: round_ms[1] / round_ms[n] if round_ms[n] > 0 else float("inf") for n in at}}


# ------------------------------------------------------------- profiles


def parse_profile(events: list[dict], n_feeds: int, warmup: int, rounds: int) -> dict:
    """Per timed round of one session's ORT profile: kernel ms per op type, model_run ms; calls per round.

    Round r (0-based, after ``warmup`` rounds) is the session's model_runs ``(warmup + r) * n_feeds`` to
    the next round's first."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    if len(runs) != (warmup + rounds) * n_feeds:
        raise SystemExit(f"the profile has {len(runs)} model runs, expected {(warmup + rounds) * n_feeds} "
                         "(ORT stops recording at its event limit: use fewer --rounds)")
    starts = [e["ts"] for e in runs]
    per_op: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * rounds)
    calls: list[collections.Counter] = [collections.Counter() for _ in range(rounds)]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        r = (int(np.searchsorted(starts, e["ts"], side="right")) - 1) // n_feeds - warmup
        if r < 0:
            continue
        op = e["args"]["op_name"]
        per_op[op][r] += e["dur"] / 1e3
        calls[r][op] += 1
    if any(c != calls[0] for c in calls):
        raise SystemExit("the profile has different kernel calls in different rounds (ORT stops recording at "
                         "its event limit: use fewer --rounds)")
    run_ms = [sum(e["dur"] for e in runs[(warmup + r) * n_feeds:(warmup + r + 1) * n_feeds]) / 1e3
              for r in range(rounds)]
    kernel_ms = [sum(t[r] for t in per_op.values()) for r in range(rounds)]
    return {
        "per_op_ms_rounds": dict(sorted(per_op.items(), key=lambda kv: -sum(kv[1]))),
        "calls": dict(calls[0]),
        "model_run_ms_rounds": run_ms,
        "overhead_ms_rounds": [m - k for m, k in zip(run_ms, kernel_ms)],
    }


class _CpuTimed:
    """A session whose runs also record the process's CPU seconds (all threads; spinning is off, so idle
    pool threads add nothing): CPU / wall time says how many cores a session actually got."""

    def __init__(self, sess):
        self.sess, self.cpu_s = sess, []

    def __getattr__(self, name):
        return getattr(self.sess, name)

    def run(self, *args, **kwargs):
        cpu, out = time_call(lambda: self.sess.run(*args, **kwargs), clock="process")
        self.cpu_s.append(cpu)
        return out


def run_profiled(models: Mapping[str, str], feeds: list[dict[str, np.ndarray]], counts: Sequence[int],
                 rounds: int) -> dict[str, dict[int, dict]]:
    """Profile every model at every thread count, all sessions interleaved round-robin (one warm-up
    round, then ``rounds``); name -> count -> :func:`parse_profile` plus wall and process CPU ms per round."""
    import onnxruntime as ort

    from graphopt.bench import bench_sessions, model_settings
    from graphopt.runtime import session as runtime
    from graphopt.runtime import session_hints

    with tempfile.TemporaryDirectory(prefix="thread-profile-") as d:
        sessions = {}
        for i, (name, path) in enumerate(models.items()):
            kw = session_hints.session_kwargs(model_settings(path))
            for n in counts:
                so = runtime.session_options(threads=n, spinning=False, **kw)
                so.enable_profiling = True
                so.profile_file_prefix = os.path.join(d, f"m{i}_t{n}")
                sessions[(name, n)] = _CpuTimed(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]))
        keys = list(sessions)
        results = bench_sessions({f"{k[0]} @ {k[1]}t": sessions[k] for k in keys}, feeds, rounds=rounds, warmup=1)
        out: dict[str, dict[int, dict]] = collections.defaultdict(dict)
        for (name, n), res in zip(keys, results):
            with open(sessions[(name, n)].end_profiling()) as fh:
                prof = parse_profile(json.load(fh), len(feeds), 1, rounds)
            cpu = sessions[(name, n)].cpu_s[len(feeds):]
            out[name][n] = {**prof, "wall_ms_rounds": [1e3 * s for s in res.round_seconds],
                            "cpu_ms_rounds": [1e3 * sum(cpu[r * len(feeds):(r + 1) * len(feeds)])
                                              for r in range(rounds)]}
        return dict(out)


def per_round_estimate(measured: dict[int, dict], r: int, counts: Sequence[int]) -> dict:
    """:func:`estimate` from round ``r`` alone (its thread counts ran in the same round of the round-robin,
    so the spread over rounds shows how much the machine's phases move the estimate)."""
    per_op: dict[str, dict[int, float]] = collections.defaultdict(dict)
    for n, m in measured.items():
        for op, v in m["per_op_ms_rounds"].items():
            per_op[op][n] = v[r]
    return estimate(per_op, {n: m["overhead_ms_rounds"][r] for n, m in measured.items()}, counts)


def summarize(measured: dict[int, dict]) -> dict:
    """Medians over the rounds of one model's measurements at each thread count."""
    med = {}
    for n, m in measured.items():
        med[n] = {"model_run_ms": float(median(m["model_run_ms_rounds"])),
                  "overhead_ms": float(median(m["overhead_ms_rounds"])),
                  "wall_ms": float(median(m["wall_ms_rounds"])),
                  "cores_busy": float(sum(m["cpu_ms_rounds"]) / sum(m["wall_ms_rounds"])),
                  "per_op_ms": {op: float(median(v)) for op, v in m["per_op_ms_rounds"].items()}}
    return med


# ------------------------------------------------------------- report


def _fmt_scaling(s: float, base: float | None) -> str:
    return f"{s:.2f}x" + (f" ({s / base:.2f})" if base else "")


def report(rows: list[dict], counts: list[int], est: list[int], items: int, min_share: float = 0.005) -> str:
    """The markdown tables: per model, and per op type for each model."""
    lines = []
    top = est[-1]
    m1 = counts[0]
    head = ["model", *[f"{n}t ms (measured)" for n in counts],
            *[f"{n}t scaling (÷ base)" for n in counts[1:]], f"cores busy ({'/'.join(f'{n}t' for n in counts)})",
            *[f"{n}t ms (est.)" for n in est], *[f"{n}t scaling (÷ base, est.)" for n in est],
            f"{top}t ÷ base, range over rounds", f"{top}t items/s (est.)"]
    lines += Table(head).lines()
    base = rows[0]
    for row in rows:
        ms = row["measured"]
        cells = [row["model"], *[f"{ms[n]['model_run_ms']:.1f}" for n in counts]]
        for n in counts[1:]:
            s = row["measured_scaling"][n]
            cells.append(_fmt_scaling(s, base["measured_scaling"][n]))
        cells.append("/".join(f"{ms[n]['cores_busy']:.2f}" for n in counts))
        e = row["estimate"]
        cells += [f"{e['round_ms'][n]:.1f}" for n in est]
        cells += [_fmt_scaling(e["scaling"][n], base["estimate"]["scaling"][n]) for n in est]
        per_round = [sc[top] / b[top] for sc, b in zip(e.get("per_round_scaling", []),
                                                         base["estimate"].get("per_round_scaling", []))]
        cells.append(f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "")
        cells.append(f"{items / e['round_ms'][top] * 1e3:.1f}")
        lines.append(markdown_row(cells))
    lines.append(f"\nMeasured: median model_run per round (ORT profile; scaling vs {m1} thread). Estimated: "
                 f"Amdahl per op type, overhead serial; scaling vs the fitted 1-thread time. (÷ base) = the "
                 f"model's scaling over the baseline's ({base['model']}); its range over rounds: from each round "
                 f"alone. Cores busy: the process's CPU time over wall time while the session ran.")
    starved = [f"{row['model']} at {n}t ({row['measured'][n]['cores_busy']:.2f})" for row in rows for n in counts
               if n > 1 and row["measured"][n]["cores_busy"] < 1.1]
    lines.append("(Cores busy below the thread count come from the model's serial ops and from other jobs on the "
                 "machine.)")
    if starved:
        lines.append("\n**Warning**: sessions that hardly used more than one core (a busy machine?), so their times "
                     "and the estimate measure the machine, not the model: " + ", ".join(starved) + ".")
    for row in rows:
        e = row["estimate"]
        total = e["round_ms"][top]
        lines.append(f"\n{row['model']}: per op type (ms per round; share of the estimated {total:.1f} ms at "
                     f"{top} threads: what caps the scaling)")
        h = ["op", "calls", *[f"{n}t ms" for n in counts], "p", f"{top}t ms (est.)", f"share at {top}t",
             f"share at {m1}t"]
        lines += Table(h).lines()
        t_m1 = sum(row["measured"][m1]["per_op_ms"].values()) + row["measured"][m1]["overhead_ms"]
        ops = sorted(e["ops"].items(), key=lambda kv: -kv[1]["ms"][top])
        rest = [0, 0.0, {n: 0.0 for n in counts}, 0.0]
        for op, o in ops:
            meas = {n: row["measured"][n]["per_op_ms"].get(op, 0.0) for n in counts}
            if o["ms"][top] / total < min_share and meas[m1] / t_m1 < min_share:
                rest[0] += 1
                rest[1] += o["ms"][top]
                for n in counts:
                    rest[2][n] += meas[n]
                continue
            lines.append(markdown_row([op, str(row["calls"].get(op, 0)), *[f"{meas[n]:.2f}" for n in counts],
                                            f"{o['p']:.2f}", f"{o['ms'][top]:.2f}", f"{o['ms'][top] / total:.1%}",
                                            f"{meas[m1] / t_m1:.1%}"]))
        if rest[0]:
            lines.append(markdown_row([f"other ({rest[0]} op types)", "", *[f"{rest[2][n]:.2f}" for n in counts],
                                            "", f"{rest[1]:.2f}", f"{rest[1] / total:.1%}",
                                            f"{rest[2][m1] / t_m1:.1%}"]))
        ov = e["overhead"]
        lines.append(markdown_row(["framework overhead (serial)", "",
                                        *[f"{row['measured'][n]['overhead_ms']:.2f}" for n in counts],
                                        f"0 (fitted {ov['p_if_fitted']:.2f})", f"{ov['ms']:.2f}",
                                        f"{ov['ms'] / total:.1%}",
                                        f"{row['measured'][m1]['overhead_ms'] / t_m1:.1%}"]))
    lines.append("\n" + CAVEATS)
    return "\n".join(lines)


def _counts(text: str, flag: str) -> list[int]:
    from graphopt.cli.bench import _thread_counts
    from graphopt.errors import GraphoptError

    try:
        return sorted(_thread_counts(text, flag))
    except GraphoptError as e:
        raise SystemExit(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="ONNX models; the first is the baseline")
    ap.add_argument("--calib", required=True, help="folder of .npz feeds (as graphopt bench --calib)")
    ap.add_argument("--threads", default="1,2", help="measured intra-op thread counts (at least two)")
    ap.add_argument("--estimate", default="4,8,16", help="thread counts to estimate")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--json", help="write everything here")
    args = ap.parse_args(argv)

    from graphopt import io
    from graphopt.bench import feed_items, model_settings
    from graphopt.data import feeds as feeds_mod

    counts, est = _counts(args.threads, "--threads"), _counts(args.estimate, "--estimate")
    if len(counts) < 2:
        raise SystemExit("--threads: give at least two thread counts to fit (1,2)")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    feeds = feeds_mod.load_dir(args.calib)
    feeds_mod.check_against(io.load(args.models[0]), feeds)
    models: dict[str, str] = {}
    for p in args.models:
        name = Path(p).stem
        while name in models:
            name += "'"
        models[name] = str(p)
    items = sum(feed_items(f) for f in feeds)
    load = os.getloadavg()
    measured = run_profiled(models, feeds, counts, args.rounds)
    load_after = os.getloadavg()
    rows = []
    for name, path in models.items():
        med = summarize(measured[name])
        per_op = collections.defaultdict(dict)
        for n in counts:
            for op, ms in med[n]["per_op_ms"].items():
                per_op[op][n] = ms
        e = estimate(per_op, {n: med[n]["overhead_ms"] for n in counts}, est)
        e["per_round_scaling"] = [per_round_estimate(measured[name], r, est)["scaling"] for r in range(args.rounds)]
        rows.append({"model": name, "path": path, "session_settings": model_settings(path),
                     "calls": measured[name][counts[0]]["calls"],
                     "rounds": {n: measured[name][n] for n in counts}, "measured": med,
                     "measured_scaling": {n: med[counts[0]]["model_run_ms"] / med[n]["model_run_ms"] for n in counts},
                     "estimate": e})
    base = rows[0]["estimate"]["scaling"]
    for row in rows:
        e = row["estimate"]
        e["items_per_s"] = {n: items / ms * 1e3 for n, ms in e["round_ms"].items()}
        e["scaling_vs_baseline"] = {n: s / base[n] for n, s in e["scaling"].items()}
        e["per_round_scaling_vs_baseline"] = [{n: s / b[n] for n, s in sc.items()} for sc, b in
                                              zip(e["per_round_scaling"], rows[0]["estimate"]["per_round_scaling"])]
        row["measured_scaling_vs_baseline"] = {n: s / rows[0]["measured_scaling"][n]
                                               for n, s in row["measured_scaling"].items()}
    print(f"{feeds_mod.describe(feeds)} ({items} items per round); threads {','.join(map(str, counts))} "
          f"measured, {','.join(map(str, est))} estimated; {args.rounds} rounds, all sessions interleaved, "
          f"spinning off; load average before {load[0]:.2f}, after {load_after[0]:.2f}\n")
    print(report(rows, counts, est, items))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": sys.argv if argv is None else ["tools/bench_thread_profile.py", *argv],
            "feeds": feeds_mod.describe(feeds), "items_per_round": items, "threads": counts, "estimate": est,
            "rounds": args.rounds, "load_average": [load[0], load_after[0]], "caveats": CAVEATS,
            "models": rows}, indent=1))
    return 0


if __name__ == "__main__":
    from graphopt.errors import GraphoptError

    try:
        raise SystemExit(main())
    except GraphoptError as err:  # a bad --calib folder or model: one line
        raise SystemExit(f"error: {err}") from None

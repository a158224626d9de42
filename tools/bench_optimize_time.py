#!/usr/bin/env python
"""How long `graphopt optimize` (default recipe, numeric verification) takes on MiniLM.

Runs the CLI as a user would (a fresh process each time, so imports count) on each MiniLM export,
``--repeat`` times (the exports taking turns, round-robin), and prints the median wall time per export. Goal: under 10 s on the 2-vCPU VM.

    .venv/bin/python tools/bench_optimize_time.py [--repeat 3] [--variants dynamo-sdpa,torchscript-eager]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from graphopt.bench.harness import print_table, round_robin

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "models"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default="dynamo-sdpa,dynamo-eager,torchscript-sdpa,torchscript-eager")
    args = ap.parse_args()
    import minilm  # noqa: PLC0415

    graphopt = str(Path(sys.executable).with_name("graphopt"))
    variants = args.variants.split(",")
    sources = {v: minilm.build(*v.split("-")) for v in variants}
    with tempfile.TemporaryDirectory() as d:
        calls = {v: (lambda src=src, v=v: subprocess.run([graphopt, "optimize", str(src), "-o", f"{d}/{v}.onnx", "-q"],
                                                         check=True))
                 for v, src in sources.items()}
        results = round_robin(calls, rounds=args.repeat, warmup=0)
    print_table(["export", "median s", "min s", "max s"],
                [[r.name, f"{r.p50:.2f}", f"{r.best:.2f}", f"{r.worst:.2f}"] for r in results])


if __name__ == "__main__":
    main()

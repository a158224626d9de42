#!/usr/bin/env python
"""Wall time and peak memory of ``graphopt optimize`` on large generated decoders (issue 14).

Each run is a fresh process (``python -m graphopt.cli.main optimize MODEL -o OUT ...``); its peak
is the child's maximum resident set size (``ru_maxrss`` from ``os.wait4``, as ``/usr/bin/time -v``
reports it: mapped weight pages count too), its wall time the process's. The load average before
and after each run is printed too: the machine is shared, and times from a busy minute are not
comparable. A watchdog stops a run (reported as such) when the system has less than ``--floor-gb``
available, so that no run takes the machine down.

Configurations (``--configs``): ``numeric`` (default recipe), ``structure`` (``--verify structure``),
``int8`` (the int8 recipe: calibration, static/dynamic search), ``int4`` (the int8 recipe with
``quantize.mode=int4``: GPTQ, MatMulNBits).

    python models/big_decoder.py --params 1b -o /tmp/big/dec-1b.onnx
    python tools/bench_bigmem.py /tmp/big/dec-0.1b.onnx /tmp/big/dec-1b.onnx --configs numeric,structure
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONFIGS = {
    "numeric": [],
    "structure": ["--verify", "structure"],
    "int8": ["--recipe", "int8"],
    "int4": ["--recipe", "int8", "--set", "quantize.mode=int4"],
}


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def run(model: Path, config: str, floor: int) -> dict:
    from graphopt.memory import weight_bytes

    with tempfile.TemporaryDirectory(prefix="bench-bigmem-") as d:
        cmd = [sys.executable, "-m", "graphopt.cli.main", "optimize", str(model), "-o", f"{d}/out.onnx",
               "--quiet", *CONFIGS[config]]
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        stopped = []

        def watch() -> None:
            while proc.poll() is None:
                if _available() < floor:
                    stopped.append(True)
                    proc.kill()
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        err = proc.stderr.read()
        proc.returncode = os.waitstatus_to_exitcode(status)
    weights = weight_bytes(model)
    return {"model": model.name, "config": config, "weights_gb": weights / 1e9, "wall_s": round(wall, 1),
            "peak_gb": round(usage.ru_maxrss * 1024 / 1e9, 3), "peak_per_file": round(usage.ru_maxrss * 1024 / weights, 2),
            "s_per_gb": round(wall / (weights / 1e9), 1), "rc": proc.returncode, "stopped": bool(stopped),
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2), "stderr": err[-500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--configs", default="numeric,structure")
    ap.add_argument("--floor-gb", type=float, default=2.5)
    ap.add_argument("--json", type=Path, help="append each result to this JSON-lines file")
    args = ap.parse_args()
    from graphopt.bench.harness import Table

    table = Table(["model", "config", "weights GB", "wall s", "s / GB", "peak GB", "peak / file", "load before/after",
                   "rc"])
    table.header()
    for m in args.models:
        for c in args.configs.split(","):
            r = run(m, c, int(args.floor_gb * 1e9))
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
            note = " (stopped: memory floor)" if r["stopped"] else ""
            table.row(r["model"], c, f"{r['weights_gb']:.2f}", r["wall_s"], r["s_per_gb"], r["peak_gb"],
                      f"{r['peak_per_file']}x", f"{r['load_before']}/{r['load_after']}", f"{r['rc']}{note}")


if __name__ == "__main__":
    main()

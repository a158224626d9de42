"""Peak memory of one decoder variant, in a process of its own: ``python -m graphopt.bench.rss_probe`` reads
``{"kind", "threads", "args", "prompt", "max_new"}`` (JSON) on stdin, loads the variant, generates once and
prints ``{"peak_rss_mb": ...}``: the kernel's high-water mark of resident memory (``VmHWM``) of a process that
holds only that runtime (Python, numpy, onnxruntime, which graphopt imports, and the variant's own library).

In one process shared by every variant, memory one variant freed is reused by the next, so what each adds
cannot be told apart; a process per variant can (:func:`probe` runs it and reads the answer).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from graphopt.bench.peers import build_variant
from graphopt.errors import RuntimeSetupError


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux ``VmHWM``; 0 where /proc is missing)."""
    try:
        m = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return 0.0
    return int(m.group(1)) / 1024 if m else 0.0


def probe(kind: str, threads: int, args: dict, prompt: Sequence[int], max_new: int) -> float:
    """The peak RSS (MB) of a fresh process that loads the variant and generates ``max_new`` tokens once."""
    doc = json.dumps({"kind": kind, "threads": threads, "args": args, "prompt": list(prompt), "max_new": max_new})
    proc = subprocess.run([sys.executable, "-m", "graphopt.bench.rss_probe"], input=doc, capture_output=True,
                          text=True, env=os.environ.copy())
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeSetupError(f"the memory probe of a {kind} variant failed: {tail[-1] if tail else proc.returncode}")
    return float(json.loads(lines[-1])["peak_rss_mb"])


def main() -> int:
    req = json.loads(sys.stdin.read())
    v = build_variant(req["kind"], threads=req["threads"], **req["args"])
    v.generate(req["prompt"], req["max_new"])
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

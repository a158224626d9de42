#!/usr/bin/env python
"""Decoder quality, size and decode speed of 4-bit models against their fp32 reference.

For each candidate: ``ppl_ratio``, the two perplexities and ``greedy_match`` on the held-back windows of the
text (``graphopt.generate.quality``; the tokenizer beside the reference), the file size (with its .data), and
decode tokens/s at batch 1, 1 thread, after a 16-token prefill (the median step of ``--rounds`` rounds of
``--steps`` steps, every model in turn in each round, all sessions loaded in this process). The load average
is printed before and after: the machine is shared.

    python tools/bench_int4.py REF.fp32.onnx CAND.onnx [CAND2.onnx ...] [--text FILE] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from graphopt.generate import quality
from graphopt.generate.loop import Decoder
from graphopt.rewrites.common.decode_timing import step_seconds
from graphopt.runtime.session import make_session


def _size(path: Path) -> int:
    data = [p for p in path.parent.glob(path.name + "*") if p != path and p.suffix == ".data"]
    return path.stat().st_size + sum(p.stat().st_size for p in data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("candidates", type=Path, nargs="+")
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    check = quality.decoder_check(args.reference, text=args.text)
    print(check.rows.describe())
    paths = [args.reference, *args.candidates]
    sessions = [make_session(p, threads=1, spinning=False) for p in paths]
    secs = step_seconds([Decoder(s) for s in sessions], steps=args.steps, rounds=args.rounds)
    print("| model | size MB | ppl (held-back) | ppl_ratio | greedy_match | decode tok/s, 1 thread | vs reference |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p, s, t in zip(paths, sessions, secs):
        m = check.measure(s, quality.HELD)
        print(f"| {p.name} | {_size(p) / 1e6:.1f} | {m['ppl']:.3f} | {m['ppl_ratio']:.4f} | {m['greedy_match']:.3f} "
              f"| {1 / t:.1f} | {secs[0] / t:.2f}x |")
    print(f"reference held-back ppl {check.ref_ppl['held']:.3f}, calibration ppl {check.ref_ppl['calib']:.3f}")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

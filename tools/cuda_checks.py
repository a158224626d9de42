"""CUDA checks for the ``fuse`` pass, as one prepared script for a GPU machine.

For each MiniLM export (cached by models/minilm.py; the cache folder must travel with the repo or
the exports must be built there), fuse, then run the fused model on the CUDA execution provider
and compare against the unfused model on CPU with optimizations off (padded feeds). Prints one
line per export and a JSON summary; exit code 0 when every check passed, 1 on a mismatch, and
0 with ``SKIP`` and the reason when CUDA is not available (no CUDAExecutionProvider, or the
session fell back to CPU).

    .venv/bin/python tools/cuda_checks.py [--atol 2e-3] [--json out.json]

The tolerance is looser than on CPU because the CUDA attention kernels accumulate in another order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXPORTS = [("torchscript", "eager"), ("torchscript", "sdpa"), ("dynamo", "eager"), ("dynamo", "sdpa")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--atol", type=float, default=2e-3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from graphopt.runtime import cuda_available

    ok, why = cuda_available()
    if not ok:
        print(f"SKIP: CUDA checks not run: {why}")
        return 0
    import onnx_ir as ir

    from graphopt import registry
    from graphopt.feeds import generate
    from graphopt.fusion_status import fusion_status
    from graphopt.metrics import compare
    from graphopt.runtime import make_session, run

    sys.path.insert(0, str(REPO / "models"))
    import minilm

    results, failed = [], False
    for exporter, attn in EXPORTS:
        path = Path(minilm.build(exporter=exporter, attn=attn))
        model = ir.load(path)
        feeds = generate(model)
        ref = run(make_session(model, optimize=False), feeds)
        registry.create("fuse", {})(model)
        status = fusion_status(model)
        sess = make_session(model, provider="cuda", optimize=True)
        if "CUDAExecutionProvider" not in sess.get_providers():
            print("SKIP: the CUDA provider did not initialise (CUDA libraries missing?)")
            return 0
        t = time.perf_counter()
        got = run(sess, feeds)
        dt = time.perf_counter() - t
        cmp = compare(got, ref, feeds, atol=args.atol, rtol=args.atol)
        passed = cmp.worst("max_abs") <= args.atol and status["fully_fused"]
        failed |= not passed
        row = {"export": f"{exporter}-{attn}", "max_abs": cmp.worst("max_abs"), "fully_fused": status["fully_fused"],
               "ops": status["ops"], "seconds": round(dt, 3), "passed": passed}
        results.append(row)
        print(("PASS" if passed else "FAIL"), json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

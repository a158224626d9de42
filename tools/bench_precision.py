#!/usr/bin/env python
"""Model size and parity of ``convert-precision`` (fp16, bf16) on MiniLM and the tiny decoders.

For each model: the recipe named (MiniLM: ``default`` then ``convert-precision``, on CPU and for CUDA;
decoders: ``convert-precision`` alone) through ``graphopt.engine.pipeline.optimize`` with numeric verification;
then the saved file's size against the fp32 file, and the outputs against the fp32 export on CPU on
the same generated feeds (MiniLM: real tokens of a right-padded batch; decoders: logits), run through
ONNX Runtime on CPU with the precision stand-ins where its CPU provider has no fp16/bf16 kernel
(and the PackedMultiHeadAttention stand-in for the CUDA recipe). Parity on CPU is the stand-ins'
arithmetic (fp32 compute, rounded to the type at each op output), not a CUDA kernel's.

    python tools/bench_precision.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("GRAPHOPT_CACHE", Path.home() / ".cache" / "graphopt")) / "models"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import collections

    import onnx_ir as ir

    from graphopt import io
    from graphopt.bench.harness import Table
    from graphopt.data import feeds as feeds_mod
    from graphopt.data.metrics import compare
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.verify import run_model
    from graphopt.runtime.session import make_session, run

    cases = [("minilm-dynamo-sdpa", "cpu", "cleanup,fuse,remove-padding,convert-precision"),
             ("minilm-dynamo-sdpa", "cuda", "cleanup,fuse,remove-padding,convert-precision"),
             ("tiny-llama-causal-lm-dynamo", "cpu", "convert-precision"),
             ("tiny-gpt2-causal-lm-dynamo", "cpu", "convert-precision")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, provider, passes in cases:
            src = CACHE / f"{name}.onnx"
            model = ir.load(src)
            feeds = feeds_mod.generate(model)
            ref = run(make_session(str(src), optimize=False), feeds)
            for precision in ("fp16", "bf16"):
                t0 = time.perf_counter()
                res = pipeline.optimize(str(src), OptimizeOptions(
                    passes=passes, provider=provider, feeds=feeds * 2,
                    overrides=[f"convert-precision.precision={precision}"]))
                rec = res.report.passes[-1]
                out = Path(tmp) / f"{name}-{provider}-{precision}.onnx"
                row = {"model": name, "recipe": passes, "provider": provider, "precision": precision,
                       "ok": res.ok, "seconds": round(time.perf_counter() - t0, 1),
                       "fp32_mb": round(src.stat().st_size / 1e6, 2)}
                if res.ok:
                    io.save(res.model, out)
                    got = run_model(res.model, feeds)
                    cmp = compare(got, ref, feeds)
                    kinds = collections.Counter(n.op_type for n in res.model.graph if n.op_type == "Cast")
                    row.update(mb=round(out.stat().st_size / 1e6, 2), cosine=cmp.worst("cosine"),
                               cosine_min=cmp.worst("cosine_min"), max_abs=cmp.worst("max_abs"),
                               casts=rec.rule_counts.get("casts", 0), cast_nodes=kinds["Cast"],
                               fp32_kept=next((n[len("kept fp32: "):] for n in rec.notes if n.startswith("kept fp32")), ""),
                               stand_ins=rec.verification.get("cpu_stand_ins", []))
                else:
                    row["error"] = [r.error for r in res.report.failed()]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    table = Table(["model", "recipe (provider)", "precision", "size MB (fp32 → converted)", "cosine mean / min",
                   "max_abs", "Casts added", "kept fp32"])
    table.header()
    for r in rows:
        what = [r["model"], f"{r['recipe']} ({r['provider']})", r["precision"]]
        if not r["ok"]:
            table.row(*what, f"failed: {r['error']}", "", "", "", "")
            continue
        table.row(*what, f"{r['fp32_mb']} → {r['mb']}", f"{r['cosine']:.6f} / {r['cosine_min']:.6f}",
                  f"{r['max_abs']:.2g}", r["casts"], r["fp32_kept"] or "—")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())

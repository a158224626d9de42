"""Benchmark kernel fusion on MiniLM: graphopt ``fuse`` against ORT's and onnxscript's fusers.

For each export (TorchScript / dynamo x eager / sdpa) four variants are loaded in one process:

  baseline    the export as is, ORT_ENABLE_ALL
  ort-tx      onnxruntime.transformers.optimizer.optimize_model(model_type="bert", 12 heads, 384)
  onnxscript  onnxscript.rewriter.ort_fusions.optimize_for_ort
  graphopt    the ``fuse`` pass (CPU form: residual LayerNorms as Sum + LayerNormalization)

Every session: CPU, 1 intra-op thread, spinning off, ORT_ENABLE_ALL. Runs are interleaved
round-robin (the VM has slow phases) and medians reported, at batch 1 x 128 and on a batch of 32
of random lengths 7-128 (median ~28) padded to the longest.

With one intra-op thread ORT runs every kernel on the calling thread, so ``--clock cpu`` (the default)
times each run by that thread's CPU time (``time.thread_time``): time spent waiting for a core that
other jobs hold is not counted, which makes ratios on a shared machine far steadier than wall time.
Cache and memory-bandwidth contention still count. ``--clock wall`` gives wall time.

    .venv/bin/python tools/bench_fusion.py [--rounds-1x128 30] [--rounds-b32 7] [--clock cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
EXPORTS = [("torchscript", "eager"), ("torchscript", "sdpa"), ("dynamo", "eager"), ("dynamo", "sdpa")]
VARIANTS = ["baseline", "ort-tx", "onnxscript", "graphopt"]


def _minilm(exporter: str, attn: str) -> Path:
    sys.path.insert(0, str(REPO / "models"))
    import minilm  # models/minilm.py

    return Path(minilm.build(exporter=exporter, attn=attn))


def _variant(path: Path, kind: str, tmp: Path) -> bytes | str | None:
    """Model bytes (or a path) for ``kind``; None when that fuser fails on this export."""
    import onnx_ir as ir

    if kind == "baseline":
        return str(path)
    try:
        if kind == "ort-tx":
            from onnxruntime.transformers.optimizer import optimize_model

            opt = optimize_model(str(path), model_type="bert", num_heads=12, hidden_size=384)
            out = tmp / f"{path.stem}-orttx.onnx"
            opt.save_model_to_file(str(out))
            return str(out)
        model = ir.load(path)
        if kind == "onnxscript":
            from onnxscript.rewriter.ort_fusions import optimize_for_ort

            model, _ = optimize_for_ort(model)
        else:
            from graphopt.engine import registry

            registry.create("fuse")(model)
        out = tmp / f"{path.stem}-{kind}.onnx"
        ir.save(model, out)
        return str(out)
    except Exception as e:  # noqa: BLE001 - a fuser failing is a result, not a crash
        logger.warning("%s failed on %s: %s", kind, path.name, e)
        return None


def _fused_ops(src: str) -> str:
    """Contrib ops by count, plus ``fuse``'s CPU residual form (Sum feeding a LayerNormalization)."""
    import onnx

    from graphopt.opsets import MS_DOMAIN

    m = onnx.load(src, load_external_data=False)
    counts: dict[str, int] = {}
    sums = {o for n in m.graph.node if n.op_type == "Sum" and n.domain in ("", "ai.onnx") for o in n.output}
    for n in m.graph.node:
        if n.domain == MS_DOMAIN:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
        elif n.op_type in ("LayerNormalization", "SimplifiedLayerNormalization") and n.input[0] in sums:
            key = f"Sum+{n.op_type}"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"


def _feeds(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)

    def make(lengths: list[int]) -> dict[str, np.ndarray]:
        b, s = len(lengths), max(lengths)
        ids = rng.integers(1000, 30000, size=(b, s), dtype=np.int64)
        mask = np.zeros((b, s), np.int64)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        ids[:, 0] = 101
        ids = np.where(mask == 1, ids, 0)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((b, s), np.int64)}

    lengths = np.clip(np.round(np.exp(rng.normal(np.log(28), 0.65, size=32))), 7, 128).astype(int).tolist()
    return {"1x128": make([128]), "b32": make(lengths)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds-1x128", type=int, default=30)
    ap.add_argument("--rounds-b32", type=int, default=7)
    ap.add_argument("--exports", default="all", help="comma list like torchscript-eager,dynamo-sdpa")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: the calling thread's CPU time (steadier on a shared machine); wall: wall time")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING)
    from graphopt.bench import BenchResult, bench_sessions, print_table
    from graphopt.runtime.session import make_session

    exports = EXPORTS if args.exports == "all" else [tuple(e.split("-")) for e in args.exports.split(",")]
    feeds = _feeds()
    b32 = feeds["b32"]["attention_mask"].sum(1)
    pad = 1 - b32.sum() / (b32.size * b32.max())
    print(f"batch 32: lengths {int(b32.min())}-{int(b32.max())}, median {int(np.median(b32))}, "
          f"padded to {int(b32.max())} ({pad:.0%} padding)")
    sessions: dict[tuple[str, str], object] = {}
    ops: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fusion-") as tmp:
        for exporter, attn in exports:
            path = _minilm(exporter, attn)
            for kind in VARIANTS:
                t = time.perf_counter()
                src = _variant(path, kind, Path(tmp))
                if src is None:
                    continue
                key = (f"{exporter}-{attn}", kind)
                sessions[key] = make_session(src, threads=1, spinning=False, optimize=True)
                ops[key] = _fused_ops(src) if kind != "baseline" else "-"
                logger.info("%s %s ready in %.1fs", *key, time.perf_counter() - t)
        times: dict[str, dict[tuple[str, str], BenchResult]] = {"1x128": {}, "b32": {}}
        for wl, rounds in (("1x128", args.rounds_1x128), ("b32", args.rounds_b32)):
            by_name = {f"{e} {k}": sess for (e, k), sess in sessions.items()}
            results = bench_sessions(by_name, [feeds[wl]], rounds=rounds, warmup=1, clock=args.clock)
            for key, res in zip(sessions, results, strict=True):
                times[wl][key] = res
    rows = []
    for key in sessions:
        exp, kind = key
        base = (exp, "baseline")
        row = {"export": exp, "variant": kind, "fused": ops[key]}
        for wl in times:
            res = times[wl][key]
            row[f"{wl}_ms"] = round(res.p50 * 1e3, 2)
            row[f"{wl}_speedup"] = round(res.speedup_over(times[wl][base]), 3) if base in sessions else None
        rows.append(row)
    print(f"clock: {args.clock}")
    print_table(["export", "variant", "1x128 ms", "vs baseline", "b32 ms", "vs baseline", "contrib ops"],
                [[r["export"], r["variant"], f"{r['1x128_ms']:.2f}", f"{r['1x128_speedup']:.2f}x", f"{r['b32_ms']:.1f}",
                  f"{r['b32_speedup']:.2f}x", r["fused"]] for r in rows])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

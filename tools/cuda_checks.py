"""CUDA checks for ``fuse``, ``remove-padding``, ``quantize`` and ``fp16``, as one prepared script for a GPU machine.

First, its own provider check: a one-node model must get a session on ONNX Runtime's CUDA provider
(``SKIP`` with the reason otherwise, before any model is built).

For each MiniLM export (cached by models/minilm.py; the cache folder must travel with the repo, e.g.
via ``GRAPHOPT_CACHE``, or the exports must be built there):

``fuse``: fuse, run the fused model on the CUDA execution provider and compare against the unfused
model on CPU with optimizations off (generated padded feeds).

``remove-padding``: the default recipe with ``provider="cuda"`` through the pipeline (fuse, then
remove-padding with com.microsoft PackedMultiHeadAttention; the pipeline verifies it on CPU through
the op's standard-op stand-in), then the model on the CUDA provider: it must hold one
PackedMultiHeadAttention per layer and match the unpacked fp32 export on CPU on real tokens, on
variable-length batches of 32 from tools/workload.py (MiniLM tokenizer; else seeded lengths with
random ids) plus a left-padded batch, batch 1 and a batch without padding. For one export
(``--time-export``) it is then timed against the fused padded model on CUDA, and against
remove-padding's CPU formulation (length groups of MultiHeadAttention) on CUDA: all in one process,
interleaved rounds of every batch, medians and ratios.

``quantize`` (``--quant-export`` only, default dynamo-sdpa): the ``int8`` recipe with ``provider="cuda"``
(static QDQ, s8 activations and weights) calibrated on half of the workload batches, then the QDQ
model on the CUDA provider: it must load there (no CPU fallback), and its real-token outputs must meet
the default budget (cosine >= 0.99, min >= 0.97) against the fp32 export on CPU on the other half.

``fp16`` (``--fp16-export`` only, default dynamo-sdpa): the ``fp16`` recipe for CUDA (the CUDA
default recipe, then ``convert-precision``: fp16 weights and compute, fp32 islands), then the model on
the CUDA provider: every MatMul, SkipLayerNormalization and PackedMultiHeadAttention in fp16, and its
real-token outputs within cosine >= 0.999 (mean and min) of the fp32 export on CPU, on every parity
batch. Then it is timed against the unoptimized fp32 export and the fp32 packed model on CUDA through
IO bindings (inputs on the device, outputs left there), at batch 1x128 and on the 32-sentence
variable-length batches, interleaved.

Prints one line per check and a JSON summary; exit code 0 when every check passed, 1 on a mismatch,
and 0 with ``SKIP`` and the reason when CUDA is not available (no CUDAExecutionProvider, or the
session fell back to CPU). ``--dry-run-cpu`` runs the same code on the CPU provider (the CUDA-only op
through its stand-in) to test the script on a machine without CUDA; it checks nothing about CUDA.

    .venv/bin/python tools/cuda_checks.py [--atol 2e-3] [--checks fuse,remove-padding,quantize,fp16] [--json out.json]

Getting ``onnxruntime-gpu`` onto the device: ``tools/split_ort_gpu_wheel.py`` (README, "CUDA").

The tolerance is looser than on CPU because the CUDA kernels accumulate in another order. Parity
sessions run with TF32 off (``use_tf32=0``, ORT's default is on), so the differences are fp32 ones;
timing sessions use ORT's defaults.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
EXPORTS = [("torchscript", "eager"), ("torchscript", "sdpa"), ("dynamo", "eager"), ("dynamo", "sdpa")]
CHECKS = ("fuse", "remove-padding", "quantize", "fp16")
FP16_BUDGET = "cosine>=0.999,cosine_min>=0.999"
BATCH = 32
LAYERS = 6  # MiniLM-L6: one PackedMultiHeadAttention each


class _Skip(Exception):
    pass


class Sessions:
    """Makes the sessions: CUDA (TF32 off for parity), or CPU for a dry run (CUDA-only ops as stand-ins)."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.tf32_option = True

    def make(self, model, *, parity: bool):
        from graphopt import io
        from graphopt.errors import first_line
        from graphopt.runtime.session import make_session, runnable, session_options

        if self.dry_run:
            return make_session(runnable(model, "cpu")[0], provider="cpu", optimize=True)
        if not parity:
            sess = make_session(model, provider="cuda", optimize=True)
        else:  # TF32 off: graphopt.runtime.session.make_session takes no provider options
            import onnxruntime as ort

            data = io.to_proto(model).SerializeToString()
            opts = {"use_tf32": "0"} if self.tf32_option else {}
            try:
                sess = ort.InferenceSession(data, sess_options=session_options(optimize=True),
                                            providers=[("CUDAExecutionProvider", opts), "CPUExecutionProvider"])
            except Exception as e:
                if not opts:
                    raise
                print(f"note: CUDA provider option use_tf32 not accepted ({first_line(e, 120)}); "
                      "parity runs with ORT's default TF32 setting", flush=True)
                self.tf32_option = False
                return self.make(model, parity=parity)
        if "CUDAExecutionProvider" not in sess.get_providers():
            raise _Skip("the CUDA provider did not initialise (CUDA libraries missing?)")
        return sess


def _cuda_pass(name: str, model, **options):
    """Run pass ``name`` on ``model`` as ``optimize --provider cuda`` does (provider in its context)."""
    from graphopt.engine import registry

    return registry.create(name, options)(model, registry.PassContext(provider="cuda"))


def _workload(n: int, seed: int) -> tuple[list[np.ndarray], str]:
    sys.path.insert(0, str(REPO / "tools"))
    import bench_padding  # type: ignore[import-not-found]

    return bench_padding.workload(n, seed)


def _batch(seqs: list[np.ndarray], left: bool = False) -> dict[str, np.ndarray]:
    s = max(len(x) for x in seqs)
    ids = np.zeros((len(seqs), s), np.int64)
    mask = np.zeros((len(seqs), s), np.int64)
    for i, x in enumerate(seqs):
        cols = slice(s - len(x), s) if left else slice(0, len(x))
        ids[i, cols] = x
        mask[i, cols] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def parity_feeds(seqs: list[np.ndarray]) -> tuple[list[dict], list[dict], list[str]]:
    """Variable-length batches (timed too), and the extra parity cases: left padding, batch 1, no padding."""
    batches = [_batch(seqs[i : i + BATCH]) for i in range(0, len(seqs) - BATCH + 1, BATCH)]
    shortest = min(len(x) for x in seqs[:8])
    extra = [_batch(seqs[:BATCH], left=True), _batch(seqs[:1]), _batch([x[:shortest] for x in seqs[:8]])]
    names = [f"batch{i}" for i in range(len(batches))] + ["left-padded", "batch-1", "no-padding"]
    return batches, batches + extra, names


def check_fuse(path: Path, label: str, sessions: Sessions, atol: float) -> dict:
    import onnx_ir as ir

    from graphopt.analysis.fusion_status import fusion_status
    from graphopt.data.feeds import generate
    from graphopt.data.metrics import compare
    from graphopt.runtime.session import make_session, run

    model = ir.load(path)
    feeds = generate(model)
    ref = run(make_session(model, optimize=False), feeds)
    _cuda_pass("fuse", model)
    status = fusion_status(model)
    sess = sessions.make(model, parity=True)
    t = time.perf_counter()
    got = run(sess, feeds)
    dt = time.perf_counter() - t
    cmp = compare(got, ref, feeds, atol=atol, rtol=atol)
    # on CUDA every residual LayerNorm becomes SkipLayerNormalization: none left after an Add
    passed = cmp.worst("max_abs") <= atol and status["fully_fused"] and status["layer_norm_after_add"] == 0
    return {"check": "fuse", "export": label, "max_abs": cmp.worst("max_abs"), "fully_fused": status["fully_fused"],
            "layer_norm_after_add": status["layer_norm_after_add"], "ops": status["ops"], "seconds": round(dt, 3),
            "passed": passed}


def check_remove_padding(path: Path, label: str, sessions: Sessions, atol: float, seqs: list[np.ndarray],
                         timing: dict | None) -> dict:
    import onnx_ir as ir

    from graphopt.bench import bench_sessions
    from graphopt.data.metrics import compare
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.runtime.session import make_session, run

    t0 = time.perf_counter()
    res = pipeline.optimize(str(path), OptimizeOptions(provider="cuda"))
    t_opt = time.perf_counter() - t0
    rp = next((r for r in res.report.passes if r.name == "remove-padding"), None)
    ops = collections.Counter(n.op_type for n in res.model.graph)
    row: dict = {"check": "remove-padding", "export": label, "pipeline_ok": res.ok,
                 "pipeline_seconds": round(t_opt, 2), "packed_mha": ops["PackedMultiHeadAttention"],
                 "mha": ops["MultiHeadAttention"], "cpu_stand_in_max_abs": (rp.verification or {}).get("max_abs")
                 if rp else None, "notes": rp.notes if rp else []}
    if not res.ok or ops["PackedMultiHeadAttention"] != LAYERS or ops["MultiHeadAttention"]:
        row.update(passed=False, error=f"pipeline ok={res.ok}, PackedMultiHeadAttention {ops['PackedMultiHeadAttention']}"
                                        f" (want {LAYERS}); errors: {[r.error for r in res.report.failed()]}")
        return row
    batches, feeds, names = parity_feeds(seqs)
    ref = run(make_session(path, optimize=False), feeds)  # the unpacked fp32 export on CPU
    sess = sessions.make(res.model, parity=True)
    got = run(sess, feeds)
    per_case = {}
    for name, f, g, r in zip(names, feeds, got, ref):
        per_case[name] = compare([g], [r], [f], atol=atol, rtol=atol).worst("max_abs")
    worst = max(per_case.values())
    row.update(max_abs=worst, max_abs_by_case={k: float(f"{v:.3g}") for k, v in per_case.items()},
               passed=worst <= atol)
    if timing is not None and row["passed"]:
        fused = ir.load(path)
        _cuda_pass("fuse", fused)
        groups = ir.load(path)
        _cuda_pass("fuse", groups)
        _cuda_pass("remove-padding", groups, packed_attention=False)
        timed = {"fused-padded": sessions.make(fused, parity=False),
                 "rp-packed-mha": sessions.make(res.model, parity=False),
                 "rp-mha-groups": sessions.make(groups, parity=False)}
        results = bench_sessions(timed, batches, rounds=timing["rounds"], warmup=2)
        base = results[0]
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        slots = sum(b["attention_mask"].size for b in batches)
        row["timing"] = {"batches": len(batches), "batch": BATCH, "padding": round(1 - real / slots, 3),
                         "workload": timing["source"], "rounds": timing["rounds"],
                         "variants": [r.as_dict(base) for r in results]}
    return row


def check_quantize(path: Path, label: str, sessions: Sessions, seqs: list[np.ndarray]) -> dict:
    from graphopt.data.metrics import DEFAULT_BUDGET, compare, parse_budget
    from graphopt.engine import pipeline, recipe
    from graphopt.engine.options import OptimizeOptions
    from graphopt.runtime.session import make_session, run

    batches, _, _ = parity_feeds(seqs)
    half = max(1, len(batches) // 2)
    calib, held = batches[:half], batches[half:] or batches
    t0 = time.perf_counter()
    res = pipeline.optimize(str(path), OptimizeOptions(recipe=recipe.load("int8", provider="cuda"),
                                                       provider="cuda", feeds=calib, budget=DEFAULT_BUDGET))
    t_opt = time.perf_counter() - t0
    q = next((r for r in res.report.passes if r.name == "quantize"), None)
    ops = collections.Counter(n.op_type for n in res.model.graph)
    row: dict = {"check": "quantize", "export": label, "pipeline_ok": res.ok, "pipeline_seconds": round(t_opt, 2),
                 "ops": {k: v for k, v in ops.items() if "uantize" in k or k in ("MatMul", "PackedMultiHeadAttention")},
                 "notes": q.notes if q else []}
    if not res.ok or not ops["QuantizeLinear"] or not ops["DequantizeLinear"]:
        row.update(passed=False, error=f"pipeline ok={res.ok}, QuantizeLinear {ops['QuantizeLinear']}; "
                                       f"errors: {[r.error for r in res.report.failed()]}")
        return row
    ref = run(make_session(path, optimize=False), held)  # fp32 export on CPU
    got = run(sessions.make(res.model, parity=True), held)
    cmp = compare(got, ref, held)
    failures = parse_budget(DEFAULT_BUDGET).failures(cmp)
    row.update(cosine=cmp.worst("cosine"), cosine_min=cmp.worst("cosine_min"), budget=DEFAULT_BUDGET,
               passed=not failures, error="; ".join(failures) if failures else None)
    return row


def check_fp16(path: Path, label: str, sessions: Sessions, seqs: list[np.ndarray], rounds: int) -> dict:
    import onnx_ir as ir

    from graphopt.bench import bench_sessions
    from graphopt.data.metrics import compare, parse_budget
    from graphopt.engine import pipeline, recipe
    from graphopt.engine.options import OptimizeOptions
    from graphopt.runtime.session import make_session, run

    batches, feeds, names = parity_feeds(seqs)
    t0 = time.perf_counter()
    res = pipeline.optimize(str(path), OptimizeOptions(recipe=recipe.load("fp16", provider="cuda"),
                                                       provider="cuda"))
    t_opt = time.perf_counter() - t0
    conv = next((r for r in res.report.passes if r.name == "convert-precision"), None)
    dtypes = collections.Counter((n.op_type, n.outputs[0].dtype.name) for n in res.model.graph
                                 if n.op_type in ("MatMul", "SkipLayerNormalization", "PackedMultiHeadAttention"))
    row: dict = {"check": "fp16", "export": label, "pipeline_ok": res.ok, "pipeline_seconds": round(t_opt, 2),
                 "ops": {f"{k[0]}:{k[1]}": v for k, v in dtypes.items()},
                 "cpu_stand_in_cosine": (conv.verification or {}).get("cosine") if conv else None,
                 "notes": conv.notes if conv else []}
    if not res.ok or any(k[1] != "FLOAT16" for k in dtypes) or dtypes[("PackedMultiHeadAttention", "FLOAT16")] != LAYERS:
        row.update(passed=False, error=f"pipeline ok={res.ok}, ops {row['ops']}; errors: {[r.error for r in res.report.failed()]}")
        return row
    ref = run(make_session(path, optimize=False), feeds)  # fp32 export on CPU
    got = run(sessions.make(res.model, parity=True), feeds)
    budget = parse_budget(FP16_BUDGET)
    per_case, failures = {}, []
    for name, f, g, r in zip(names, feeds, got, ref):
        cmp = compare([g], [r], [f])
        per_case[name] = round(cmp.worst("cosine_min"), 6)
        failures += [f"{name}: {x}" for x in budget.failures(cmp)]
    row.update(cosine_min_by_case=per_case, budget=FP16_BUDGET, passed=not failures,
               error="; ".join(failures) if failures else None)
    if row["passed"] and rounds:
        packed32 = pipeline.optimize(str(path), OptimizeOptions(provider="cuda",
                                                                verify_level="structure")).model
        timed = {"export-fp32": sessions.make(ir.load(path), parity=False),
                 "packed-fp32": sessions.make(packed32, parity=False),
                 "packed-fp16": sessions.make(res.model, parity=False)}
        device = None if sessions.dry_run else "cuda"
        one = [_batch([np.resize(seqs[0], 128)])]
        timing = {}
        for case, fs in (("batch 1x128", one), (f"{len(batches)} batches of {BATCH} mixed lengths", batches)):
            results = bench_sessions(timed, fs, rounds=rounds, warmup=2, device=device)
            timing[case] = [r.as_dict(results[0]) for r in results]
        row["timing"] = timing
    return row


def _provider_check() -> str | None:
    """None when a one-node model gets a session on the CUDA provider, else why not."""
    import onnx_ir as ir
    import onnxruntime as ort

    from graphopt import io
    from graphopt.errors import first_line

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu: README, CUDA)"
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    node = ir.node("Relu", [x])
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 20})
    try:
        sess = ort.InferenceSession(io.to_proto(ir.Model(graph, ir_version=10)).SerializeToString(),
                                    providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    except Exception as e:
        return f"no CUDA session: {first_line(e, 200)}"
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        return "the CUDA provider did not initialise (CUDA 13 runtime / cuDNN 9 libraries missing, or no GPU visible)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--atol", type=float, default=2e-3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    ap.add_argument("--exports", default=",".join(f"{e}-{a}" for e, a in EXPORTS),
                    help="comma-separated exporter-attn pairs")
    ap.add_argument("--time-export", default="dynamo-sdpa", help="the export timed by remove-padding ('' for none)")
    ap.add_argument("--quant-export", default="dynamo-sdpa", help="the export the quantize check runs on")
    ap.add_argument("--fp16-export", default="dynamo-sdpa", help="the export the fp16 check runs on")
    ap.add_argument("--batches", type=int, default=8, help="variable-length batches of 32 (parity and timing)")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (every batch once per variant)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run everything on the CPU provider (tests the script; checks nothing about CUDA)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        ap.error(f"unknown check {unknown[0]!r} (use {', '.join(CHECKS)})")
    exports = [tuple(x.strip().split("-", 1)) for x in args.exports.split(",") if x.strip()]

    if not args.dry_run_cpu:
        why = _provider_check()
        if why:
            print(f"SKIP: CUDA checks not run: {why}")
            return 0
        import onnxruntime as ort

        print(f"provider check: onnxruntime {ort.__version__} ({ort.__file__}) runs on CUDAExecutionProvider", flush=True)
    if args.dry_run_cpu:
        print("DRY RUN on the CPU provider: tests this script, checks nothing about CUDA", flush=True)

    sys.path.insert(0, str(REPO / "models"))
    import minilm

    sessions = Sessions(args.dry_run_cpu)
    seqs, source = ([], "")
    if {"remove-padding", "quantize", "fp16"} & set(checks):
        seqs, source = _workload(BATCH * args.batches, args.seed)
        print(f"workload: {source}", flush=True)
    results, failed = [], False
    t_start = time.perf_counter()
    try:
        for exporter, attn in exports:
            label = f"{exporter}-{attn}"
            path = Path(minilm.build(exporter=exporter, attn=attn))
            for check in checks:
                t = time.perf_counter()
                if check == "fuse":
                    row = check_fuse(path, label, sessions, args.atol)
                elif check == "quantize":
                    if label != args.quant_export:
                        continue
                    row = check_quantize(path, label, sessions, seqs)
                elif check == "fp16":
                    if label != args.fp16_export:
                        continue
                    row = check_fp16(path, label, sessions, seqs, args.rounds)
                else:
                    timing = {"rounds": args.rounds, "source": source} if label == args.time_export else None
                    row = check_remove_padding(path, label, sessions, args.atol, seqs, timing)
                row["check_seconds"] = round(time.perf_counter() - t, 1)
                failed |= not row["passed"]
                results.append(row)
                print(("PASS" if row["passed"] else "FAIL"), json.dumps(row, default=str), flush=True)
    except _Skip as e:
        print(f"SKIP: {e}")
        return 0
    for row in results:
        for case, variants in (row.get("timing") or {}).items() if row["check"] == "fp16" else ():
            for v in variants:
                print(f"  fp16 {case}: {v['model']:<12} {v['p50_ms']:8.2f} ms  x{v.get('speedup_vs_first', 1.0):.2f} vs export-fp32")
        for v in (row.get("timing") or {}).get("variants", []) if row["check"] != "fp16" else ():
            print(f"  {row['export']} {v['model']:<14} {v['p50_ms']:8.2f} ms/round  "
                  f"{v['items_per_s']:9.1f} sentences/s  x{v.get('speedup_vs_first', 1.0):.2f} vs fused-padded")
    print(f"total {time.perf_counter() - t_start:.1f} s{' (dry run on CPU)' if args.dry_run_cpu else ''}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Whole-model sparsity measurements: BERT-base speed at 75% FFN blocks, MiniLM quality/speed per pattern.

``--bert``: a seeded, randomly initialised BERT-base-sized encoder (``transformers.BertConfig()`` defaults:
hidden 768, 12 layers, FFN 3072; speed only, its quality means nothing), exported with the project's
exporter (dynamo), fused (``cleanup,fuse``), then ``sparsify pattern=blocks sparsity=0.75`` on the FFNs
(32x32 and 32x128 blocks).
Dense vs sparse are timed interleaved at batch ``--batch`` x ``--seq`` (thread CPU time, one thread).

``--minilm``: all-MiniLM-L6-v2 (dynamo eager export, fused), real sentences (``tools/workload.py``): every
pattern at fixed sparsities with and without compensation, and ``contextual-sparsity`` at fixed keeps; each
row gives the held-back embedding cosine (mean-pooled, the sentence-embedding output), the pass's token-level
worst cosine, and the speed vs the fused dense model at batch 32 (interleaved, thread CPU time, one thread).

``--budget SPEC``: MiniLM through ``pipeline.optimize`` (``cleanup,fuse,sparsify`` and
``cleanup,fuse,contextual-sparsity``) under ``SPEC`` with ``-n`` sentences as the given feeds (the pipeline
calibrates on half and confirms on the other half), then the result is checked on ``-n`` more sentences
neither saw.

    python tools/bench_sparse_models.py --bert [--rounds 3]
    python tools/bench_sparse_models.py --minilm [--rounds 5] [--only blocks-75,blocks32x128-75,contextual]
    python tools/bench_sparse_models.py --budget 'cosine>=0.99' [-n 96] [--unseen 128] [--passes sparsify]
        [--override sparsify.confidence=0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "models"))
sys.path.insert(0, str(REPO / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bert_base(rounds: int, batch: int, seq: int) -> dict:
    import _build
    import onnx_ir as ir
    import transformers

    from graphopt.bench import bench_sessions, speedups
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.registry import PassContext
    from graphopt.rewrites.sparsify import SparsifyPass
    from graphopt.runtime import session as runtime

    _build.offline()
    folder = _build.place_random_model(transformers.AutoModel, transformers.BertConfig(),
                                       _build.cache_dir() / "bert-base-random", seed=0)
    path = _build.export_cached(folder, "bert-base-random-dynamo", task="feature-extraction", exporter="dynamo")
    rng = np.random.default_rng(0)
    names = {v.name for v in ir.load(path).graph.inputs}

    def feed(b: int, s: int) -> dict[str, np.ndarray]:
        f = {"input_ids": rng.integers(1, 30000, size=(b, s)).astype(np.int64),
             "attention_mask": np.ones((b, s), np.int64), "token_type_ids": np.zeros((b, s), np.int64)}
        return {k: v for k, v in f.items() if k in names}

    small = [feed(2, 32), feed(2, 32)]
    dense = pipeline.optimize(str(path), OptimizeOptions(passes="cleanup,fuse", feeds=small,
                                                         verify_level="structure")).model
    sessions = {"dense (fused)": runtime.make_session(dense, threads=1, spinning=False)}
    for cols in (32, 128):
        t0 = time.perf_counter()
        res = SparsifyPass(pattern="blocks", sparsity=0.75, scores="magnitude", compensate=False, block_cols=cols)(
            dense.clone(), PassContext(calib_feeds=small[:1], feeds=small[1:]))
        print(f"sparsify 32x{cols} took {time.perf_counter() - t0:.1f} s; rule counts {res.rule_counts}", flush=True)
        sessions[f"blocks 32x{cols} 75%"] = runtime.make_session(res.model, threads=1, spinning=False)
    big = [feed(batch, seq)]
    out = bench_sessions(sessions, big, rounds=rounds, warmup=1, clock="cpu")
    speed = speedups(out)
    rows = [{"model": r.name, "seconds": round(r.p50, 3), "speedup": round(speed[r.name], 3)} for r in out]
    for r in rows:
        print(f"BERT-base {batch}x{seq}: {r['model']:18s} {r['seconds']:7.3f} s  {r['speedup']:.2f}x")
    return {"bert_base": rows, "batch": batch, "seq": seq, "rounds": rounds}


#: --minilm variants: name -> (pattern, sparsity, extra sparsify options)
MINILM_SPECS = {"neurons-25": ("neurons", 0.25, {}), "neurons-50": ("neurons", 0.5, {}),
                "blocks-75": ("blocks", 0.75, {}), "blocks32x128-75": ("blocks", 0.75, {"block_cols": 128}),
                "2:4": ("2:4", 0.5, {}), "unstructured-50": ("unstructured", 0.5, {})}


def minilm(rounds: int, n_sent: int, only: list[str] | None = None) -> dict:
    import minilm as minilm_mod
    import onnx_ir as ir
    import transformers
    import workload

    from graphopt.bench import bench_sessions, print_table, speedups
    from graphopt.data.metrics import compare
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.registry import PassContext
    from graphopt.rewrites.contextual_sparsity import ContextualSparsityPass
    from graphopt.rewrites.sparsify import SparsifyPass
    from graphopt.runtime import session as runtime

    src = minilm_mod.source_folder()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    sentences = workload.generate(n_sent, seed=0)

    def batches(ss: list[str], b: int) -> list[dict[str, np.ndarray]]:
        out = []
        for i in range(0, len(ss), b):
            e = tok(ss[i:i + b], padding=True, truncation=True, max_length=128, return_tensors="np")
            out.append({k: e[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")})
        return out

    half = n_sent // 2
    calib, held = batches(sentences[:half], 16), batches(sentences[half:], 32)
    path = minilm_mod.build(exporter="dynamo", attn="eager")
    dense = pipeline.optimize(str(path), OptimizeOptions(passes="cleanup,fuse", feeds=calib[:2],
                                                         verify_level="structure")).model
    names = [o.name for o in dense.graph.outputs]
    ref = runtime.run(runtime.make_session(dense, threads=1), held)

    def pool(out, f):
        h = out[names[0]]
        m = f["attention_mask"][..., None].astype(np.float32)
        return (h * m).sum(1) / m.sum(1)

    def emb_cos(model: ir.Model) -> tuple[float, float]:
        got = runtime.run(runtime.make_session(model, threads=1), held)
        g = np.concatenate([pool(o, f) for o, f in zip(got, held)])
        r = np.concatenate([pool(o, f) for o, f in zip(ref, held)])
        c = (g * r).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1))
        tok_cos = compare(got, ref, held).worst("cosine_min")
        return float(c.mean()), float(tok_cos)

    variants: dict[str, ir.Model] = {}
    rows = []
    ctx = PassContext(calib_feeds=calib, feeds=held[:2])
    specs = [v for k, v in MINILM_SPECS.items() if only is None or k in only]
    for pattern, s, extra in specs:
        for comp in (False, True):
            t0 = time.perf_counter()
            res = SparsifyPass(pattern=pattern, sparsity=s, compensate=comp, **extra)(dense.clone(), ctx)
            shape = f" 32x{extra['block_cols']}" if "block_cols" in extra else ""
            name = f"{pattern}{shape} {s:.0%}" + (" +comp" if comp else "")
            cos, tmin = emb_cos(res.model)
            rows.append({"variant": name, "emb_cos": round(cos, 4), "token_cos_min": round(tmin, 4),
                         "pass_seconds": round(time.perf_counter() - t0, 1)})
            variants[name] = res.model
            print(rows[-1], flush=True)
    recalls = {}
    for keep in (0.5, 0.25) if only is None or "contextual" in only else ():
        res = ContextualSparsityPass(keep=keep)(dense.clone(), ctx)
        name = f"contextual keep {keep:.0%}"
        cos, tmin = emb_cos(res.model)
        rec = next(n for n in res.notes if n.startswith("predictor recall"))
        recalls[name] = rec
        union = next(n for n in res.notes if n.startswith("measured")).split("union kept")[-1].split("|")[0].strip()
        rows.append({"variant": name, "emb_cos": round(cos, 4), "token_cos_min": round(tmin, 4), "union": union})
        variants[name] = res.model
        print(rows[-1], rec, flush=True)
    sessions = {"dense (fused)": runtime.make_session(dense, threads=1, spinning=False)}
    sessions.update({k: runtime.make_session(m, threads=1, spinning=False) for k, m in variants.items()
                     if "+comp" not in k})  # compensation changes values, not speed
    bench = bench_sessions(sessions, held[:2], rounds=rounds, warmup=1, clock="cpu")
    speed = {name: round(v, 3) for name, v in speedups(bench).items()}
    for r in rows:
        r["speedup"] = speed.get(r["variant"].replace(" +comp", ""))
    print()
    print_table(["variant", "embedding cosine (held-back)", "worst token cosine", "speed vs dense (batch 32)"],
                [[r["variant"], f"{r['emb_cos']:.4f}", f"{r['token_cos_min']:.4f}", f"{r['speedup']:.2f}x"]
                 for r in rows])
    for k, v in recalls.items():
        print(f"{k}: {v}")
    return {"minilm": rows, "recall": recalls, "rounds": rounds}


def budget_check(budget: str, n_sent: int, passes: list[str], overrides: list[str], n_unseen: int) -> dict:
    """``graphopt optimize`` (cleanup,fuse,PASS under ``budget``) then the budget on a third, unseen set."""
    import minilm as minilm_mod
    import transformers
    import workload

    from graphopt.data.metrics import compare, parse_budget
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.runtime import session as runtime

    tok = transformers.AutoTokenizer.from_pretrained(minilm_mod.source_folder())
    sentences = workload.generate(n_sent + n_unseen, seed=1)

    def batches(ss: list[str]) -> list[dict[str, np.ndarray]]:
        out = []
        for i in range(0, len(ss), 16):
            e = tok(ss[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="np")
            out.append({k: e[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")})
        return out

    given, unseen = batches(sentences[:n_sent]), batches(sentences[n_sent:])
    path = minilm_mod.build(exporter="dynamo", attn="eager")
    dense = pipeline.optimize(str(path), OptimizeOptions(passes="cleanup,fuse", feeds=given[:2],
                                                         verify_level="structure")).model
    ref = runtime.run(runtime.make_session(dense, threads=1), unseen)
    rows = []
    for name in passes:
        t0 = time.perf_counter()
        res = pipeline.optimize(str(path), OptimizeOptions(
            passes=f"cleanup,fuse,{name}", feeds=given, budget=budget, keep_going=True,
            overrides=[o for o in overrides if o.startswith(name + ".")]))
        rec = res.report.passes[-1]
        row = {"pass": name, "overrides": overrides, "status": rec.status, "modified": rec.modified, "seconds": round(time.perf_counter() - t0),
               "notes": rec.notes}
        if rec.modified and rec.status == "ok":
            got = runtime.run(runtime.make_session(res.model, threads=1), unseen)
            cmp = compare(got, ref, unseen)
            row["unseen"] = {"cosine": round(cmp.worst("cosine"), 4), "cosine_min": round(cmp.worst("cosine_min"), 4),
                             "holds": not parse_budget(budget).failures(cmp)}
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    return {"budget": budget, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bert", action="store_true")
    ap.add_argument("--minilm", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("-n", type=int, default=192, help="MiniLM sentences (half calibration, half held back)")
    ap.add_argument("--budget", help="graphopt optimize under this budget, then check it on unseen sentences")
    ap.add_argument("--unseen", type=int, default=0, help="--budget: unseen sentences (default: -n)")
    ap.add_argument("--passes", default="sparsify,contextual-sparsity", help="--budget: the passes tried")
    ap.add_argument("--override", action="append", default=[], help="--budget: PASS.OPTION=VALUE (repeatable)")
    ap.add_argument("--only", help="--minilm: these variants only (" + ",".join(MINILM_SPECS) + ",contextual)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = {}
    if args.bert:
        out.update(bert_base(args.rounds, args.batch, args.seq))
    if args.minilm:
        out.update(minilm(args.rounds, args.n, args.only.split(",") if args.only else None))
    if args.budget:
        out.update(budget_check(args.budget, args.n, args.passes.split(","), args.override, args.unseen or args.n))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Decode speed of a decoder before and after ``merge-projections``, interleaved step by step in one process.

For each ``--pair BEFORE AFTER``: both ONNX files are loaded as CPU sessions (ORT_ENABLE_ALL, ``--threads``
intra-op threads, spinning off) and prefill the same prompt. A round is one greedy run of ``--new`` tokens
(end-of-sequence ignored) per model, its decode steps interleaved with the other model's
(``graphopt.bench.harness.round_robin(by_step=True)``, order rotating every step), timed by ``--clock``
(``cpu``: the calling thread's CPU time; at 1 intra-op thread ORT computes on it). After a run each model rolls
its cache back to the prompt and decodes the same positions again. Printed: decode tokens/s (median
round), the median of the per-round speed-ups (before's time / after's), their range, the load average. The
greedy tokens of the two models must be identical (exit 3 otherwise).

``--gqa``: instead, ONNX Runtime's GroupQueryAttention (SmolLM2's shapes: 9 heads, 3 KV heads, head size 64,
rotary inside, 30 layers, batch 1, one new token over ``--past`` cached positions) fed by a ``Split`` of
the packed QKV, against the same QKV given packed (key and value omitted); outputs checked equal.

    .venv/bin/python tools/bench_merge_projections.py --pair A.onnx A.merged.onnx [--pair ...] [--rounds 7]
    .venv/bin/python tools/bench_merge_projections.py --gqa [--past 32 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

PROMPT = [504, 1296, 3003, 4683, 359]  # "The three primary colors are" (SmolLM2's tokenizer)


class _Stream:
    """One decoder's greedy decode, one step per call; after ``new`` tokens it rolls back to the prompt (the
    same tokens again: greedy is deterministic), so every round decodes the same positions."""

    def __init__(self, dec, prompt: list[int], new: int):
        from graphopt.generate.cache import KVCache

        self.dec, self.new, self.n = dec, new, len(prompt)
        self.cache = KVCache(dec.sig, 1, self.n + new)
        ids = np.array([prompt], np.int64)
        self.mask0, self.pos0 = np.ones_like(ids), np.arange(self.n, dtype=np.int64)[None]
        self.first = int(dec.step(self.cache, ids, self.mask0, self.pos0)[0].argmax())
        self.tokens = [self.first]
        self.mask, self.pos = self.mask0, self.pos0

    def __call__(self) -> None:
        if len(self.tokens) == self.new:  # roll back (a copy of the prompt's cache: the same work for both)
            self.cache.rollback(self.n)
            self.tokens, self.mask, self.pos = [self.first], self.mask0, self.pos0
        self.mask = np.concatenate([self.mask, np.ones((1, 1), np.int64)], axis=1)
        self.pos = self.pos[:, -1:] + 1
        feed = np.array([[self.tokens[-1]]], np.int64)
        self.tokens.append(int(self.dec.step(self.cache, feed, self.mask, self.pos)[0].argmax()))


def bench_pair(before: str, after: str, args) -> dict | None:
    from graphopt.bench.harness import paired_ratios, round_robin
    from graphopt.generate.loop import Decoder
    from graphopt.runtime.session import make_session

    decs = {"before": Decoder(make_session(before, threads=args.threads, spinning=False), name=before),
            "after": Decoder(make_session(after, threads=args.threads, spinning=False), name=after)}
    streams = {k: _Stream(d, PROMPT, args.new) for k, d in decs.items()}
    for s in streams.values():  # parity: the whole greedy run
        for _ in range(args.new - 1):
            s()
    if streams["before"].tokens != streams["after"].tokens:
        print(f"greedy tokens differ: {before} vs {after}", file=sys.stderr)
        return None
    steps = args.new - 1  # a round: every decode step of one greedy run, the two models interleaved step by step
    load = [os.getloadavg()[0]]
    res = {r.name: r for r in round_robin({k: [s] * steps for k, s in streams.items()}, rounds=args.rounds,
                                          warmup=1, clock=args.clock, by_step=True, items_per_round=steps)}
    load.append(os.getloadavg()[0])
    ratios = paired_ratios(res["before"], res["after"])  # before's time over after's: the speed-up
    return {"before": before, "after": after, "rounds": args.rounds, "new_tokens": args.new, "clock": args.clock,
            "load_1min": [round(x, 2) for x in (min(load), max(load))],
            "before_tok_s": res["before"].throughput, "after_tok_s": res["after"].throughput,
            "speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios)}


def _gqa_model(packed: bool, layers: int = 30, heads: int = 9, kv_heads: int = 3, d: int = 64):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    width = (heads + 2 * kv_heads) * d
    inits = [numpy_helper.from_array(rng.random((2048, d // 2)).astype(np.float32), "cos"),
             numpy_helper.from_array(rng.random((2048, d // 2)).astype(np.float32), "sin"),
             numpy_helper.from_array(np.array([heads * d, kv_heads * d, kv_heads * d], np.int64), "sizes")]
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("qkv", f32, [1, "S", width]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    nodes, outputs = [], []
    for i in range(layers):
        inputs += [helper.make_tensor_value_info(f"pk{i}", f32, [1, kv_heads, "P", d]),
                   helper.make_tensor_value_info(f"pv{i}", f32, [1, kv_heads, "P", d])]
        outputs.append(helper.make_tensor_value_info(f"o{i}", f32, None))
        qkv = ["qkv", "", ""] if packed else [f"q{i}", f"k{i}", f"v{i}"]
        if not packed:
            nodes.append(helper.make_node("Split", ["qkv", "sizes"], qkv, axis=-1))
        nodes.append(helper.make_node("GroupQueryAttention", [*qkv, f"pk{i}", f"pv{i}", "seqlens_k", "total", "cos", "sin"],
                                      [f"o{i}", f"prk{i}", f"prv{i}"], domain="com.microsoft", num_heads=heads,
                                      kv_num_heads=kv_heads, do_rotary=1))
    if packed:
        inits.pop()
    g = helper.make_graph(nodes, "gqa", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9), width


def bench_gqa(past: int, args) -> dict:
    from graphopt.bench.harness import paired_ratios, round_robin
    from graphopt.runtime.session import make_session

    models = {k: _gqa_model(k == "packed") for k in ("split", "packed")}
    width = models["split"][1]
    sessions = {k: make_session(m.SerializeToString(), threads=args.threads, spinning=False)
                for k, (m, _) in models.items()}
    rng = np.random.default_rng(1)
    feed = {"qkv": rng.standard_normal((1, 1, width)).astype(np.float32), "seqlens_k": np.array([past], np.int32),
            "total": np.array(past + 1, np.int32)}
    for i in range(30):
        for n in ("pk", "pv"):
            feed[f"{n}{i}"] = rng.standard_normal((1, 3, past, 64)).astype(np.float32)
    outs = {k: s.run(None, feed) for k, s in sessions.items()}
    diff = max(float(np.abs(a - b).max()) for a, b in zip(outs["split"], outs["packed"], strict=True))
    res = {r.name: r for r in round_robin({k: (lambda s=s: s.run(["o0"], feed)) for k, s in sessions.items()},
                                          rounds=args.rounds * 5, warmup=2, clock=args.clock)}
    return {"past": past, "max_abs_diff": diff, "split_ms": res["split"].p50 * 1e3, "packed_ms": res["packed"].p50 * 1e3,
            "split_over_packed": statistics.median(paired_ratios(res["split"], res["packed"])),
            "load_1min": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", nargs=2, action="append", metavar=("BEFORE", "AFTER"))
    ap.add_argument("--gqa", action="store_true", help="GroupQueryAttention fed by a Split vs packed QKV")
    ap.add_argument("--past", type=int, nargs="+", default=[32, 256], help="--gqa: cached positions")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new", type=int, default=32, help="new tokens per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.gqa and not args.pair:
        ap.error("give --pair BEFORE AFTER or --gqa")
    results = []
    if args.gqa:
        results = [bench_gqa(p, args) for p in args.past]
    for before, after in args.pair or []:
        row = bench_pair(before, after, args)
        if row is None:
            return 3
        results.append(row)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    for row in results:
        if "past" in row:
            print(f"GroupQueryAttention x30, past {row['past']}: Split {row['split_ms']:.3f} ms, packed "
                  f"{row['packed_ms']:.3f} ms, Split/packed {row['split_over_packed']:.3f} (max diff "
                  f"{row['max_abs_diff']:.1e}, load {row['load_1min']})")
            continue
        print(f"{row['before']} -> {row['after']}: {row['before_tok_s']:.1f} -> {row['after_tok_s']:.1f} tok/s "
              f"({row['clock']}), speed-up {row['speedup_median']:.3f} ({row['speedup_min']:.3f}-"
              f"{row['speedup_max']:.3f}; {row['rounds']} rounds of {row['new_tokens'] - 1} steps, load "
              f"{row['load_1min'][0]}-{row['load_1min'][1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

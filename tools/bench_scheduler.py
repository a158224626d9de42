#!/usr/bin/env python
"""The continuous-batching scheduler alone (no HTTP): shared prefills against one prefill per newcomer.

``--clients`` closed-loop requests are kept in one ``Scheduler`` (a finished request is replaced by the next
prompt at once), the chat prompts of ``tools/bench_serve_generate.py``, greedy, ``--max-tokens`` new tokens at
most (or EOS). Two schedulers over one ORT session take turns in ``--rounds`` (a slow spell of the shared
machine hits both alike): ``shared`` (``pad_waste`` 0.1, the default: newcomers of a step share a right-padded
forward) and ``alone`` (``pad_waste`` -1: one forward per newcomer). Per variant: generated tokens over the
engine's wall time, prompts per prefill forward, the prefills' share of the time, time to first token
(arrival in the scheduler's queue to the step that returns it) p50/p99, and the median over rounds of
the ratio shared / alone; every request's tokens are compared between the variants::

    python tools/bench_scheduler.py --model int4.onnx --clients 16 --requests 64 --max-tokens 64 --rounds 4

``--compare prefix``: the variants are ``prefix`` (the default prefix store: prompts that begin alike reuse the
stored positions) and ``no-prefix`` (``prefix_cache=0``), both with shared prefills; ``--one-client`` adds the
same two with one request in flight, for the ratio batched / one client.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _serve_bench():
    spec = importlib.util.spec_from_file_location("bench_serve_generate", REPO / "tools" / "bench_serve_generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def closed_loop(sched, prompts: list[list[int]], clients: int, max_new: int, stops) -> tuple[list, float, list]:
    """Run ``prompts`` with ``clients`` requests in flight; (tokens per prompt, seconds, seconds from each
    request's arrival to its first token)."""
    from graphopt.generate.scheduler import Sequence

    seqs = [Sequence(p, max_new, stop_ids=stops) for p in prompts]
    pending = list(reversed(seqs))
    arrived, first = {}, {}

    def add():
        seq = pending.pop()
        arrived[seq.id] = time.perf_counter()
        sched.add(seq)

    t0 = time.perf_counter()
    for _ in range(min(clients, len(pending))):
        add()
    while not sched.idle:
        events = sched.step()
        now = time.perf_counter()
        for seq, _tok, finish in events:
            first.setdefault(seq.id, now - arrived[seq.id])
            if finish is not None and pending:
                add()
    return [s.tokens for s in seqs], time.perf_counter() - t0, list(first.values())


def main(argv: list[str] | None = None) -> int:
    from graphopt.bench.harness import percentile
    from graphopt.generate import chat
    from graphopt.generate.loop import open_decoder
    from graphopt.generate.scheduler import PAD_WASTE, Scheduler

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the decoder (.onnx, tokenizer beside it)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="per variant and round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", choices=("shared", "prefix"), default="shared",
                    help="shared: shared prefills against one per newcomer; prefix: the prefix store on and off")
    ap.add_argument("--one-client", action="store_true", help="--compare prefix: also each variant at 1 client")
    args = ap.parse_args(argv)
    tok = chat.load_tokenizer(chat.tokenizer_folder(args.model))
    stops = frozenset(chat.stop_ids(tok, args.model.parent))
    texts = _serve_bench().prompts(args.model, args.requests * args.rounds, args.seed)
    ids = [chat.encode(tok, t) for t in texts]
    dec = open_decoder(args.model, threads=args.threads)
    pad = chat.pad_id(tok)
    if args.compare == "shared":
        variants = {"shared": dict(pad_waste=PAD_WASTE, prefix_cache=0), "alone": dict(pad_waste=-1.0, prefix_cache=0)}
    else:
        variants = {"prefix": {}, "no-prefix": dict(prefix_cache=0)}
    clients = {k: args.clients for k in variants}
    if args.compare == "prefix" and args.one_client:
        variants |= {"prefix-1": {}, "no-prefix-1": dict(prefix_cache=0)}
        clients |= {"prefix-1": 1, "no-prefix-1": 1}
    first_two = list(variants)[:2]
    scheds = {k: Scheduler(dec, slots=args.clients, context=512, pad_id=pad, **kw) for k, kw in variants.items()}
    made = {k: [0, 0.0] for k in variants}
    ttft: dict[str, list[float]] = {k: [] for k in variants}
    ratios, wrong = [], 0
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()}")
    for rnd in range(args.rounds):
        work = ids[rnd * args.requests:(rnd + 1) * args.requests]
        out, rate = {}, {}
        for k, sched in scheds.items():
            out[k], secs, waits = closed_loop(sched, work, clients[k], args.max_tokens, stops)
            ttft[k] += waits
            n = sum(len(t) for t in out[k])
            made[k][0] += n
            made[k][1] += secs
            rate[k] = n / secs
        a, b = first_two
        wrong += sum(len({tuple(out[k][i]) for k in variants}) > 1 for i in range(len(work)))
        ratios.append(rate[a] / rate[b])
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {r:.1f} tok/s" for k, r in rate.items()), flush=True)
    for k, s in scheds.items():
        share = s.prefill_seconds / (s.prefill_seconds + s.decode_seconds)
        total = sum(len(p) for p in ids[:args.requests * args.rounds])
        reused = (f", {s.prefixes.hits} prefix hits, {s.prefixes.reused} of {total} prompt positions reused"
                  if s.prefixes else "")
        print(f"{k}: {made[k][0] / made[k][1]:.1f} tok/s, {s.prefills / s.prefill_runs:.2f} prompts per prefill "
              f"forward, prefills {share:.1%} of the engine's time, decode {s.decode_rows / s.decode_seconds:.1f} "
              f"rows/s, TTFT p50 / p99 {percentile(ttft[k], 50) * 1e3:,.0f} / {percentile(ttft[k], 99) * 1e3:,.0f} "
              f"ms{reused}")
    if "prefix-1" in made:
        for k in ("prefix", "no-prefix"):
            print(f"{k}: {args.clients} clients / 1 client: {made[k][0] / made[k][1] / (made[k + '-1'][0] / made[k + '-1'][1]):.2f}x")
    print(f"{a} / {b}: median of rounds {statistics.median(ratios):.2f}x; requests whose tokens differ between "
          f"variants: {wrong} of {args.requests * args.rounds}; load average {os.getloadavg()}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())

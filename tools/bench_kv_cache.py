"""KV cache at long contexts: bytes per token, perplexity, peak memory and decode tokens/s of decoder graphs.

    python tools/bench_kv_cache.py A.onnx B.onnx --context 4096 --ppl-text FILE [--batch 2,8] [--report F.json]

Per model (the tokenizer beside the first model, else ``--tokenizer``):

- ``kv_bytes_per_token``: the bytes the runtime's cache buffers hold (``graphopt.generate.cache.KVCache``,
  quantized where the graph says so) per position per row, measured on the allocated arrays;
- ``ppl``: teacher-forced perplexity of the first ``--windows`` windows of ``--context`` tokens of
  ``--ppl-text``, each fed from an empty cache in chunks of ``--chunk`` tokens (every chunk attends over the
  cache as the graph holds it, quantized or not), every token but a window's first scored;
- per batch size B (``--batch``), in a fresh process each: B rows of ``context - new`` tokens of the text
  (different offsets) prefilled row by row in chunks into one batch cache of ``context`` positions (or, with
  ``--fill random``, that many positions of the cache filled with random codes / floats: the decode phase
  alone, no prefill), then ``--new`` greedy decode steps of all rows: ``peak_rss_mb`` (the process's VmHWM), ``rss_loaded_mb`` (after
  the session is made), ``rss_end_mb`` (VmRSS after the last step), ``cache_mb`` (the cache buffers in use), ``decode_tokens_per_s`` (B * new over the decode time), ``prefill_s``.

GroupQueryAttention takes several new tokens over a past only at batch 1, hence the row-by-row prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _ids(text_path: str, tokenizer: str) -> list[int]:
    from graphopt.generate import quality

    body, _ = quality.read_text(text_path)
    return quality.text_ids(body, tokenizer, None)


def _prefill(dec, cache, ids: np.ndarray, chunk: int) -> None:
    """Feed ``ids`` [1, n] into ``cache`` (batch 1) in chunks."""
    n = ids.shape[1]
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        dec.step(cache, ids[:, a:b], np.ones((1, b), np.int64), np.arange(a, b, dtype=np.int64)[None, :])


def perplexity(dec, ids: list[int], context: int, windows: int, chunk: int) -> float:
    """Teacher-forced perplexity of the first ``windows`` windows of ``context`` tokens, each from an empty cache
    fed in chunks of ``chunk`` (``quality.perplexity``)."""
    from graphopt.generate import quality

    wins = [ids[w * context:(w + 1) * context] for w in range(windows)]
    wins = [w for w in wins if len(w) == context]
    if not wins:
        raise SystemExit(f"the text has fewer than {context} tokens")
    return quality.perplexity(dec, wins, chunk)


def probe(req: dict) -> dict:
    """One model at one batch size, in this (fresh) process."""
    from graphopt.bench.rss_probe import peak_rss_mb
    from graphopt.generate.cache import new_cache
    from graphopt.generate.loop import open_decoder

    dec = open_decoder(req["model"], threads=req["threads"])
    loaded = peak_rss_mb()
    ids, context, new, batch, chunk = req["ids"], req["context"], req["new"], req["batch"], req["chunk"]
    plen = context - new
    cache = new_cache(dec.sig, batch, context)
    t0 = time.perf_counter()
    if req.get("fill") == "random" and hasattr(cache, "fill_random"):  # a KIVI-form cache
        cache.fill_random(plen, np.random.default_rng(0))
    elif req.get("fill") == "random":  # the decode phase at that context: the cache filled, no prefill run
        rng = np.random.default_rng(0)
        cache.length = plen
        for past in cache.past().values():
            if past.dtype.kind == "f":
                past[...] = rng.standard_normal(past.shape, np.float32).astype(past.dtype)
            else:
                past[...] = rng.integers(0, 256, past.shape, np.uint8).view(past.dtype)
    elif dec.sig.kivi is not None:
        raise SystemExit("a KIVI-form cache is measured with --fill random")
    else:
        row = new_cache(dec.sig, 1, context)
        for r in range(batch):
            start = (r * 997) % max(1, len(ids) - plen)
            row.reset()
            _prefill(dec, row, np.asarray(ids[start:start + plen], np.int64)[None, :], chunk)
            cache.length = plen
            for name, past in cache.past().items():
                past[r] = row.past()[name][0]
        del row
    prefill_s = time.perf_counter() - t0
    tokens = np.zeros((batch, 1), np.int64)
    t0 = time.perf_counter()
    for k in range(new):
        length = cache.length
        logits = dec.step(cache, tokens, np.ones((batch, length + 1), np.int64),
                          np.full((batch, 1), length, np.int64))
        tokens = logits.argmax(-1)[:, None].astype(np.int64)
        if k == 0:
            t0 = time.perf_counter()  # the first step warms up
    decode_s = time.perf_counter() - t0
    held = (cache.held_bytes() if hasattr(cache, "held_bytes") else
            sum(v.nbytes for v in cache.past().values())) / 2**20
    return {"batch": batch, "peak_rss_mb": round(peak_rss_mb(), 1), "rss_loaded_mb": round(loaded, 1),
            "rss_end_mb": round(_rss_mb(), 1), "cache_mb": round(held, 1),
            "decode_tokens_per_s": round(batch * (new - 1) / decode_s, 2), "prefill_s": round(prefill_s, 2)}


def _rss_mb() -> float:
    """This process's resident memory now (Linux ``VmRSS``)."""
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) / 1024 if m else 0.0


def _held_bytes_per_token(sig, length: int = 64) -> float:
    """Bytes per position per row of the cache buffers the runtime allocates for ``sig``."""
    from graphopt.generate.cache import new_cache

    c = new_cache(sig, 1, length)
    if hasattr(c, "fill_random"):  # a KIVI-form cache: what it holds at that many positions
        c.fill_random(length, np.random.default_rng(0))
        return c.held_bytes() / length
    c.length = length
    return sum(v.nbytes for v in c.past().values()) / length


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--ppl-text")
    ap.add_argument("--tokenizer")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated; empty: none")
    ap.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                    help="random: fill the batch cache with random codes / floats instead of prefilling it "
                         "(peak RSS and tokens/s of the decode phase at that context)")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--report")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe:
        print(json.dumps(probe(json.loads(Path(a.probe).read_text()))))
        return 0
    from graphopt.generate.loop import open_decoder

    tok = a.tokenizer or str(Path(a.models[0]).parent)
    if not (Path(tok) / "tokenizer.json").is_file():
        tok = None  # UTF-8 bytes as token ids (graphopt.generate.quality.text_ids)
    ids = _ids(a.ppl_text, tok)
    load = os.getloadavg()
    rows = []
    for m in a.models:
        dec = open_decoder(m, threads=a.threads)
        r = {"model": m, "kv_bytes_per_token": _held_bytes_per_token(dec.sig, a.context if dec.sig.kivi else 64),
             "kv_bits": dec.sig.kv_bits, "kivi": dec.sig.kivi and dec.sig.kivi.dumps(),
             "context": a.context}
        if not a.skip_ppl:
            t0 = time.perf_counter()
            r["ppl"] = round(perplexity(dec, ids, a.context, a.windows, a.chunk), 4)
            r["ppl_seconds"] = round(time.perf_counter() - t0, 1)
        del dec
        r["batches"] = []
        for b in (int(x) for x in a.batch.split(",") if x.strip()):
            req = Path(f"/tmp/bench_kv_cache.{os.getpid()}.json")
            req.write_text(json.dumps({"model": m, "ids": ids, "context": a.context, "new": a.new, "batch": b,
                                       "chunk": a.chunk, "threads": a.threads, "fill": a.fill}))
            p = subprocess.run([sys.executable, __file__, "--probe", str(req)], capture_output=True, text=True)
            req.unlink()
            if p.returncode:
                raise SystemExit(f"probe of {m} at batch {b} failed: {p.stderr.strip().splitlines()[-1:]}")
            r["batches"].append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps(r), flush=True)
        rows.append(r)
    doc = {"context": a.context, "text": a.ppl_text, "windows": a.windows, "chunk": a.chunk, "threads": a.threads,
           "fill": a.fill, "new": a.new,
           "loadavg_start": load, "loadavg_end": os.getloadavg(), "models": rows}
    if a.report:
        Path(a.report).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

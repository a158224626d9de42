"""``graphopt bench --generate``: render :func:`graphopt.bench.generate_bench.bench_generate` (table, JSON, report)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def run(models: list[Path], *, tokenizer: Path | None, hf: Path | None, genai: str, gguf: Path | None, context: int,
        prompt_file: Path | None, max_new_tokens: int, threads: list[int], rounds: int, warmup: int,
        ppl_text: Path | None, ppl_window: int, rss: bool, report: Path | None, json_: bool,
        speculative: str = "off", speculative_on: list[str] | None = None, pytorch: bool = True,
        draft: Path | None = None) -> None:
    from graphopt.bench.generate_bench import bench_generate
    from graphopt.bench.harness import write_json
    from graphopt.bench.peers import GENAI_PRECISIONS
    from graphopt.cli.console import make_console, table
    from graphopt.errors import UsageError

    precisions = [p for p in genai.split(",") if p] if genai not in ("", "none") else []
    bad = [p for p in precisions if p not in GENAI_PRECISIONS]
    if bad:
        raise UsageError(f"--genai: unknown precision {bad[0]!r}", hint=f"use {','.join(GENAI_PRECISIONS)} or none")
    doc = bench_generate(models, tokenizer=tokenizer, hf=hf, genai=precisions, gguf=gguf, context=context,
                         prompt_file=prompt_file, max_new_tokens=max_new_tokens, threads=threads, rounds=rounds,
                         warmup=warmup, ppl_text=ppl_text, ppl_window=ppl_window, rss=rss, speculative=speculative,
                         speculative_on=speculative_on, pytorch=pytorch, draft=draft)
    if report is not None:
        tmp = report.with_name(f".{report.name}.tmp")
        write_json(tmp, doc)
        tmp.replace(report)
    if json_:
        typer.echo(json.dumps(doc, indent=2))
        return
    console = make_console()
    for s in doc["skipped"]:
        console.print(f"skipped {s['name']}: {s['reason']}")
    right = {"justify": "right", "no_wrap": True}
    cols = [("variant", {"no_wrap": True}), ("threads", right), ("prefill ms", right), ("prefill tok/s", right),
            ("decode tok/s", right), ("peak RSS MB", right), ("KV B/token", right),
            (f"greedy = {doc['results'][0]['agreement_vs'] if doc['results'] else 'ref'}", right)]
    with_ppl = doc["ppl_text"] is not None
    if with_ppl:
        cols += [("ppl", right), ("ppl ratio", right)]
    cols.append((f"decode vs {doc['results'][0]['ratio_vs'] if doc['results'] else 'first'}", right))
    with_spec = any("accepted_per_step" in r for r in doc["results"])
    if with_spec:
        cols += [("accepted/step", right), ("speed-up", right)]
    load = ", ".join(f"{x:.2f}" for x in doc["load_average"])
    t = table(f"bench --generate: batch 1, {doc['context']} prompt + {doc['max_new_tokens']} new tokens, "
              f"{doc['rounds']} rounds (medians), load average {load}", cols)
    for r in doc["results"]:
        rate = "n/a" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}"
        cells = [r["name"], str(r["threads"]), f"{r['prefill_ms']:.1f}", f"{r['prefill_tokens_per_s']:.0f}", rate,
                 "n/a" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}", str(r["kv_bytes_per_token"] or "?"),
                 f"{r['greedy_agreement']}/{r['new_tokens']}"]
        if with_ppl:
            cells += ["n/a" if r.get("ppl") is None else f"{r['ppl']:.3f}",
                      "n/a" if r.get("ppl_ratio") is None else f"{r['ppl_ratio']:.4f}"]
        cells.append("n/a" if r.get("decode_ratio") is None else f"{r['decode_ratio']:.2f}x")
        if with_spec:
            cells += [f"{r['accepted_per_step']:.2f}" if "accepted_per_step" in r else "",
                      f"{r['speedup']:.2f}x" if r.get("speedup") else ""]
        t.add_row(*cells)
    console.print(t)

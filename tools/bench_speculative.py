"""Speculative decoding against plain decoding of the same model, per prompt, interleaved in one process.

    python tools/bench_speculative.py q4-decoder.onnx fp32-decoder.onnx --tokenizer $S --threads 1,2 \
        --rounds 2 --new 128 --speculative lookup --report spec.json
    python tools/bench_speculative.py q4-decoder.onnx --tokenizer $S --draft small-draft.onnx   # lookup, else a draft model
    python tools/bench_speculative.py fp32.onnx --tokenizer $S --draft int4.onnx --speculative off   # the draft model alone

Per thread count and model: one session and one untimed warm-up generation of each kind; per prompt
(``graphopt/bench/data/speculative_prompts.txt``: chat prompts through the chat template, raw text continuations), ``rounds``
rounds of plain and speculative generation, the order alternating round by round. Greedy, stopping at the
tokenizer's end-of-sequence ids (at most ``--new`` tokens). Per prompt: decode tokens/s of each (medians), the
speed-up (median over rounds of the round's ratio), drafted tokens accepted per verifying forward, and whether
the tokens are identical. Per prompt kind (chat / repetitive): the geometric mean of the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "graphopt" / "bench" / "data" / "speculative_prompts.txt"


def read_prompts(path: Path) -> list[dict]:
    """[{name, chat, text, kind}] from the blocks of ``path``."""
    blocks = path.read_text().split("\n----\n")[1:]
    out = []
    for b in blocks:
        head, _, text = b.strip("\n").partition("\n")
        mode, _, name = head.partition(": ")
        out.append({"name": name, "chat": mode == "chat", "text": text.rstrip("\n") + ("" if mode == "chat" else "\n"),
                    "kind": "repetitive" if name.startswith("repetitive") else "chat"})
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--only", default="", help="comma list of prompt names")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--speculative", default="lookup")
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--draft", type=Path, help="a draft decoder (.onnx, the same tokenizer) instead of --speculative")
    ap.add_argument("--report", type=Path)
    a = ap.parse_args(argv)

    from graphopt.generate import chat as tokens
    from graphopt.generate.loop import Decoder, generate
    from graphopt.generate.speculative import make_draft, speculative_generate
    from graphopt.runtime.session import make_session

    tok = tokens.load_tokenizer(a.tokenizer)
    stops = tokens.stop_ids(tok, a.tokenizer)
    prompts = read_prompts(a.prompts)
    if a.only:
        prompts = [p for p in prompts if p["name"] in a.only.split(",")]
    for p in prompts:
        p["ids"] = tokens.encode(tok, p["text"], chat=p["chat"])
    rows = []
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for threads in [int(t) for t in a.threads.split(",")]:
        for model in a.models:
            dec = Decoder(make_session(model, threads=threads, spinning=False), name=str(model))
            # made once per model (a draft model carries its acceptance across prompts); with --draft and
            # --speculative lookup: lookup where the text repeats, the model elsewhere
            draft = make_draft(a.speculative, dec, a.draft)
            for i, p in enumerate(prompts):
                def plain(p=p, dec=dec):
                    return generate(dec, p["ids"], max_new_tokens=a.new, stop_ids=stops)

                def spec(p=p, dec=dec, draft=draft):
                    return speculative_generate(dec, p["ids"], max_new_tokens=a.new, stop_ids=stops,
                                                draft=draft or a.speculative, max_draft=a.max_draft)

                if i == 0:
                    plain(), spec()  # warm-up, once per session
                runs = {"plain": [], "spec": []}
                for r in range(a.rounds):
                    order = [("plain", plain), ("spec", spec)]
                    for name, fn in order if r % 2 == 0 else order[::-1]:
                        runs[name].append(fn())
                same = all(x.token_ids == y.token_ids for x, y in zip(runs["plain"], runs["spec"]))
                ratios = [y.decode_tokens_per_s / x.decode_tokens_per_s for x, y in zip(runs["plain"], runs["spec"])
                          if x.decode_tokens_per_s and y.decode_tokens_per_s]
                s0 = runs["spec"][0]
                row = {"model": model.name, "threads": threads, "prompt": p["name"], "kind": p["kind"],
                       "prompt_tokens": len(p["ids"]), "new_tokens": len(s0.token_ids),
                       "plain_tok_s": statistics.median(x.decode_tokens_per_s or 0 for x in runs["plain"]),
                       "spec_tok_s": statistics.median(x.decode_tokens_per_s or 0 for x in runs["spec"]),
                       "speedup": statistics.median(ratios) if ratios else None,
                       "accepted_per_step": s0.accepted_per_step, "tokens_per_step": s0.tokens_per_step,
                       "drafted": s0.drafted, "accepted": s0.accepted, "steps": s0.steps, "tokens_equal": same,
                       "load": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            del dec
    summary = []
    for threads in sorted({r["threads"] for r in rows}):
        for model in dict.fromkeys(r["model"] for r in rows):
            for kind in ("chat", "repetitive"):
                sel = [r for r in rows if (r["threads"], r["model"], r["kind"]) == (threads, model, kind)
                       and r["speedup"]]
                if sel:
                    gm = statistics.geometric_mean([r["speedup"] for r in sel])
                    summary.append({"model": model, "threads": threads, "kind": kind, "prompts": len(sel),
                                    "speedup_geomean": gm, "all_tokens_equal": all(r["tokens_equal"] for r in sel),
                                    "accepted_per_step_mean": statistics.mean(r["accepted_per_step"] for r in sel)})
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary[-1].items()}),
                          flush=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    if a.report:
        a.report.write_text(json.dumps({"rows": rows, "summary": summary, "speculative": a.speculative,
                                        "draft": str(a.draft) if a.draft else None,
                                        "rounds": a.rounds, "new": a.new}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

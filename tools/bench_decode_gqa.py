"""Decode speed of a decoder before and after ``group-query-attention``, interleaved; greedy identity.

    .venv/bin/python tools/bench_decode_gqa.py --model NAME=PATH [--model NAME=PATH ...] --tokenizer DIR \
        [--rounds 5] [--new 64] [--batch 8] [--eos ID] [--torch HF_DIR --torch-new 128] [--json OUT]

Every model runs greedy ``graphopt.generate`` (1 intra-op thread, spinning off, EOS ignored) on the same
prompts (``--eos`` ids never chosen), round-robin (``graphopt.bench.harness.rotation``): per round each model generates ``--new`` tokens
for each prompt alone, then for a batch of ``--batch`` prompts of mixed lengths (GroupQueryAttention graphs:
one right-padded run; others: one run per prompt length). Reported: the median decode tokens/s (new tokens
after the first over the time from the first to the last; a batch counts every row's tokens), the ratio to
the first model, whether every model's tokens equal the first's (alone and batched), and, with ``--torch``,
whether each model's greedy tokens equal transformers' fp32 ``generate`` on the Hugging Face folder.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from graphopt.bench.harness import median, print_table, rotation
from graphopt.generate.loop import generate, open_decoder
from graphopt.generate.sampling import Sampling
from graphopt.runtime.session import make_session

TEXTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind that carries ships home.",
    "def fibonacci(n):",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to",
    "Once upon a time",
    "List three reasons why regular exercise is good for your health:",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "In 1969, the first humans landed on the Moon. The mission was called",
]


def _torch_greedy(folder: str, prompt: list[int], new: int) -> list[int]:
    import torch
    import transformers

    model = _torch_greedy.cache.get(folder)
    if model is None:
        model = _torch_greedy.cache[folder] = transformers.AutoModelForCausalLM.from_pretrained(
            folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_torch_greedy.cache = {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH (the first is the baseline)")
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3, help="prompts timed alone per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--torch", help="Hugging Face folder: check greedy identity with transformers fp32")
    ap.add_argument("--torch-new", type=int, default=128)
    ap.add_argument("--eos", type=int, action="append", default=[],
                    help="token id never chosen (as --ignore-eos; transformers' min_new_tokens does the same)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in TEXTS]
    batch = prompts[: args.batch]
    models = dict(m.split("=", 1) for m in args.model)
    decs = {n: open_decoder(make_session(p, threads=1, spinning=False)) for n, p in models.items()}
    names = list(decs)
    alone = {n: [] for n in names}
    batched = {n: [] for n in names}
    tokens: dict[str, dict] = {n: {} for n in names}
    greedy = Sampling().masking(args.eos)
    gen = dict(max_new_tokens=args.new, sampling=greedy)
    for name in names:  # warm-up
        generate(decs[name], prompts[0], max_new_tokens=4)
    for r in range(args.rounds):
        for name in rotation(names, r):
            for i, p in enumerate(prompts[: args.prompts]):
                g = generate(decs[name], p, **gen)
                alone[name].append(g.decode_tokens_per_s)
                tokens[name][i] = g.token_ids
            g = generate(decs[name], batch, **gen)
            batched[name].append(g.decode_tokens_per_s)
            tokens[name]["batch"] = g.token_ids
    base = names[0]
    rows, doc = [], {"rounds": args.rounds, "new_tokens": args.new, "batch": len(batch),
                     "batch_lengths": [len(p) for p in batch], "load_average": os.getloadavg(), "models": {}}
    for n in names:
        a, b = median(alone[n]), median(batched[n])
        same = all(tokens[n][k] == tokens[base][k] for k in tokens[base])
        batch_alone = all(tokens[n]["batch"][i] == tokens[n][i] for i in range(min(args.prompts, len(batch))))
        rows.append([n, f"{a:.1f}", f"{a / median(alone[base]):.2f}x", f"{b:.1f}", f"{b / a:.2f}x",
                     "yes" if same else "NO", "yes" if batch_alone else "NO"])
        doc["models"][n] = {"path": models[n], "decode_tok_s_batch1": a, "decode_tok_s_batch": b,
                            "shared_buffer": decs[n].sig.shared_buffer, "tokens_equal_baseline": same,
                            "batch_rows_equal_alone": batch_alone}
    print_table(["model", "decode tok/s (b=1)", f"vs {base}", f"aggregate tok/s (b={len(batch)})", "vs b=1",
                 "tokens = baseline", "batch rows = alone"], rows)
    if args.torch:
        for n in names:
            ok = [generate(decs[n], p, max_new_tokens=args.torch_new, sampling=greedy).token_ids == _torch_greedy(
                args.torch, p, args.torch_new) for p in prompts[: args.prompts]]
            doc["models"][n]["torch_greedy_equal"] = ok
            print(f"{n}: greedy {args.torch_new} tokens = transformers fp32: {ok}")
    print(f"load average {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

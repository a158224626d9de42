#!/usr/bin/env python
"""Greedy tokens of graphopt decoders against transformers' fp32 ``generate``, on prompts nobody tuned on.

    python tools/check_greedy_torch.py --hf HF_DIR --tokenizer DIR MODEL.onnx [MODEL.onnx ...] \
        [--prompts 20] [--prompt-tokens 32] [--new 128] [--text FILE] [--draft DRAFT.onnx] [--speculative MODE]

Prompts are consecutive slices of ``--text`` (default: the bundled held-out text of ``bench --generate``). Both
sides mask the end-of-sequence token, so every prompt yields exactly ``--new`` tokens (transformers:
``min_new_tokens``). Prints, per model, how many prompts give identical tokens and the shortest common prefix;
exits 1 when any prompt differs. ``--draft``: each model decodes speculatively with that draft decoder
(``--speculative lookup``: prompt lookup first, the draft elsewhere), checked the same way; ``--speculative MODE``
alone: with that draft mode (``auto``: the model's ``NAME.draft.onnx`` beside it, else its own drafts or lookup).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphopt.bench.perplexity import DEFAULT_TEXT
from graphopt.generate.loop import generate, open_decoder
from graphopt.generate.sampling import Sampling
from graphopt.generate.speculative import make_draft, speculative_generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--draft", help="a draft decoder: speculative decoding with it")
    ap.add_argument("--speculative", default="off",
                    help="a draft mode (auto, heads, layer-skip, lookup); with --draft: off (the draft alone) or lookup")
    args = ap.parse_args(argv)

    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    ids = tok(Path(args.text).read_text())["input_ids"]
    n = args.prompt_tokens
    prompts = [ids[i * n:(i + 1) * n] for i in range(args.prompts)]
    if len(prompts[-1]) < n:
        print(f"the text holds {len(ids)} tokens: too few for {args.prompts} prompts of {n}", file=sys.stderr)
        return 2
    eos = tok.eos_token_id
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = ref_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    del ref_model
    greedy = Sampling(masked=frozenset({eos})) if eos is not None else Sampling()
    bad = False
    for path in args.models:
        dec = open_decoder(path, threads=1)
        draft = make_draft(args.speculative, dec, args.draft) if args.draft or args.speculative != "off" else None
        prefixes = []
        for p, ref in zip(prompts, refs):
            if draft is not None:
                got = speculative_generate(dec, p, max_new_tokens=args.new, sampling=greedy, draft=draft).token_ids
            else:
                got = generate(dec, p, max_new_tokens=args.new, sampling=greedy).token_ids
            prefixes.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref))))
        same = sum(x == args.new for x in prefixes)
        bad |= same != len(prompts)
        how = f" (speculative, {draft.name})" if draft is not None else ""
        print(f"{path}{how}: {same}/{len(prompts)} prompts x {args.new} tokens identical to transformers fp32; "
              f"shortest common prefix {min(prefixes)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

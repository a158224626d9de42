"""Does a decoder compute a token's logits the same in a one-token step and in a step of several tokens?

Speculative decoding checks drafted tokens in one forward of several positions; its greedy tokens are plain
decoding's only where that forward computes each position as a one-token step would. This prefills a random
prompt, then from the same cache runs the next 1, 2, 3, 5 and 8 tokens in one forward each and reports, per
decoder: the largest logit difference of the first new position between the one-token forward and the longer
ones, whether the longer forwards agree bitwise with each other on the positions they share, and whether the
argmax of the first position moved.

With ``--text FILE --tokenizer DIR`` it also scores windows of the text both ways: perplexity from one forward
per window (how ``bench --generate`` and the budgets measure it) and from one-token steps (what plain decoding
computes), and how often the two ways' top-1 tokens agree.

    python tools/check_multirow.py fp32-decoder.onnx q4-final.onnx int4.onnx \
        --text graphopt/bench/data/heldout.txt --tokenizer ~/.cache/graphopt/models/smollm2-135m
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LENGTHS = (1, 2, 3, 5, 8)


def check(path: Path, *, threads: int, prompt: int, seed: int) -> dict:
    from graphopt.generate.cache import new_cache
    from graphopt.generate.loop import open_decoder

    dec = open_decoder(path, threads=threads)
    rng = np.random.default_rng(seed)
    ids = rng.integers(100, min(40_000, dec.sig.vocab or 40_000), size=(1, prompt + max(LENGTHS)))
    cache = new_cache(dec.sig, 1, prompt + max(LENGTHS) + 1)
    dec.step(cache, ids[:, :prompt], np.ones((1, prompt), np.int64), np.arange(prompt)[None])
    rows = {}
    for k in LENGTHS:
        cache.rollback(prompt)
        rows[k] = dec.step(cache, ids[:, prompt:prompt + k], np.ones((1, prompt + k), np.int64),
                           np.arange(prompt, prompt + k)[None], all_positions=True)[0]
    one = rows[1][0]
    longest = rows[max(LENGTHS)]
    return {
        "one_vs_several_max_abs": max(float(np.abs(rows[k][0] - one).max()) for k in LENGTHS[1:]),
        "several_bitwise_equal": all(np.array_equal(rows[k], longest[:k]) for k in LENGTHS[1:]),
        "argmax_moved": any(int(rows[k][0].argmax()) != int(one.argmax()) for k in LENGTHS[1:]),
    }


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def score(path: Path, ids: list[int], *, window: int, windows: int, threads: int) -> dict:
    """Perplexity of ``windows`` windows of ``ids`` from one forward each and from one-token steps."""
    from graphopt.generate.cache import new_cache
    from graphopt.generate.loop import open_decoder

    dec = open_decoder(path, threads=threads)
    nll_window = nll_steps = 0.0
    n = agree = 0
    for start in range(0, min(len(ids) - window + 1, windows * window), window):
        w = np.asarray(ids[start:start + window], np.int64)[None]
        cache = new_cache(dec.sig, 1, window + 1)
        whole = dec.step(cache, w, np.ones((1, window), np.int64), np.arange(window)[None], all_positions=True)[0]
        cache = new_cache(dec.sig, 1, window + 1)
        steps = np.stack([dec.step(cache, w[:, t:t + 1], np.ones((1, t + 1), np.int64), np.array([[t]]))[0]
                          for t in range(window - 1)])
        target = w[0, 1:]
        rows = np.arange(window - 1)
        nll_window -= _log_softmax(whole[:-1])[rows, target].sum()
        nll_steps -= _log_softmax(steps)[rows, target].sum()
        agree += int((steps.argmax(-1) == whole[:-1].argmax(-1)).sum())
        n += window - 1
    return {"ppl_window": float(np.exp(nll_window / n)), "ppl_steps": float(np.exp(nll_steps / n)),
            "top1_agree": agree, "positions": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("decoders", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens prefilled first")
    ap.add_argument("--seeds", type=int, default=3, help="random prompts per decoder")
    ap.add_argument("--text", type=Path, help="also score this text both ways (needs --tokenizer)")
    ap.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--windows", type=int, default=8)
    args = ap.parse_args()
    if args.text is not None and args.tokenizer is None:
        ap.error("--text needs --tokenizer")
    print("| decoder | seed | max abs logit diff, 1 token vs 2-8 | 2-8 token forwards bitwise equal | argmax moved |")
    print("|---|---:|---:|---|---|")
    for path in args.decoders:
        for seed in range(args.seeds):
            r = check(path, threads=args.threads, prompt=args.prompt, seed=seed)
            print(f"| {path.name} | {seed} | {r['one_vs_several_max_abs']:.3g} | {r['several_bitwise_equal']} "
                  f"| {r['argmax_moved']} |", flush=True)
    if args.text is None:
        return
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).encode(args.text.read_text()).ids
    print(f"\n| decoder | ppl, a forward per window | ppl, one-token steps | top-1 agreement |")
    print("|---|---:|---:|---:|")
    for path in args.decoders:
        r = score(path, ids, window=args.window, windows=args.windows, threads=args.threads)
        print(f"| {path.name} | {r['ppl_window']:.3f} | {r['ppl_steps']:.3f} | {r['top1_agree']}/{r['positions']} |",
              flush=True)


if __name__ == "__main__":
    main()

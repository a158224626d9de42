#!/usr/bin/env python
"""MiniLM with a *trained* sentiment head, as a Hugging Face folder and as ONNX.

The data: a tiny binary sentiment set written from templates in this file (``dataset()``): product /
service / media subjects ("the service", "this movie", ...) with positive or negative adjectives and
verbs in ten sentence templates; 320 labelled sentences, split 75/25 with a fixed seed. It is easy on
purpose: the point is a classifier whose logits mean something (held-out accuracy is reported),
not a benchmark.

The model: all-MiniLM-L6-v2 (frozen) + its pooler + a logistic head (``BertForSequenceClassification``
with 2 labels, ``negative``/``positive``) trained on the pooled outputs with full-batch L-BFGS on CPU
(seconds). Saved as the HF folder ``minilm-sentiment`` (weights, config, tokenizer and
``graphopt_head.json`` with the data description and accuracies) and exported, parity-gated, to
``minilm-sentiment-<exporter>-<attn>.onnx`` in ``$GRAPHOPT_CACHE`` (default ``~/.cache/graphopt/models``).

Usage::

    python models/minilm_classifier.py [-o OUT.onnx] [--exporter dynamo|torchscript] [--attn eager|sdpa]
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _build  # noqa: E402
import minilm  # noqa: E402

logger = logging.getLogger(__name__)

SEED = 0
LABELS = ["negative", "positive"]
SUBJECTS = ["the food", "the service", "this movie", "the hotel room", "the staff", "my new phone",
            "the concert", "this book", "the delivery", "the app"]
ADJ = {1: ["excellent", "wonderful", "delightful", "great", "fantastic", "lovely", "superb", "pleasant"],
       0: ["terrible", "awful", "disappointing", "horrible", "dreadful", "poor", "boring", "useless"]}
VERB = {1: ["loved", "enjoyed", "liked", "adored"], 0: ["hated", "regretted", "disliked", "resented"]}
REC = {1: "would happily recommend", 0: "would never recommend"}
TEMPLATES = [
    "{S} was {A}.",
    "I thought {s} was really {A}.",
    "Honestly, {s} is {A} and I {R} it.",
    "I {V} {s}.",
    "We {V} {s}, it was {A}.",
    "{S} turned out to be {A}.",
    "What a {A} experience, {s} was {A}!",
    "After a week I can say {s} is {A}.",
    "My friends {V} {s} too.",
    "Overall {s} felt {A}.",
]
#: sentences per label
PER_LABEL = 160


def dataset(seed: int = SEED, per_label: int = PER_LABEL) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(train, test) lists of (sentence, label), deterministic by ``seed``.

    ``per_label`` up to 800 (every template x subject x adjective) draws more sentences from the same
    templates (early-exit calibration and held-back evaluation); the head was trained on the default.
    """
    rng = random.Random(seed)
    items = []
    for label in (0, 1):
        combos = list(itertools.product(TEMPLATES, SUBJECTS, range(len(ADJ[label]))))
        rng.shuffle(combos)
        for tmpl, subj, k in combos[:per_label]:
            text = tmpl.format(S=subj[0].upper() + subj[1:], s=subj, A=ADJ[label][k], R=REC[label],
                               V=VERB[label][k % len(VERB[label])])
            items.append((text, label))
    rng.shuffle(items)
    cut = len(items) * 3 // 4
    return items[:cut], items[cut:]


def _pooled(model, tokenizer, texts: list[str]):
    import torch

    outs = []
    with torch.no_grad():
        for i in range(0, len(texts), 64):
            enc = tokenizer(texts[i : i + 64], padding=True, return_tensors="pt")
            outs.append(model(**enc).pooler_output)
    return torch.cat(outs)


def train_folder(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The HF folder of MiniLM + trained sentiment head (built when missing or ``force``)."""
    _build.offline()
    dst = _build.cache_dir(cache_dir) / "minilm-sentiment"
    if (dst / "config.json").is_file() and not force:
        return dst

    def write(tmp: Path) -> None:
        import torch
        import transformers

        tok, encoder = minilm.load_source()
        train, test = dataset()
        x_train, x_test = _pooled(encoder, tok, [t for t, _ in train]), _pooled(encoder, tok, [t for t, _ in test])
        y_train, y_test = torch.tensor([y for _, y in train]), torch.tensor([y for _, y in test])
        w, b = _build.fit_linear_head(x_train, y_train, len(LABELS), SEED)
        with torch.no_grad():
            acc_train = float(((x_train @ w.T + b).argmax(1) == y_train).float().mean())
            acc_test = float(((x_test @ w.T + b).argmax(1) == y_test).float().mean())
        model = transformers.BertForSequenceClassification.from_pretrained(
            minilm.source_folder(), num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={v: k for k, v in enumerate(LABELS)}
        ).eval()
        with torch.no_grad():
            model.classifier.weight.copy_(w)
            model.classifier.bias.copy_(b)
        model.config._attn_implementation = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        info = {
            "data": "templated binary sentiment (models/minilm_classifier.py: dataset())",
            "labels": LABELS, "train": len(train), "test": len(test), "seed": SEED,
            "train_accuracy": acc_train, "test_accuracy": acc_test,
            "head": "logistic regression on the frozen MiniLM pooler output (L-BFGS, L2 1e-3)",
        }
        (tmp / "graphopt_head.json").write_text(json.dumps(info, indent=2) + "\n")
        logger.info("sentiment head: train accuracy %.3f, test accuracy %.3f", acc_train, acc_test)

    return _build.place_dir(write, dst)


def build(exporter: str = "dynamo", attn: str = "sdpa", cache_dir: str | os.PathLike | None = None,
          force: bool = False) -> Path:
    """The cached ONNX export (task sequence-classification; output ``logits`` [batch, 2])."""
    folder = train_folder(cache_dir, force)
    return _build.export_cached(folder, f"minilm-sentiment-{exporter}-{attn}", task="sequence-classification",
                                exporter=exporter, attn=attn, cache=cache_dir, force=force)


def main(argv: list[str] | None = None) -> int:
    ap = _build.parser(__doc__)
    ap.add_argument("-o", "--output", type=Path)
    ap.add_argument("--exporter", choices=minilm.EXPORTERS, default="dynamo")
    ap.add_argument("--attn", choices=minilm.ATTNS, default="sdpa")
    args = _build.parse_args(ap, argv)
    def body() -> int:
        path = build(args.exporter, args.attn, args.cache_dir, args.force)
        info = json.loads((train_folder(args.cache_dir) / "graphopt_head.json").read_text())
        print(f"sentiment head: test accuracy {info['test_accuracy']:.3f} on {info['test']} held-out sentences",
              file=sys.stderr)
        if args.output:
            path = _build.place_file(path, args.output)
        print(path)
        return 0

    return _build.run_main(body)


if __name__ == "__main__":
    sys.exit(main())

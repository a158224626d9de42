#!/usr/bin/env python
"""Seeded, randomly initialised tiny transformers, saved as HF folders and exported to ONNX.

Families (built from transformers config classes, seed 0, no downloads):

- ``bert``: BERT-like encoder, hidden 64, 2 layers, 4 heads, vocab 1000;
  tasks feature-extraction, sequence-classification (3 labels), token-classification (5), masked-lm.
- ``gpt2``: GPT-2-like decoder, hidden 64, 2 layers, 4 heads, vocab 1000; tasks causal-lm, causal-lm-with-past.
- ``llama``: Llama-like decoder (RMSNorm, RoPE, GQA: 4 query / 2 key-value heads), hidden 64, 2 layers,
  vocab 1000; tasks causal-lm, causal-lm-with-past.

The weights are random but reproducible: one HF folder per (family, head) named
``tiny-<family>-<head>`` (e.g. ``tiny-bert-masked-lm``), ONNX files ``tiny-<family>-<task>-<exporter>.onnx``,
all in ``$GRAPHOPT_CACHE`` (default ``~/.cache/graphopt/models``).

Usage::

    python models/tiny.py --family llama --task causal-lm-with-past [-o OUT.onnx] [--exporter torchscript]
    python models/tiny.py --all          # every family and task
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _build  # noqa: E402

SEED = 0
VOCAB = 1000

FAMILIES: dict[str, list[str]] = {
    "bert": ["feature-extraction", "sequence-classification", "token-classification", "masked-lm"],
    "gpt2": ["causal-lm", "causal-lm-with-past"],
    "llama": ["causal-lm", "causal-lm-with-past"],
}


def make_config(family: str):
    """The transformers config of a tiny family."""
    import transformers

    if family == "bert":
        return transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=128, type_vocab_size=2, num_labels=3,
        )
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=128,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    if family == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        )
    raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")


def _head(family: str, task: str) -> str:
    """Folder suffix: causal-lm with and without past share one set of weights."""
    return "causal-lm" if task.startswith("causal-lm") else task


def build_folder(family: str, task: str, cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The HF folder (config.json + model.safetensors) of ``family`` with the head ``task`` needs."""
    import transformers

    from graphopt.exporters.tasks import get_task

    if task not in FAMILIES.get(family, []):
        raise ValueError(f"{family}: no task {task!r}; tasks: {FAMILIES.get(family)}")
    _build.offline()
    dst = _build.cache_dir(cache_dir) / f"tiny-{family}-{_head(family, task)}"
    if (dst / "config.json").is_file() and not force:
        return dst
    if family == "bert" and task == "token-classification":
        config = make_config(family)
        config.num_labels = 5
    else:
        config = make_config(family)
    return _build.place_random_model(getattr(transformers, get_task(task).auto_class), config, dst, SEED)


def build(family: str, task: str, exporter: str = "dynamo", cache_dir: str | os.PathLike | None = None,
          force: bool = False, attn: str | None = None) -> Path:
    """The cached ONNX export of a tiny model (parity-gated through ``graphopt.exporters.export``)."""
    folder = build_folder(family, task, cache_dir, force)
    name = f"tiny-{family}-{task}-{exporter}" + (f"-{attn}" if attn else "")
    return _build.export_cached(folder, name, task=task, exporter=exporter, attn=attn, cache=cache_dir, force=force)


def main(argv: list[str] | None = None) -> int:
    ap = _build.parser(__doc__)
    ap.add_argument("--family", choices=list(FAMILIES), default="bert")
    ap.add_argument("--task", default=None, help="default: the family's first task")
    ap.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo")
    ap.add_argument("-o", "--output", type=Path)
    ap.add_argument("--all", action="store_true", help="every family and task")
    args = _build.parse_args(ap, argv)
    def body() -> int:
        if args.all:
            for fam, tasks in FAMILIES.items():
                for t in tasks:
                    print(build(fam, t, args.exporter, args.cache_dir, args.force))
            return 0
        path = build(args.family, args.task or FAMILIES[args.family][0], args.exporter, args.cache_dir, args.force)
        if args.output:
            path = _build.place_file(path, args.output)
        print(path)
        return 0

    return _build.run_main(body)


if __name__ == "__main__":
    sys.exit(main())

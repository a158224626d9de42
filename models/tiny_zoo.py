#!/usr/bin/env python
"""More seeded tiny transformers (beyond models/tiny.py), one per architecture trait that fusion must handle.

Each family is a randomly initialised transformers model (seed 0, hidden 64, 2 layers, 4 heads, vocab
1000; nothing downloaded), exported once with the dynamo exporter (parity-gated) and cached in
``$GRAPHOPT_CACHE`` (default ``~/.cache/graphopt/models``) as ``tiny-<family>-<task>-dynamo.onnx``:

============  ====================  ==============================================================
family        task                  what it brings
============  ====================  ==============================================================
roberta       feature-extraction    encoder, padding-offset learned positions
distilbert    feature-extraction    encoder without token types, own attention/FFN layout
albert        feature-extraction    encoder, factorised embeddings (32 -> 64), shared layers, gelu_new
electra       feature-extraction    encoder, factorised embeddings
qwen2         causal-lm-with-past   RMSNorm, RoPE, GQA (4/2 heads), q/k/v bias, tied embeddings
qwen3         causal-lm-with-past   Qwen2 plus per-head q/k RMSNorm
mistral       causal-lm-with-past   RMSNorm, RoPE, GQA
gemma         causal-lm-with-past   (1 + w) RMSNorm, MQA (1 kv head), tanh GELU, scaled and tied embeddings
phi           causal-lm-with-past   LayerNorm, partial rotary (half), parallel attention/MLP
phi3          causal-lm-with-past   RMSNorm, fused QKV and gate/up projections, partial rotary
gpt_neox      causal-lm-with-past   parallel residual, partial rotary (quarter), fused QKV
stablelm      causal-lm-with-past   LayerNorm, partial rotary (quarter), GQA
falcon        causal-lm-with-past   new decoder architecture: GQA, parallel attention/MLP, RoPE
opt           causal-lm-with-past   learned positions with offset 2, ReLU, tied embeddings
bloom         causal-lm-with-past   ALiBi position bias, embedding LayerNorm, fused QKV
============  ====================  ==============================================================

The families of models/tiny.py (bert, gpt2, llama) are built there. Usage::

    python models/tiny_zoo.py --family phi      # prints the cached ONNX path
    python models/tiny_zoo.py --all
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _build  # noqa: E402

logger = logging.getLogger(__name__)

SEED = 0
VOCAB = 1000
ENCODER, DECODER = "feature-extraction", "causal-lm-with-past"

#: family -> (transformers config class, keyword arguments, export task)
FAMILIES: dict[str, tuple[str, dict, str]] = {
    "roberta": ("RobertaConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=130), ENCODER),
    "distilbert": ("DistilBertConfig", dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                            max_position_embeddings=128), ENCODER),
    "albert": ("AlbertConfig", dict(embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, max_position_embeddings=128), ENCODER),
    "electra": ("ElectraConfig", dict(embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=128), ENCODER),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True), DECODER),
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128), DECODER),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                      sliding_window=None), DECODER),
    "gemma": ("GemmaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=16, max_position_embeddings=128), DECODER),
    "phi": ("PhiConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              partial_rotary_factor=0.5, max_position_embeddings=128), DECODER),
    "phi3": ("Phi3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128, partial_rotary_factor=0.5,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2), DECODER),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=128,
                                       use_parallel_residual=True), DECODER),
    "stablelm": ("StableLmConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.25,
                                        max_position_embeddings=128), DECODER),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    new_decoder_architecture=True, num_kv_heads=2, alibi=False, bias=False), DECODER),
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=128, word_embed_proj_dim=64), DECODER),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4), DECODER),
}


def make_config(family: str):
    """The transformers config of a zoo family."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
    cls, kwargs, _ = FAMILIES[family]
    return getattr(transformers, cls)(vocab_size=VOCAB, **kwargs)


def task_of(family: str) -> str:
    """The export task of a zoo family."""
    return FAMILIES[family][2]


def build_folder(family: str, cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The HF folder (config.json + model.safetensors) of ``family``."""
    import transformers

    from graphopt.exporters.tasks import get_task

    config = make_config(family)
    task = task_of(family)
    _build.offline()
    dst = _build.cache_dir(cache_dir) / f"tiny-{family}-{'causal-lm' if task == DECODER else task}"
    if (dst / "config.json").is_file() and not force:
        return dst
    return _build.place_random_model(getattr(transformers, get_task(task).auto_class), config, dst, SEED)


def build(family: str, exporter: str = "dynamo", cache_dir: str | os.PathLike | None = None,
          force: bool = False) -> Path:
    """The cached ONNX export of a zoo family (parity-gated through ``graphopt.exporters.export``)."""
    folder = build_folder(family, cache_dir, force)
    name = f"tiny-{family}-{task_of(family)}-{exporter}"
    return _build.export_cached(folder, name, task=task_of(family), exporter=exporter, cache=cache_dir, force=force)


def main(argv: list[str] | None = None) -> int:
    ap = _build.parser(__doc__)
    ap.add_argument("--family", choices=list(FAMILIES), default="qwen2")
    ap.add_argument("--all", action="store_true", help="every family")
    ap.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo")
    args = _build.parse_args(ap, argv)

    def body() -> int:
        for fam in FAMILIES if args.all else [args.family]:
            print(build(fam, args.exporter, args.cache_dir, args.force))
        return 0

    return _build.run_main(body)


if __name__ == "__main__":
    sys.exit(main())

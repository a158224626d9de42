"""Text in and out: the tokenizer beside a model, its chat template, its stop tokens and maximum length.

A model folder as Hugging Face writes it holds the tokenizer (``tokenizer.json`` / ``tokenizer_config.json`` /
vocabulary files), ``config.json`` (``max_position_embeddings``, ``n_positions``) and ``generation_config.json``
(``eos_token_id``: one id or a list). ``graphopt export`` writes only the ``.onnx``, so these are looked up
beside the ``.onnx`` or in the folder given (``--tokenizer DIR``, e.g. the Hugging Face folder exported).
transformers loads inside the functions.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from graphopt.errors import UsageError, first_line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
#: what a decoder's text settings come in: the tokenizer, its chat template, generation and model configs
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json", "config.json")
#: ``model_max_length`` above this is transformers' "no limit" sentinel, not a length
_NO_LIMIT = 10**9


def tokenizer_folder(model: str | Path, tokenizer: str | Path | None = None) -> Path:
    """The folder holding the tokenizer: ``tokenizer`` when given, else the model's folder; UsageError when
    it has no tokenizer files."""
    folder = Path(tokenizer) if tokenizer is not None else Path(model).parent
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such tokenizer folder", hint="pass --tokenizer DIR (the Hugging Face folder)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        where = "given" if tokenizer is not None else f"beside {Path(model).name}"
        raise UsageError(f"{folder}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}) in the folder {where}",
                         hint="pass --tokenizer DIR (the Hugging Face folder the model was exported from)")
    return folder


def copy_companions(src_folder: str | Path, dst_folder: str | Path) -> list[str]:
    """Copy ``COMPANION_FILES`` of ``src_folder`` that ``dst_folder`` lacks (an existing file is never
    replaced), each through a temporary name and a rename; the names copied. Nothing when the folders are the
    same or ``src_folder`` holds no tokenizer."""
    src, dst = Path(src_folder), Path(dst_folder)
    if not dst.is_dir() or src.resolve() == dst.resolve() or not any((src / f).is_file() for f in TOKENIZER_FILES):
        return []
    copied = []
    for name in COMPANION_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            tmp = dst / f".{name}.{os.getpid()}.tmp"
            try:
                shutil.copy2(src / name, tmp)
                os.replace(tmp, dst / name)
            finally:
                tmp.unlink(missing_ok=True)
            copied.append(name)
    return copied


def load_tokenizer(folder: str | Path):
    """The transformers tokenizer saved in ``folder``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:

        raise UsageError(f"{folder}: the tokenizer does not load: {type(e).__name__}: {first_line(e)}") from e


def encode(tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text``; with ``chat``, of one user message through the tokenizer's chat template and its
    generation prompt (the template writes its own special tokens, so none are added)."""
    if not chat:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("the tokenizer has no chat template", hint="drop --chat to use the prompt as it is")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_ids(tokenizer, *folders: str | Path) -> list[int]:
    """End-of-sequence ids: the generation config's ``eos_token_id`` (first folder that has one) and the
    tokenizer's eos token."""
    ids: list[int] = []
    for f in folders:
        gen = _json(Path(f) / "generation_config.json")
        if "eos_token_id" in gen:
            ids += _ids(gen["eos_token_id"])
            break
    else:
        for f in folders:
            cfg = _json(Path(f) / "config.json")
            if "eos_token_id" in cfg:
                ids += _ids(cfg["eos_token_id"])
                break
    ids += _ids(getattr(tokenizer, "eos_token_id", None))
    return sorted(set(ids))


def pad_id(tokenizer, default: int = 0) -> int:
    """The tokenizer's pad id, else its eos id, else ``default``."""
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            return v
    return default


def max_positions(tokenizer, *folders: str | Path) -> int | None:
    """The model's maximum positions: ``config.json`` (``max_position_embeddings``, ``n_positions``,
    ``n_ctx``) in the first folder that has one, else the tokenizer's ``model_max_length``; None when unknown."""
    for f in folders:
        cfg = _json(Path(f) / "config.json")
        for key in ("max_position_embeddings", "n_positions", "n_ctx"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < _NO_LIMIT else None

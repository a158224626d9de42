"""Calibration and held-out prompts of the passes that fit a draft to a decoder's own greedy text.

With a tokenizer (a folder with ``tokenizer.json``, or the file): windows of ``text`` (a file; default the
decoder-budget calibration text ``graphopt.data.heldout``) for fitting, and of ``heldout`` (default
``graphopt/bench/data/heldout.txt``, never fitted on) for measuring. Without one: seeded random token prompts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from graphopt.data.heldout import TEXT as CALIB_TEXT
from graphopt.errors import UsageError

HELDOUT = Path(__file__).resolve().parents[2] / "graphopt" / "bench" / "data" / "heldout.txt"


def windows(text: str, tokenizer, length: int, count: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens spread over ``text``."""
    ids = tokenizer.encode(text).ids
    stride = max(length, (len(ids) - length) // max(count, 1))
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, stride)][:count]


def prompt_sets(pass_name: str, *, tokenizer: str, text: str, heldout: str, vocab: int, length: int,
                count: int, seed: int) -> tuple[list[list[int]], list[list[int]], str]:
    """(calibration prompts, held-out prompts, what they are)."""
    held_count = max(8, count // 2)
    if tokenizer:
        from tokenizers import Tokenizer

        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise UsageError(f"{pass_name}: {path}: no tokenizer.json", hint="tokenizer=FOLDER")
        tok = Tokenizer.from_file(str(path))
        calib = Path(text).read_text() if text else CALIB_TEXT
        held = Path(heldout or HELDOUT).read_text()
        return windows(calib, tok, length, count), windows(held, tok, length, held_count), "text"
    rng = np.random.default_rng(seed)
    return (rng.integers(3, vocab, (count, length)).tolist(), rng.integers(3, vocab, (held_count, length)).tolist(),
            "random token prompts")

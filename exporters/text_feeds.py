"""Text -> tokenized, batched feeds (``graphopt feeds``), the realistic calibration/bench input.

Lines of a text file (one item per line, blank lines skipped) are ordered (``file``: as given;
``random``: shuffled with ``seed``; ``sorted``: by token count, shortest first), cut into batches
of ``batch``, tokenized with truncation to ``max_length`` and padded to the longest item of each
batch. Arrays are int64 with the names the tokenizer gives (``input_ids``, ``attention_mask`` and,
for BERT-like tokenizers, ``token_type_ids``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from graphopt.errors import UsageError, first_line

logger = logging.getLogger(__name__)

ORDERS = ("file", "random", "sorted")


@dataclasses.dataclass
class FeedStats:
    """Shape of the written feeds."""

    items: int
    batches: int
    tokens: int  # real tokens
    slots: int  # batch x padded length, summed
    path: Path | None = None

    @property
    def padding(self) -> float:
        """Fraction of positions that are padding."""
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def load_tokenizer(folder: str | os.PathLike):
    """A transformers tokenizer from a local folder (no hub access)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = Path(folder)
    if not p.is_dir():
        raise UsageError(f"{p}: tokenizer folder not found", hint="--tokenizer takes a Hugging Face model folder")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        return transformers.AutoTokenizer.from_pretrained(p)
    except Exception as e:
        raise UsageError(f"{p}: no usable tokenizer: {first_line(e, 200)}", hint="the folder needs tokenizer.json or vocab.txt") from e


def read_lines(path: str | os.PathLike) -> list[str]:
    """Non-blank lines of a UTF-8 text file."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p}: text file not found", hint="--text takes a file with one item per line")
    lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        raise UsageError(f"{p}: no text lines", hint="one item per line")
    return lines


def text_feeds(
    tokenizer,
    lines: Sequence[str],
    *,
    batch: int = 32,
    max_length: int = 128,
    order: str = "random",
    seed: int = 0,
) -> tuple[list[dict[str, np.ndarray]], FeedStats]:
    """Batched, per-batch padded feeds of ``lines`` and their padding statistics."""
    if order not in ORDERS:
        raise UsageError(f"unknown order {order!r}", hint="use " + ", ".join(ORDERS))
    if batch < 1 or max_length < 2:
        raise UsageError(f"--batch {batch} / --max-length {max_length}: need batch >= 1 and max-length >= 2")
    items = list(lines)
    if order == "random":
        rng = np.random.default_rng(seed)
        items = [items[i] for i in rng.permutation(len(items))]
    elif order == "sorted":
        lengths = [len(ids) for ids in tokenizer(items, truncation=True, max_length=max_length)["input_ids"]]
        items = [items[i] for i in np.argsort(lengths, kind="stable")]
    feeds = []
    tokens = slots = 0
    for start in range(0, len(items), batch):
        enc = tokenizer(items[start : start + batch], padding=True, truncation=True, max_length=max_length,
                        return_tensors="np")
        feed = {k: np.asarray(v).astype(np.int64) for k, v in enc.items()}
        feeds.append(feed)
        mask = feed["attention_mask"]
        tokens += int(mask.sum())
        slots += int(mask.size)
    return feeds, FeedStats(items=len(items), batches=len(feeds), tokens=tokens, slots=slots)


def write_text_feeds(
    tokenizer_dir: str | os.PathLike,
    text: str | os.PathLike,
    output: str | os.PathLike,
    *,
    batch: int = 32,
    max_length: int = 128,
    order: str = "random",
    seed: int = 0,
) -> FeedStats:
    """Tokenize ``text`` with the tokenizer in ``tokenizer_dir`` and write ``.npz`` feeds to ``output``."""
    from graphopt.data import feeds as gfeeds

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: is a file; -o takes a folder")
    if out.is_dir() and any(out.glob("*.npz")):
        raise UsageError(f"{out}: already holds .npz feeds", hint="choose an empty or new folder")
    lines = read_lines(text)
    tok = load_tokenizer(tokenizer_dir)
    feeds, stats = text_feeds(tok, lines, batch=batch, max_length=max_length, order=order, seed=seed)
    stats.path = gfeeds.save_dir(feeds, out)
    logger.info("%s: %d feeds, padding %.1f%%", out, stats.batches, 100 * stats.padding)
    return stats

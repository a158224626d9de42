"""Batches of prompts of different lengths.

Rows are left-padded to the longest prompt and the attention mask zeroes the padding, so every row's last
prompt token sits in the same column and one decode step appends one column for all rows.

What keeps each row's greedy output identical to running it alone is its positions: a row must see positions
0, 1, ... from its first real token, as it does alone. When the graph takes ``position_ids``, each row gets
its own (``cumsum(mask) - 1``, transformers' convention), and one left-padded call serves rows of any length.
The graphs graphopt exports take no ``position_ids``: the model derives them from the past length, the same
for every row, so a left-padded row would run at positions shifted by its padding. That changes a model with
absolute position embeddings (GPT-2's learned table) outright and a rotary one (Llama) by rounding, so for
such graphs ``groups`` splits the batch into rows of equal length, each group one batched run without padding.

A graph with ``GroupQueryAttention`` (``DecoderSignature.shared_buffer``) takes every row's positions from its
own mask (row ``b``'s tokens sit at ``0 .. sum(mask[b]) - 1``), but only for masks that are a prefix of ones:
its rows are right-padded (``right=True``), run as one batch whatever their lengths, each row's next-token
logits read at its own last prompt position, and each decode step appends one real position to every row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from graphopt.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Batch:
    """Prompts (token ids per row) and the id that pads them."""

    rows: tuple[tuple[int, ...], ...]
    pad_id: int = 0

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], pad_id: int | None = 0) -> Batch:
        rows = tuple(tuple(int(t) for t in p) for p in prompts)
        if not rows:
            raise UsageError("a batch needs at least one prompt")
        for i, r in enumerate(rows):
            if not r:
                raise UsageError(f"prompt {i} of the batch is empty: generation needs at least one prompt token")
        return cls(rows, 0 if pad_id is None else int(pad_id))

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.rows], np.int64)

    @property
    def width(self) -> int:
        return int(self.lengths.max())

    def input_ids(self, right: bool = False) -> np.ndarray:
        """[batch, width] left-padded with ``pad_id`` (``right``: right-padded)."""
        out = np.full((self.size, self.width), self.pad_id, np.int64)
        for i, r in enumerate(self.rows):
            if right:
                out[i, :len(r)] = r
            else:
                out[i, self.width - len(r):] = r
        return out

    def attention_mask(self, right: bool = False, extra: int = 0) -> np.ndarray:
        """[batch, width + extra]: 0 on the padding, 1 on the prompt (``right``: a prefix of ones per row, with
        ``extra`` positions appended to every row after its prompt)."""
        cols = np.arange(self.width + extra)[None, :]
        if right:
            return (cols < (self.lengths + extra)[:, None]).astype(np.int64)
        return (cols >= (self.width - self.lengths)[:, None]).astype(np.int64)

    def position_ids(self) -> np.ndarray:
        """[batch, width]: each row counts from 0 at its first real token (padding: 0)."""
        return np.maximum(np.cumsum(self.attention_mask(), axis=1) - 1, 0)

    def groups(self, per_row_positions: bool) -> list[list[int]]:
        """Row indices run together: all rows when the graph takes per-row positions, else rows of equal
        length (in first-seen order)."""
        if per_row_positions:
            return [list(range(self.size))]
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(self.rows):
            by_len.setdefault(len(r), []).append(i)
        return list(by_len.values())

    def select(self, rows: Sequence[int]) -> Batch:
        return Batch(tuple(self.rows[i] for i in rows), self.pad_id)

"""Model outputs per feed, with bounded memory: a list-like store that spills to a temp folder.

Verification keeps the outputs of the input model (the reference) and of the last good model for
every feed. Held as plain lists they grow with the number of feeds (64 feeds of 32 MiniLM sentences:
~330 MB per list). ``OutputStore`` keeps the first ``memory_bytes`` of outputs in memory and writes
each further feed's outputs to its own file in a private temp folder, read back on access; the
folder goes when the store (and every slice of it) is garbage collected. Values come back exactly
as they went in (pickled, so numpy arrays of any dtype, sequences and maps alike).
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: outputs kept in memory per store before spilling to disk (bytes)
MEMORY_BYTES = 32 << 20


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, Mapping):
        return sum(_nbytes(v) for v in value.values())
    return 64


class OutputStore(Sequence):
    """Per-feed output dicts (``store[i]`` is ``{output name: array}``), spilled beyond a memory budget.

    Supports ``append``, ``len``, indexing, slicing (a view sharing the files) and iteration, so it
    stands wherever a ``list[dict[str, np.ndarray]]`` of outputs did.
    """

    def __init__(self, items: Sequence[Mapping[str, Any]] = (), *, memory_bytes: int | None = None):
        self.memory_bytes = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._items: list[dict[str, Any] | Path] = []
        self._in_memory = 0
        self._dir: Path | None = None
        self.spilled = 0  # feeds written to disk
        for it in items:
            self.append(it)

    def append(self, outputs: Mapping[str, Any]) -> None:
        """Add the outputs of the next feed."""
        size = _nbytes(outputs)
        if self._in_memory + size <= self.memory_bytes:
            self._items.append(dict(outputs))
            self._in_memory += size
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="graphopt-outputs-"))
            weakref.finalize(self, shutil.rmtree, self._dir, True)
        path = self._dir / f"feed-{len(self._items):06d}.pkl"
        with open(path, "wb") as f:
            pickle.dump(dict(outputs), f, protocol=pickle.HIGHEST_PROTOCOL)
        self._items.append(path)
        self.spilled += 1

    def _get(self, i: int) -> dict[str, Any]:
        item = self._items[i]
        if isinstance(item, Path):
            with open(item, "rb") as f:
                return pickle.load(f)  # noqa: S301 - our own file in our own temp folder
        return dict(item)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return _View(self, range(len(self._items))[index])
        return self._get(index)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self._items)):
            yield self._get(i)

    def __repr__(self) -> str:
        return f"OutputStore({len(self)} feeds, {self.spilled} on disk)"


class _View(Sequence):
    """A slice of an OutputStore; keeps the store (and so its files) alive."""

    def __init__(self, base: OutputStore, indices: range):
        self._base, self._indices = base, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return _View(self._base, self._indices[index])
        return self._base._get(self._indices[index])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in self._indices:
            yield self._base._get(i)

    def __repr__(self) -> str:
        return f"OutputStore view ({len(self)} feeds)"

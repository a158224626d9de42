"""One model, one ONNX Runtime session: request validation against the signature, and batch runs.

How a batch is formed from requests depends on what padding costs the model (``Signature.padding``):

- ``remove-padding``: rows of any lengths go in one batch, padded with 0 (mask 0) to the longest; the
  graph computes only real tokens, so the padding is free.
- ``padded``: requests are sorted by length and grouped in length buckets; each group is padded to its
  longest row (padded positions cost compute, so only similar lengths share a run).
- ``none`` (no attention mask): only requests of equal shapes share a run.

A batch that fails inside ONNX Runtime is retried request by request, so a bad request fails alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from graphopt import io
from graphopt.deploy import (
    DATATYPES,
    DEFAULT_MAX_LENGTH,
    MANIFEST_NAME,
    MODEL_FILE,
    Signature,
    instance_threads,
    read_manifest,
    signature,
)
from graphopt.errors import GraphoptError, ModelLoadError, UsageError, first_line
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)

#: length bucket width for padded models: rows whose lengths round up to the same multiple share a run
LENGTH_BUCKET = 8


class InferError(GraphoptError):
    """A request the server answers with an HTTP error status (``status``) and a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Item:
    """One validated request: its inputs, row count and (token models) sequence length."""

    inputs: dict[str, np.ndarray]
    rows: int
    length: int | None
    outputs: list[str]


class Runner:
    """Owns the sessions; ``validate`` checks a request, ``run`` computes a list of items as batches."""

    def __init__(self, model_path: str | os.PathLike, *, name: str, provider: str = "cpu",
                 threads: int | None = None, max_length: int = DEFAULT_MAX_LENGTH, version: str = "1",
                 instances: int = 1):
        if instances < 1:
            raise UsageError(f"instances must be at least 1, got {instances}")
        threads = instance_threads(provider, instances, threads)

        self.path = Path(model_path)
        self.name, self.version, self.max_length = name, version, max_length
        model = io.load(self.path)
        self.sig: Signature = signature(model)
        del model
        #: one session per instance: the batcher runs that many batches at once (``run(..., instance=k)``)
        self.sessions = [runtime.make_session(self.path, provider=provider, threads=threads, spinning=False)
                         for _ in range(instances)]
        self.instances, self.threads = instances, threads
        self.platform = "onnxruntime_onnx"
        self._inputs = {s.name: s for s in self.sig.inputs}
        self._outputs = {s.name: s for s in self.sig.outputs}

    # --- metadata -------------------------------------------------------------------------------------
    def metadata(self) -> dict:
        return {"name": self.name, "versions": [self.version], "platform": self.platform,
                "inputs": [s.to_dict() for s in self.sig.inputs],
                "outputs": [s.to_dict() for s in self.sig.outputs]}

    # --- validation -----------------------------------------------------------------------------------
    def validate(self, inputs: dict[str, np.ndarray], outputs: list[str] | None) -> Item:
        """An ``Item`` for the decoded request tensors, or ``InferError`` (400) naming what is wrong."""
        expected = list(self._inputs)
        unknown = [n for n in inputs if n not in self._inputs]
        if unknown:
            raise InferError(f"unknown input {unknown[0]!r}; model {self.name!r} takes {', '.join(expected)}")
        missing = [n for n in expected if n not in inputs]
        if missing:
            raise InferError(f"missing input {missing[0]!r}; model {self.name!r} takes {', '.join(expected)}")
        rows = length = None
        for name, arr in inputs.items():
            spec = self._inputs[name]
            if arr.dtype != np.dtype(spec.dtype):
                raise InferError(f"input {name!r}: datatype {_oip(arr.dtype)}, the model takes {spec.datatype}")
            if arr.ndim != len(spec.shape) or any(d != -1 and d != a for d, a in zip(spec.shape, arr.shape)):
                raise InferError(f"input {name!r}: shape {list(arr.shape)}, the model takes {list(spec.shape)}")
            if self.sig.batched:
                if arr.shape[0] < 1:
                    raise InferError(f"input {name!r}: empty batch (shape {list(arr.shape)})")
                if rows is not None and arr.shape[0] != rows:
                    raise InferError(f"input {name!r}: batch {arr.shape[0]}, other inputs have {rows}")
                rows = arr.shape[0]
            if name in self.sig.sequence_inputs:
                if length is not None and arr.shape[1] != length:
                    raise InferError(f"input {name!r}: sequence length {arr.shape[1]}, other inputs have {length}")
                length = arr.shape[1]
        if length is not None:
            if length < 1:
                raise InferError("empty sequence (length 0)")
            if length > self.max_length:
                raise InferError(f"sequence length {length} exceeds the maximum {self.max_length}")
        wanted = list(self._outputs) if not outputs else outputs
        bad = [o for o in wanted if o not in self._outputs]
        if bad:
            raise InferError(f"unknown output {bad[0]!r}; model {self.name!r} gives {', '.join(self._outputs)}")
        return Item(inputs, rows or 1, length, wanted)

    # --- running --------------------------------------------------------------------------------------
    def groups(self, items: list[Item]) -> list[list[int]]:
        """Indices of ``items`` that share one session run."""
        order = range(len(items))
        if not self.sig.batched:
            return [[i] for i in order]
        if self.sig.padding == "remove-padding":
            return [list(order)]
        keyed: dict[Any, list[int]] = {}
        for i in order:
            it = items[i]
            if self.sig.padding == "padded":
                key = -(-it.length // LENGTH_BUCKET) if it.length is not None else 0
            else:
                key = tuple((n, a.shape[1:]) for n, a in sorted(it.inputs.items()))
            keyed.setdefault(key, []).append(i)
        return list(keyed.values())

    def _batch_inputs(self, items: list[Item]) -> dict[str, np.ndarray]:
        if len(items) == 1:
            return items[0].inputs
        longest = max((it.length or 0) for it in items)
        feed = {}
        for name in self._inputs:
            parts = []
            for it in items:
                a = it.inputs[name]
                if name in self.sig.sequence_inputs and a.shape[1] < longest:
                    pad = [(0, 0)] * a.ndim
                    pad[1] = (0, longest - a.shape[1])
                    a = np.pad(a, pad)  # zeros: mask 0 marks the padded positions
                parts.append(a)
            feed[name] = np.concatenate(parts, axis=0)
        return feed

    def _split(self, items: list[Item], results: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        out, start = [], 0
        for it in items:
            mine = {}
            for name in it.outputs:
                arr = results[name]
                part = arr[start:start + it.rows] if self.sig.batched else arr
                spec = self._outputs[name]
                if it.length is not None and self.sig.sequence_dim is not None:
                    for axis, dim in enumerate(spec.dim_names):
                        if dim == self.sig.sequence_dim and part.shape[axis] != it.length:
                            part = part.take(range(it.length), axis=axis)
                mine[name] = np.ascontiguousarray(part)
            out.append(mine)
            start += it.rows
        return out

    def _run_group(self, items: list[Item], instance: int = 0) -> list[dict[str, np.ndarray]]:
        names = sorted({n for it in items for n in it.outputs})
        values = self.sessions[instance].run(names, self._batch_inputs(items))
        return self._split(items, dict(zip(names, values)))

    def run(self, items: list[Item], instance: int = 0) -> list[dict[str, np.ndarray] | InferError]:
        """Results in ``items`` order, computed on session ``instance``; a request that fails gets an
        ``InferError`` of its own."""
        results: list[Any] = [None] * len(items)
        for group in self.groups(items):
            members = [items[i] for i in group]
            try:
                for i, r in zip(group, self._run_group(members, instance)):
                    results[i] = r
                continue
            except Exception as e:  # ONNX Runtime failed: find the culprit(s) one request at a time
                if len(members) == 1:
                    results[group[0]] = InferError(f"inference failed: {first_line(e, 300)}")
                    continue
                logger.info("batch of %d failed (%s); retrying one by one", len(members), first_line(e, 120))
            for i in group:
                try:
                    results[i] = self._run_group([items[i]], instance)[0]
                except Exception as e:
                    results[i] = InferError(f"inference failed: {first_line(e, 300)}")
        return results


def _oip(dtype: np.dtype) -> str:
    for _, oip, np_dtype in DATATYPES.values():
        if np.dtype(np_dtype) == dtype:
            return oip
    return str(dtype)


def _entry(path: Path, name: str | None) -> Path:
    """The repository entry folder (holding ``1/model.onnx``) for a REPO or REPO/NAME path."""
    if (path / "1" / MODEL_FILE).is_file():
        return path
    entries = sorted(p for p in path.iterdir() if (p / "1" / MODEL_FILE).is_file()) if path.is_dir() else []
    if name is not None:
        entries = [p for p in entries if p.name == name]
    if len(entries) == 1:
        return entries[0]
    if not entries:
        raise ModelLoadError(f"{path}: no model repository entry (NAME/1/{MODEL_FILE})"
                             + (f" named {name!r}" if name else ""), hint="give an .onnx file or a `graphopt deploy` folder")
    raise UsageError(f"{path} holds {len(entries)} models ({', '.join(p.name for p in entries)})",
                     hint="choose one with --name")


def load_runner(model: str | os.PathLike, *, name: str | None = None, provider: str | None = None,
                threads: int | None = None, max_length: int | None = None, instances: int | None = None) -> Runner:
    """A ``Runner`` for an ``.onnx`` file or a ``graphopt deploy`` repository (its manifest fills defaults)."""
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    man: dict = {}
    if path.is_dir():
        entry = _entry(path, name)
        if (entry / MANIFEST_NAME).is_file():
            man = read_manifest(entry)
        name = name or entry.name
        path = entry / "1" / MODEL_FILE
    else:
        name = name or path.name.split(".")[0]
    session = man.get("session", {})
    contract = man.get("input_contract", {})
    return Runner(path, name=name, provider=provider or session.get("provider") or "cpu",
                  threads=threads or session.get("intra_op_threads"),
                  instances=instances or session.get("instances") or 1,
                  max_length=max_length or contract.get("max_sequence_length") or DEFAULT_MAX_LENGTH)

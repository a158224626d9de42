"""``graphopt deploy``: a Triton model repository for an optimized model, with a ``graphopt.json`` manifest.

::

    REPO/NAME/config.pbtxt      Triton model configuration (onnxruntime backend)
    REPO/NAME/graphopt.json     what graphopt did and what the model needs (``MANIFEST_SCHEMA``)
    REPO/NAME/1/model.onnx      the model (+ ``model.onnx.data`` when its weights are external)

The configuration states the signature (``-1`` where a dimension is dynamic; with ``max_batch_size`` > 0 the
batch dimension is left out, as Triton wants), dynamic batching with preferred sizes, one instance group for
the provider, and the ONNX Runtime session settings the model recorded (``graphopt.runtime.session_hints``; a model
without them gets graphopt's defaults): graph optimization level ``all`` (graphopt's CPU residual LayerNorm
form, ``Sum`` + ``LayerNormalization``, survives it: ORT has no rule turning a ``Sum`` back into
``SkipLayerNormalization``), sequential execution with one inter-op thread, and the intra-op thread count
when one is given.

The minimum ORT version and the providers come from the ops actually in the graph
(``graphopt.runtime.ort_compat``). The input contract says which inputs carry tokens and what padding means:
a ``remove-padding`` model computes only real tokens, so a batch may mix lengths freely (padding costs
nothing); a padded model pays for every padded position, so servers should batch equal lengths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

import graphopt
from graphopt import io
from graphopt.engine.provenance import chain_of
from graphopt.errors import ModelLoadError, ModelSaveError, UsageError
from graphopt.runtime import session_hints
from graphopt.runtime.ort_compat import requirements

logger = logging.getLogger(__name__)

MANIFEST_NAME = "graphopt.json"
MANIFEST_SCHEMA = "1.0"
MODEL_FILE = "model.onnx"
#: the mask input name graphopt's token models use (the exporters, remove-padding)
MASK_INPUT = "attention_mask"
#: default longest sequence (MiniLM/BERT position table); servers reject longer requests with a 400
DEFAULT_MAX_LENGTH = 512

#: ONNX element type -> (Triton config data type, Open Inference Protocol datatype, numpy dtype)
DATATYPES: dict[ir.DataType, tuple[str, str, Any]] = {
    ir.DataType.BOOL: ("TYPE_BOOL", "BOOL", np.bool_),
    ir.DataType.UINT8: ("TYPE_UINT8", "UINT8", np.uint8),
    ir.DataType.UINT16: ("TYPE_UINT16", "UINT16", np.uint16),
    ir.DataType.UINT32: ("TYPE_UINT32", "UINT32", np.uint32),
    ir.DataType.UINT64: ("TYPE_UINT64", "UINT64", np.uint64),
    ir.DataType.INT8: ("TYPE_INT8", "INT8", np.int8),
    ir.DataType.INT16: ("TYPE_INT16", "INT16", np.int16),
    ir.DataType.INT32: ("TYPE_INT32", "INT32", np.int32),
    ir.DataType.INT64: ("TYPE_INT64", "INT64", np.int64),
    ir.DataType.FLOAT16: ("TYPE_FP16", "FP16", np.float16),
    ir.DataType.FLOAT: ("TYPE_FP32", "FP32", np.float32),
    ir.DataType.DOUBLE: ("TYPE_FP64", "FP64", np.float64),
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, Open Inference Protocol datatype, numpy dtype, dims (``-1`` dynamic) and
    the symbolic names of the dynamic dims (``None`` where a dim is fixed or unnamed)."""

    name: str
    datatype: str
    triton_type: str
    dtype: Any
    shape: tuple[int, ...]
    dim_names: tuple[str | None, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs, and how it treats batches and padding."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: every input and output has a leading dynamic batch dim with one name
    batched: bool
    #: the symbolic name of the sequence dim shared by the token inputs (None: no such inputs)
    sequence_dim: str | None
    #: inputs with that sequence dim (padded with 0 when requests are batched)
    sequence_inputs: tuple[str, ...]
    #: the attention-mask input, when the model has one over the sequence inputs
    mask_input: str | None
    #: graphopt's remove-padding ran: padded positions cost nothing
    packed: bool

    @property
    def padding(self) -> str:
        """``remove-padding``, ``padded`` (mask input, pads cost compute) or ``none`` (no mask: equal shapes only)."""
        if self.mask_input is None:
            return "none"
        return "remove-padding" if self.packed else "padded"


def _spec(value: ir.Value, what: str) -> TensorSpec:
    dtype = value.dtype
    if dtype not in DATATYPES:
        raise UsageError(f"{what} {value.name!r} has type {dtype}, which the serving protocols do not carry",
                         hint="supported: " + ", ".join(t[1] for t in DATATYPES.values()))
    if value.shape is None:
        raise UsageError(f"{what} {value.name!r} has no shape", hint="run shape inference / re-export the model")
    dims, names = [], []
    for d in value.shape:
        if isinstance(d, int):
            dims.append(d)
            names.append(None)
        else:
            dims.append(-1)
            names.append(d.value if isinstance(d, ir.SymbolicDim) and d.value else None)
    triton, oip, np_dtype = DATATYPES[dtype]
    return TensorSpec(value.name, oip, triton, np_dtype, tuple(dims), tuple(names))


def _from_mask(value: ir.Value | None, mask: str, hops: int = 4) -> bool:
    while value is not None and hops >= 0:
        if value.name == mask and value.producer() is None:
            return True
        node = value.producer()
        if node is None or node.op_type not in ("Cast", "Reshape", "Flatten", "Identity") or not node.inputs:
            return False
        value, hops = node.inputs[0], hops - 1
    return False


def is_packed(model: ir.Model) -> bool:
    """Whether graphopt's remove-padding rewrote ``model``: its nodes' provenance says so or, where the
    metadata was stripped, the graph packs real tokens by ``NonZero`` of the flattened attention mask."""

    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    if any("remove-padding" in chain_of(n) for n in nodes):
        return True
    return any(n.op_type == "NonZero" and n.inputs and _from_mask(n.inputs[0], MASK_INPUT) for n in nodes)


def signature(model: ir.Model) -> Signature:
    """The serving signature of ``model``."""
    ins = tuple(_spec(v, "input") for v in model.graph.inputs if not v.is_initializer())
    outs = tuple(_spec(v, "output") for v in model.graph.outputs)
    leading = {s.dim_names[0] if s.shape else None for s in ins + outs}
    batched = len(leading) == 1 and None not in leading and all(s.shape and s.shape[0] == -1 for s in ins + outs)
    seq_dim = None
    seq_inputs: tuple[str, ...] = ()
    names_2d = [s for s in ins if len(s.shape) == 2 and s.dim_names[1] is not None and batched]
    if names_2d:
        counts: dict[str, int] = {}
        for s in names_2d:
            counts[s.dim_names[1]] = counts.get(s.dim_names[1], 0) + 1
        seq_dim = max(counts, key=counts.get)
        seq_inputs = tuple(s.name for s in names_2d if s.dim_names[1] == seq_dim)
    mask = MASK_INPUT if MASK_INPUT in seq_inputs else None
    return Signature(ins, outs, batched, seq_dim, seq_inputs, mask, is_packed(model))


def _dims(spec: TensorSpec, batched: bool) -> str:
    dims = spec.shape[1:] if batched else spec.shape
    return "[ " + ", ".join(str(d) for d in dims) + " ]"


def preferred_batch_sizes(max_batch: int) -> list[int]:
    """Powers of two from 4 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [b for b in (4, 8, 16, 32, 64, 128, 256) if b < max_batch]
    return [*sizes, max_batch] if max_batch > 1 else []


def config_pbtxt(name: str, sig: Signature, *, max_batch: int, provider: str, instances: int,
                 threads: int | None, max_delay_us: int, level: str = "all", execution_mode: str = "sequential",
                 inter_op_threads: int = 1) -> str:
    """Triton's ``config.pbtxt`` text for the ``onnxruntime`` backend (``level``, ``execution_mode`` and
    ``inter_op_threads``: the model's recorded session settings, ``graphopt.runtime.session_hints``)."""
    batch = max_batch if sig.batched else 0
    lines = [f'name: "{name}"', 'backend: "onnxruntime"', f"max_batch_size: {batch}"]
    for kind, specs in (("input", sig.inputs), ("output", sig.outputs)):
        lines.append(f"{kind} [")
        body = [f'  {{ name: "{s.name}" data_type: {s.triton_type} dims: {_dims(s, batch > 0)} }}' for s in specs]
        lines.append(",\n".join(body))
        lines.append("]")
    if batch > 1:
        sizes = ", ".join(str(b) for b in preferred_batch_sizes(batch))
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {sizes} ] "
                     f"max_queue_delay_microseconds: {max_delay_us} }}")
    kind = "KIND_GPU" if provider == "cuda" else "KIND_CPU"
    lines.append(f"instance_group [ {{ count: {instances} kind: {kind} }} ]")
    # The onnxruntime backend maps graph level -1 to ORT_ENABLE_BASIC, 1 to ORT_ENABLE_EXTENDED and
    # anything else (the default) to ORT_ENABLE_ALL, the level graphopt verifies under.
    graph_level = {"all": 0, "extended": 1, "basic": -1}[level]
    lines.append(f"optimization {{ graph {{ level: {graph_level} }} }}")
    params = [("intra_op_thread_count", threads)] if threads else []
    if threads or inter_op_threads != 1:
        params.append(("inter_op_thread_count", inter_op_threads))
    if execution_mode != "sequential":
        params.append(("execution_mode", 1))  # the backend's ExecutionMode: 0 sequential, 1 parallel
    for key, value in params:
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _report_fields(report: dict | None, model: ir.Model) -> dict:
    if report is None:

        seen: list[str] = []
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            for p in chain_of(node):
                if p not in seen:
                    seen.append(p)
        return {"recipe": None, "passes": [{"name": p} for p in seen],
                "verification": None, "source": None,
                "note": "no --report given: passes read from the graph's provenance (passes that changed it)"}
    passes = [{k: p.get(k) for k in ("name", "status", "modified", "exact", "options", "verification")}
              for p in report.get("passes", [])]
    return {
        "recipe": report.get("recipe") or None,
        "passes": passes,
        "verification": {"level": report.get("verify"), "numerics": report.get("numerics"),
                         "budget": report.get("budget") or None, "feeds": report.get("feeds"),
                         "vs_input": report.get("final") or {}},
        "source": report.get("input") or None,
    }


def _session_settings(model: ir.Model) -> dict[str, Any]:
    """The ORT session settings the model recorded (``graphopt.runtime.session_hints``), graphopt's defaults else."""
    return {**session_hints.MEASURED, **session_hints.read(model)}


def manifest(model: ir.Model, sig: Signature, *, name: str, report: dict | None, max_batch: int,
             provider: str, instances: int, threads: int | None, max_delay_us: int, max_length: int,
             files: dict[str, str]) -> dict:
    """The ``graphopt.json`` manifest (see the module docstring)."""
    import onnxruntime as ort

    req = requirements(model)
    if provider == "cuda" and "cuda" not in req.providers:
        raise UsageError(f"--provider cuda: no CUDA kernel for {', '.join(req.contrib_ops)} in the tables",
                         hint="deploy with --provider cpu")
    if provider == "cpu" and "cpu" not in req.providers:
        raise UsageError("the model needs ONNX Runtime's CUDA provider (ops without a CPU kernel: "
                         + ", ".join(op for op in req.contrib_ops) + ")",
                         hint="deploy with --provider cuda, or optimize with --provider cpu")
    padding_text = {
        "remove-padding": "rows may be padded anywhere with attention_mask 0 at padded positions; only real "
                          "tokens are computed, so batches may mix lengths freely; outputs at padded positions are 0",
        "padded": "rows may be padded with attention_mask 0 at padded positions; padded positions are computed "
                  "(batch equal lengths); outputs at padded positions are not meaningful",
        "none": "no attention mask: batched requests must have equal shapes",
    }[sig.padding]
    return {
        "schema_version": MANIFEST_SCHEMA,
        "name": name,
        "graphopt_version": graphopt.__version__,
        "files": files,
        **_report_fields(report, model),
        "onnxruntime": {**req.to_dict(), "verified_with": ort.__version__},
        "session": {"provider": provider, **_session_settings(model), "intra_op_threads": threads,
                    "instances": instances},
        "batching": {"max_batch_size": max_batch if sig.batched else 0,
                     "preferred_batch_sizes": preferred_batch_sizes(max_batch) if sig.batched else [],
                     "max_queue_delay_microseconds": max_delay_us},
        "inputs": [s.to_dict() for s in sig.inputs],
        "outputs": [s.to_dict() for s in sig.outputs],
        "input_contract": {
            "batched": sig.batched,
            "sequence_inputs": list(sig.sequence_inputs),
            "attention_mask": sig.mask_input,
            "padding": sig.padding,
            "padding_meaning": padding_text,
            "max_sequence_length": max_length if sig.sequence_inputs else None,
        },
    }


def instance_threads(provider: str, instances: int, threads: int | None) -> int | None:
    """The intra-op threads of each of ``instances`` sessions (``graphopt deploy``, ``graphopt serve``):
    ``threads`` if given; on CPU with several instances 1, since ORT's default (one thread per core) in
    every instance would oversubscribe the cores, and concurrent single-thread sessions scale better
    than intra-op threads on graphopt's packed graphs (docs/benchmarks.md, issue 20: 1.80x against 1.46-1.66x
    on 2 cores for the int8 MiniLM, `graphopt bench --paired`); else ``None`` (ORT's default)."""
    if provider == "cpu" and instances > 1 and not threads:
        return 1
    return threads or None


def deploy(model_path: str | os.PathLike, repo: str | os.PathLike, *, name: str | None = None,
           max_batch: int = 32, provider: str = "cpu", instances: int = 1, threads: int | None = None,
           max_delay_us: int = 2000, max_length: int = DEFAULT_MAX_LENGTH, report: str | os.PathLike | None = None,
           external_data: bool | None = None, force: bool = False) -> Path:
    """Write the Triton model repository entry ``REPO/NAME`` for ``model_path``; returns its folder.

    The entry is built in a temporary folder beside it and renamed into place, so a failure leaves nothing.
    """
    src = Path(model_path)
    name = name or src.name.split(".")[0]
    if not name or "/" in name or name.startswith("."):
        raise UsageError(f"bad model name {name!r}", hint="give --name NAME (letters, digits, - and _)")
    if max_batch < 0 or instances < 1:
        raise UsageError("--max-batch must be >= 0 and --instances >= 1")
    chosen = instance_threads(provider, instances, threads)
    if chosen and not threads:
        logger.info("%d CPU instances: 1 intra-op thread each (give --threads to change)", instances)
    threads = chosen
    report_dict = None
    if report is not None:
        try:
            report_dict = json.loads(Path(report).read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{report}: cannot read the optimize report: {e}") from None
    model = io.load(src)
    sig = signature(model)
    if not sig.batched and max_batch > 0:
        logger.warning("inputs/outputs have no common dynamic batch dim: max_batch_size 0 (no batching)")
    repo = Path(repo)
    dst = repo / name
    if dst.exists() and not force:
        raise ModelSaveError(f"{dst} exists", hint="remove it, or give --force to replace it")
    with io.staged_dir(dst, replace=True) as tmp:  # nothing half-written; an existing entry replaced at the end
        model_file = tmp / "1" / MODEL_FILE
        io.save(model, model_file, external_data=external_data, src=src)
        files = {f"1/{p.name}": _sha256(p) for p in sorted((tmp / "1").iterdir())}
        settings = _session_settings(model)
        (tmp / "config.pbtxt").write_text(config_pbtxt(
            name, sig, max_batch=max_batch, provider=provider, instances=instances, threads=threads,
            max_delay_us=max_delay_us, level=settings["graph_optimization_level"],
            execution_mode=settings["execution_mode"], inter_op_threads=settings["inter_op_threads"]))
        man = manifest(model, sig, name=name, report=report_dict, max_batch=max_batch, provider=provider,
                       instances=instances, threads=threads, max_delay_us=max_delay_us, max_length=max_length,
                       files=files)
        (tmp / MANIFEST_NAME).write_text(json.dumps(man, indent=2) + "\n")
    logger.info("wrote %s", dst)
    return dst


def read_manifest(folder: str | os.PathLike) -> dict:
    """The manifest of a repository entry (``REPO/NAME``)."""
    path = Path(folder) / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read the graphopt manifest: {e}") from None

"""``export()``: PyTorch / Hugging Face model -> ONNX file, gated on parity with PyTorch.

Steps: prepare the source (``sources``), export (``backends``; dynamo by default, TorchScript on
request or as a logged fallback when dynamo fails and no exporter was asked for), stamp metadata
(``graphopt.exporter``, ``graphopt.attn_implementation``, ``graphopt.task``, ``graphopt.dtype``),
run the parity gate (``parity``), and only then write the file atomically (``graphopt.io.save``;
external data above ~2 GB). A failed gate leaves no output file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from pathlib import Path

from graphopt import io
from graphopt.errors import ExportError, RuntimeSetupError, UsageError
from graphopt.exporters import backends, parity, sources, tasks
from graphopt.exporters.gguf_export import export_gguf

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
DTYPES = ("fp32", "fp16")


@dataclasses.dataclass
class ExportResult:
    """What ``export`` wrote and how it checked it."""

    path: Path
    task: str
    exporter: str
    attn: str | None
    dtype: str
    opset: int
    nodes: int
    parity: object  # parity.ParityResult
    seconds: float
    fallback: str | None = None  # why dynamo was abandoned for TorchScript
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. which GGUF blocks became which form

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        d["parity"] = self.parity.as_dict()
        return d


def export(
    src: str | os.PathLike,
    output: str | os.PathLike,
    *,
    task: str | None = None,
    exporter: str | None = None,
    attn: str | None = None,
    opset: int | None = None,
    dtype: str = "fp32",
    atol: float | None = None,
    external_data: bool | None = None,
) -> ExportResult:
    """Export ``src`` (HF model folder, ``module:function`` or ``.gguf`` file) to ``output`` with a parity gate.

    ``task``: default ``feature-extraction``; ``causal-lm-with-past`` for a ``.gguf`` decoder, whose
    ``output`` is a folder (``model.onnx`` with the GGUF blocks kept exactly, and the tokenizer; see
    ``gguf_export``).

    ``exporter``: "dynamo" or "torchscript"; None means dynamo with a TorchScript fallback.
    ``attn``: transformers attention implementation ("eager" or "sdpa"; None: the model's default).
    ``atol``: max absolute difference allowed per output on real tokens (default 1e-4 fp32, 1e-2 fp16).
    Raises ExportError, ParityError (exit 3) or UsageError; on any failure no file is written.
    """
    if str(src).lower().endswith(".gguf"):
        if dtype != "fp32":
            raise UsageError("a GGUF source exports as fp32 plus its quantized blocks", hint="drop --dtype")
        return export_gguf(src, output, task=task, exporter=exporter, attn=attn, opset=opset, atol=atol,
                           export_hf=export)
    task = task or "feature-extraction"
    t0 = time.perf_counter()
    spec = tasks.get_task(task)
    if exporter is not None and exporter not in backends.EXPORTERS:
        raise UsageError(f"unknown exporter {exporter!r}", hint="use dynamo or torchscript")
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        raise UsageError(f"unknown attention implementation {attn!r}", hint="use eager or sdpa")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", hint="use fp32 or fp16")
    if atol is None:
        atol = parity.DEFAULT_ATOL[dtype]
    out = io.check_output_path(src if Path(str(src)).exists() else None, output)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ExportError("exporting needs torch and transformers", hint="pip install 'graphopt[export]'") from e

    prep = sources.prepare(src, spec, attn=attn, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="graphopt-export-") as work:
        used, fallback = exporter or "dynamo", None
        try:
            model = _run(backends, used, prep, opset, Path(work))
        except ExportError:
            raise
        except Exception as e:
            msg = f"{type(e).__name__}: {sources._first_line(e)}"
            if exporter is not None or used != "dynamo":
                raise ExportError(
                    f"{src}: the {used} exporter failed: {msg}",
                    hint="try --exporter " + ("torchscript" if used == "dynamo" else "dynamo") + "; --debug shows the traceback",
                ) from e
            logger.warning("dynamo export failed (%s); falling back to the TorchScript exporter", msg)
            fallback, used = msg, "torchscript"
            try:
                model = _run(backends, used, prep, opset, Path(work))
            except Exception as e2:
                raise ExportError(
                    f"{src}: both exporters failed; dynamo: {msg}; torchscript: {type(e2).__name__}: {sources._first_line(e2)}"
                ) from e2
        model.metadata_props["graphopt.exporter"] = used
        model.metadata_props["graphopt.attn_implementation"] = prep.attn or "unknown"
        model.metadata_props["graphopt.task"] = spec.name
        model.metadata_props["graphopt.dtype"] = dtype
        if fallback:
            model.metadata_props["graphopt.exporter_fallback"] = fallback[:500]
        try:
            check = parity.check(
                model, prep.reference, prep.feeds, prep.input_names, prep.output_names,
                atol=atol, fp16_inputs=dtype == "fp16", src=str(src),
            )
        except RuntimeSetupError as e:
            raise ExportError(
                f"{src}: the {used} export ({dtype}) does not load in ONNX Runtime: {e.message}",
                hint="try the other --exporter" + (" (TorchScript fp16 exports are often ill-typed)" if dtype == "fp16" else ""),
            ) from e
        io.save(model, out, external_data=external_data)
    notes = []
    if spec.name.startswith("causal-lm") and Path(str(src)).is_dir():
        copied = copy_decoder_files(Path(str(src)), out.parent)
        if copied:
            notes.append(f"beside the model for graphopt generate: {', '.join(copied)}")
    opset_used = model.opset_imports.get("", 0)
    nodes = sum(1 for _ in model.graph)
    result = ExportResult(out, spec.name, used, prep.attn, dtype, opset_used, nodes, check,
                          time.perf_counter() - t0, fallback)
    result.notes = notes
    logger.info("exported %s with %s (%s attention): %d nodes, max_abs %.3g", out, used, prep.attn, nodes, check.max_abs)
    return result


#: what a decoder's folder holds that generation needs beside the model: tokenizer, maximum length, stop tokens
DECODER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "config.json",
                 "generation_config.json")


def copy_decoder_files(src: Path, folder: Path) -> list[str]:
    """Copy the tokenizer and generation files of the Hugging Face folder ``src`` into ``folder`` (atomically,
    never over a file already there); the names copied."""
    copied = []
    for name in DECODER_FILES:
        f, dst = src / name, folder / name
        if f.is_file() and not dst.exists():
            io.write_atomic(dst, f.read_bytes())
            copied.append(name)
    return copied


def _run(backends, name: str, prep, opset: int | None, work: Path):
    if name == "dynamo":
        return backends.export_dynamo(prep, opset)
    return backends.export_torchscript(prep, opset, work)


def check_parity(
    src: str | os.PathLike,
    model_path: str | os.PathLike,
    *,
    task: str = "feature-extraction",
    attn: str | None = None,
    dtype: str = "fp32",
    atol: float | None = None,
):
    """Re-run the parity gate of an existing ONNX file against its source; returns a ParityResult.

    Useful for cached exports: the same feeds and tolerance as ``export``; raises ParityError on failure.
    ``attn`` should match the attention implementation the file was exported with (its metadata).
    """
    spec = tasks.get_task(task)
    io.load(model_path)  # a readable ONNX file, or ModelLoadError
    prep = sources.prepare(src, spec, attn=attn, dtype=dtype)
    return parity.check(
        str(model_path), prep.reference, prep.feeds, prep.input_names, prep.output_names,
        atol=parity.DEFAULT_ATOL[dtype] if atol is None else atol, fp16_inputs=dtype == "fp16", src=str(model_path),
    )


def export_gguf_file(src, output, **options):
    """Export a GGUF decoder (``graphopt.exporters.gguf_export.export_gguf``'s options: ``keep_fp32``,
    ``hf_folder``, ``task``, ``atol``, ...) through this module's Hugging Face exporter."""
    return export_gguf(src, output, export_hf=export, **options)

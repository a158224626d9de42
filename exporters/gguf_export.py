"""``export`` of a ``.gguf`` decoder: the fp32 ONNX with past, then the GGUF blocks put back exactly.

Steps (``export_gguf``):

1. transformers loads the GGUF (``gguf_file=``), dequantizing every tensor to fp32; the model is
   rebuilt with ``from_config`` (a GGUF-loaded model is marked quantized and will not
   ``save_pretrained``) and saved with its tokenizer as a plain fp32 Hugging Face folder.
2. That folder goes through the ordinary exporter (``graphopt.exporters.export``: dynamo or
   TorchScript, parity-gated against PyTorch; default atol 1e-3, see ``DEFAULT_ATOL``), task
   ``causal-lm-with-past`` unless told otherwise.
3. ``gguf_blocks.apply`` swaps each Q4_1 projection for ``MatMulNBits`` + the block-sum correction
   and stores Q8_0 tensors as their int8 blocks (see there), checked against the GGUF blocks.
4. The block model must give the fp32 ONNX model's logits within ``rtol`` (max |diff| / max |logit|,
   default 1e-4) on tokenized prompts with and without past, else ParityError and no output.

The output folder gets ``model.onnx`` (the block model), the tokenizer files, and with
``keep_fp32`` the fp32 export as ``model.fp32.onnx``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from graphopt import io
from graphopt.errors import ExportError, ParityError
from graphopt.exporters import gguf, gguf_blocks

logger = logging.getLogger(__name__)

DEFAULT_TASK = "causal-lm-with-past"
DEFAULT_RTOL = 1e-4
#: parity tolerance of the fp32 export against PyTorch: a deep decoder's logits (|logit| ~ 20-30 for
#: SmolLM2's 30 layers) differ by ~4e-4 in fp32 from the summation order alone (the 1e-4 of encoders is
#: too tight); about 1e-5 relative
DEFAULT_ATOL = 1e-3
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little"]


def output_paths(output: str | os.PathLike) -> tuple[Path, Path]:
    """``(folder, model path)``: ``-o DIR`` writes ``DIR/model.onnx``; ``-o X.onnx`` writes there."""
    out = Path(output)
    if out.suffix == ".onnx":
        return out.parent, out
    return out, out / "model.onnx"


def load_hf(src: Path, folder: Path):
    """Dequantize ``src`` with transformers into a plain fp32 Hugging Face folder; returns (model, tokenizer)."""
    import torch
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.disable_progress_bar()
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except Exception as e:
        raise ExportError(f"{src}: transformers cannot load this GGUF: {type(e).__name__}: {str(e)[:300]}",
                          hint="transformers >= 5 with the gguf package; only architectures transformers knows") from e
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except Exception as e:  # the model still exports; generation needs a tokenizer from elsewhere
        logger.warning("%s: no tokenizer from the GGUF (%s: %s)", src, type(e).__name__, str(e)[:200])
        tok = None
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config._attn_implementation = None
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    del loaded
    model.save_pretrained(folder)
    if tok is not None:
        tok.save_pretrained(folder)
    return model, tok


def export_gguf(src, output, *, task: str | None = None, exporter: str | None = None, attn: str | None = None,
                opset: int | None = None, atol: float | None = None, rtol: float = DEFAULT_RTOL,
                keep_fp32: bool = False, hf_folder: str | os.PathLike | None = None, export_hf=None):
    """Export the GGUF decoder ``src`` into the folder ``output`` (see the module docstring).

    ``hf_folder``: also keep the dequantized fp32 Hugging Face folder there. ``export_hf``: the Hugging Face
    exporter (``graphopt.exporters.export.export``, which calls this function for ``.gguf`` sources and hands itself in).
    Returns the fp32 export's ExportResult with ``path`` the block model and ``notes`` saying what
    became which form.
    """
    if export_hf is None:
        raise TypeError("export_gguf needs export_hf (call graphopt.exporters.export.export with the .gguf file)")
    t0 = time.perf_counter()
    src = Path(src)
    if not src.is_file():
        raise ExportError(f"{src}: no such GGUF file")
    task = task or DEFAULT_TASK
    folder, model_path = output_paths(output)
    io.check_output_path(src, model_path)
    g = gguf.read(src)
    with tempfile.TemporaryDirectory(prefix="graphopt-gguf-") as work:
        work = Path(work)
        hf = Path(hf_folder) if hf_folder else work / "hf"
        hf.mkdir(parents=True, exist_ok=True)
        _, tok = load_hf(src, hf)
        fp32_path = work / "model.fp32.onnx"
        result = export_hf(hf, fp32_path, task=task, exporter=exporter, attn=attn, opset=opset,
                        atol=DEFAULT_ATOL if atol is None else atol)
        model = io.load(fp32_path)
        report = gguf_blocks.apply(model, g)
        model.metadata_props["graphopt.source"] = "gguf"
        model.metadata_props["graphopt.gguf_blocks"] = "; ".join(report.notes)[:2000]
        block_path = work / "model.onnx"
        io.save(model, block_path)
        worst = check_blocks(fp32_path, block_path, tok, with_past="with-past" in task, rtol=rtol)
        folder.mkdir(parents=True, exist_ok=True)
        if tok is not None:
            tok.save_pretrained(folder)
        if keep_fp32:
            _move(fp32_path, folder / "model.fp32.onnx")
        _move(block_path, model_path)
    result.path = model_path
    result.notes = report.notes + [f"block model vs fp32 ONNX: max relative logit difference {worst:.3g} (<= {rtol:g})"]
    result.seconds = time.perf_counter() - t0
    logger.info("exported %s: %s", model_path, "; ".join(result.notes))
    return result


def _move(src: Path, dst: Path) -> None:
    for a, b in ((Path(str(src) + ".data"), Path(str(dst) + ".data")), (src, dst)):
        if a.exists():
            tmp = b.parent / f".{b.name}.{os.getpid()}.tmp"
            shutil.move(str(a), tmp)
            os.replace(tmp, b)


def prompt_feeds(tok, input_names: list[str], vocab: int, past_shape=None) -> list[dict[str, np.ndarray]]:
    """One feed per prompt (batch 1; random ids without a tokenizer), empty past when the model has past inputs."""
    rng = np.random.default_rng(0)
    feeds = []
    for text in PROMPTS:
        ids = np.array([tok(text)["input_ids"]], dtype=np.int64) if tok is not None \
            else rng.integers(1, vocab, size=(1, 6), dtype=np.int64)
        f = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for n in input_names:
            if n.startswith("past_key_values."):
                f[n] = np.zeros((1, past_shape[1], 0, past_shape[3]), np.float32)
        feeds.append(f)
    return feeds


def check_blocks(fp32_path: Path, block_path: Path, tok, *, with_past: bool, rtol: float) -> float:
    """Max over prompts of max |logits diff| / max |fp32 logits|, prefill then one step with past; ParityError above ``rtol``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(str(fp32_path), so, providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(block_path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in ref.get_inputs()]
    out_names = [o.name for o in ref.get_outputs()]
    past = next((i.shape for i in ref.get_inputs() if i.name.startswith("past_key_values.")), None)
    vocab = ref.get_outputs()[0].shape[-1]
    worst = 0.0
    for feed in prompt_feeds(tok, names, vocab if isinstance(vocab, int) else 100, past):
        feed = {k: v for k, v in feed.items() if k in names}
        steps = [feed]
        a = ref.run(None, feed)
        if with_past:  # one decode step fed with the fp32 model's present
            nxt = {"input_ids": a[0][:, -1:].argmax(-1).astype(np.int64),
                   "attention_mask": np.ones((1, feed["input_ids"].shape[1] + 1), np.int64)}
            for n, v in zip(out_names[1:], a[1:]):
                nxt["past_key_values." + n[len("present."):]] = v
            steps.append(nxt)
        for i, f in enumerate(steps):
            r = a if i == 0 else ref.run(None, f)
            b = got.run(None, f)
            worst = max(worst, float(np.abs(b[0] - r[0]).max() / max(np.abs(r[0]).max(), 1e-30)))
    if not worst <= rtol:
        raise ParityError(f"{block_path.name}: the GGUF block model differs from the fp32 export: "
                          f"max relative logit difference {worst:.3g} > {rtol:g}")
    return worst

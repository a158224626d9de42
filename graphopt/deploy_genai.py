"""``graphopt deploy --genai``: a folder ONNX Runtime GenAI loads, for a graphopt decoder with past.

::

    OUT/model.onnx            the decoder (+ its external data files)
    OUT/genai_config.json     what GenAI reads: the decoder's input/output names, heads, sizes, token ids
    OUT/tokenizer.json ...    the tokenizer files beside the model (or --tokenizer DIR), copied

GenAI's config maps names, so graphopt's decoder contract (``graphopt.generate.signature``) fits as it is:
``input_ids``, ``attention_mask``, optional ``position_ids``, ``past_key_values.%d.key/value`` ->
``logits``, ``present.%d.key/value``. A present that is the past plus the new positions (graphopt's exports)
is ``past_present_share_buffer: false``; a present with the past's own sequence dim (one max-length buffer,
GroupQueryAttention's shared form) is ``true``. What does not fit is refused in one line: a graph that is not a
decoder with past, logits of the last position only (GenAI reads ``[batch, sequence, vocab]``), a cache that is
not float32 or float16, inputs that are not int64.

Heads and sizes come from the signature (KV heads, head size, layers) and the Hugging Face ``config.json`` beside
the tokenizer (attention heads, hidden size; without it the KV heads stand in), the token ids from
``generation_config.json`` / ``config.json`` / the tokenizer, the context length from the model's maximum
positions. :func:`verify_genai` loads the folder with ``onnxruntime_genai.Model`` and compares its greedy
tokens with ``graphopt.generate`` on the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from graphopt import io
from graphopt.errors import ModelSaveError, UsageError, VerificationError
from graphopt.generate import chat
from graphopt.generate.loop import generate
from graphopt.generate.sampling import GREEDY
from graphopt.generate.signature import DecoderSignature, read_signature

logger = logging.getLogger(__name__)

CONFIG_NAME = "genai_config.json"
MODEL_FILE = "model.onnx"
#: tokenizer files GenAI's tokenizer (onnxruntime-extensions) reads, copied when present
TOKENIZER_FILES = chat.COMPANION_FILES
#: GenAI model types that run as a plain decoder-only pipeline; another config model_type deploys as llama
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo", "smollm3")
_TYPES = {ir.DataType.FLOAT: "tensor(float)", ir.DataType.FLOAT16: "tensor(float16)",
          ir.DataType.DOUBLE: "tensor(double)", ir.DataType.BFLOAT16: "tensor(bfloat16)",
          ir.DataType.INT64: "tensor(int64)", ir.DataType.INT32: "tensor(int32)"}


@dataclasses.dataclass(frozen=True)
class _Arg:
    """An input or output as ORT's NodeArg shows it (what ``read_signature`` reads)."""

    name: str
    shape: list
    type: str


def _args(values) -> list[_Arg]:
    out = []
    for v in values:
        dims = [d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None)
                for d in (v.shape or [])]
        out.append(_Arg(v.name, dims, _TYPES.get(v.dtype, f"tensor({str(v.dtype).lower()})")))
    return out


def _fits(model: ir.Model, name: str) -> tuple[DecoderSignature, bool]:
    """The decoder signature and whether present shares the past's buffer; UsageError (one line) where the
    graph does not fit GenAI's decoder conventions."""
    ins = _args(v for v in model.graph.inputs if not v.is_initializer())
    outs = _args(model.graph.outputs)
    sig = read_signature(ins, outs, name=name)
    if not sig.logits_all_positions:
        raise UsageError(f"{name}: does not fit ONNX Runtime GenAI: 'logits' holds the last position only; GenAI "
                         "reads [batch, sequence, vocab]", hint="export with all positions' logits")
    if sig.dtype not in (np.float32, np.float16):
        raise UsageError(f"{name}: does not fit ONNX Runtime GenAI: the KV cache is {sig.dtype}, not float32/float16")
    by_name = {a.name: a for a in ins + outs}
    past, present = sig.cache_names[0]
    shared = (len(by_name[past].shape) == 4 and isinstance(by_name[past].shape[2], str)
              and by_name[past].shape[2] == by_name[present].shape[2])
    return sig, shared


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def genai_config(sig: DecoderSignature, *, shared: bool, hf_config: dict, tokenizer, folders: Sequence[Path],
                 context_length: int | None) -> dict:
    """The ``genai_config.json`` document for a decoder of signature ``sig``."""
    heads = int(hf_config.get("num_attention_heads") or sig.kv_heads)
    hidden = int(hf_config.get("hidden_size") or heads * sig.head_dim)
    mtype = str(hf_config.get("model_type") or "llama")
    mtype = mtype if mtype in DECODER_TYPES else "llama"
    stops = chat.stop_ids(tokenizer, *folders) if tokenizer is not None else []
    eos = stops[0] if len(stops) == 1 else (stops or [int(hf_config.get("eos_token_id") or 0)])
    bos = getattr(tokenizer, "bos_token_id", None)
    bos = hf_config.get("bos_token_id", 0) if bos is None else bos
    pad = chat.pad_id(tokenizer, int(hf_config.get("pad_token_id") or 0)) if tokenizer is not None else 0
    length = context_length or 2048
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if sig.has_position_ids:
        inputs["position_ids"] = "position_ids"
    return {
        "model": {
            "bos_token_id": int(bos), "context_length": int(length),
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE, "head_size": sig.head_dim, "hidden_size": hidden, "inputs": inputs,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": heads, "num_hidden_layers": sig.layers, "num_key_value_heads": sig.kv_heads,
            },
            "eos_token_id": eos, "pad_token_id": int(pad), "type": mtype,
            "vocab_size": int(sig.vocab or hf_config.get("vocab_size") or 0),
        },
        "search": {"do_sample": False, "early_stopping": True, "max_length": int(length), "min_length": 0,
                   "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": shared,
                   "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def deploy_genai(model_path: str | os.PathLike, output: str | os.PathLike, *,
                 tokenizer: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write the GenAI folder ``output`` for the decoder ``model_path`` (module docstring); returns it.

    Built in a temporary folder beside ``output`` and renamed into place: a failure leaves nothing."""
    src = Path(model_path)
    dst = Path(output)
    if dst.exists() and not force:
        raise ModelSaveError(f"{dst} exists", hint="remove it, or give --force to replace it")
    model = io.load(src)
    sig, shared = _fits(model, str(src))
    folders = [Path(tokenizer)] if tokenizer is not None else []
    folders.append(src.parent)
    tok_folder = next((f for f in folders if any((f / n).is_file() for n in chat.TOKENIZER_FILES)), None)
    tok = chat.load_tokenizer(tok_folder) if tok_folder is not None else None
    if tok is None:
        logger.warning("no tokenizer files beside %s: GenAI will load the model but not a tokenizer", src.name)
    hf_config = next((c for c in (_json(f / "config.json") for f in folders) if c), {})
    config = genai_config(sig, shared=shared, hf_config=hf_config, tokenizer=tok, folders=folders,
                          context_length=chat.max_positions(tok, *folders) if tok is not None else None)
    with io.staged_dir(dst, replace=True) as tmp:
        io.save(model, tmp / MODEL_FILE, src=src)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=4) + "\n")
        for name in TOKENIZER_FILES:
            f = next((d / name for d in folders if (d / name).is_file()), None)
            if f is not None:
                shutil.copy2(f, tmp / name)
    logger.info("wrote %s", dst)
    return dst


def genai_greedy(folder: str | os.PathLike, prompt: Sequence[int], max_new: int) -> list[int]:
    """``max_new`` greedy tokens of the GenAI folder for ``prompt`` (end-of-sequence masked by min_length)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    total = len(prompt) + max_new
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray([list(prompt)], np.int32))
    out: list[int] = []
    while len(out) < max_new and not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def probe_ids(folder: str | os.PathLike, text: str = "The quick brown fox jumps over the lazy dog. " * 2) -> list[int]:
    """Prompt ids for a check: ``text`` through the tokenizer in ``folder``, or ids 1..16 without one."""
    try:
        tok = chat.load_tokenizer(chat.tokenizer_folder(Path(folder) / MODEL_FILE))
    except UsageError:
        return list(range(1, 17))
    return list(tok(text)["input_ids"])


def verify_genai(folder: str | os.PathLike, prompt: Sequence[int], max_new: int = 16) -> list[int]:
    """Load ``folder`` with ONNX Runtime GenAI and check its greedy tokens equal ``graphopt.generate``'s on the
    same ids (end-of-sequence masked in both); returns them, VerificationError where they differ."""
    folder = Path(folder)
    config = _json(folder / CONFIG_NAME)
    eos = config.get("model", {}).get("eos_token_id", [])
    stops = eos if isinstance(eos, list) else [eos]
    want = list(generate(folder / MODEL_FILE, list(prompt), max_new_tokens=max_new,
                         sampling=GREEDY.masking(stops)).token_ids)
    got = genai_greedy(folder, prompt, max_new)
    if got != want:
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise VerificationError(f"{folder}: ONNX Runtime GenAI's greedy tokens differ from graphopt generate's "
                                f"at new token {n} ({got[n:n + 1]} vs {want[n:n + 1]})")
    return got

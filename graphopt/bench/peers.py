"""The peer runtimes ``bench --generate`` compares against: ONNX Runtime GenAI and llama.cpp.

**ONNX Runtime GenAI**: its model builder (``python -m onnxruntime_genai.models.builder -i HF -o OUT -p
fp32|int4 -e cpu``) runs once on the Hugging Face folder; the output is cached under the models cache
(``$GRAPHOPT_CACHE`` or ``~/.cache/graphopt/models``) in ``genai/NAME-PRECISION-KEY``, KEY hashing the folder's
files (name, size, mtime), the precision and the GenAI version. int4 is built with ``accuracy_level=4`` (int8
activations: MatMulNBits' fastest CPU kernel) and the builder's default symmetric RTN blocks of 32. Sessions get
the thread count and intra-op spinning off through a config overlay. Timing: the Generator is made first (it
allocates the cache), then ``append_tokens(prompt)`` + the first ``generate_next_token`` is the prefill, and
``min_length`` masks the end-of-sequence ids as ``min_new_tokens`` does.

**llama.cpp** (``llama_cpp`` of llama-cpp-python) on a GGUF file: ``Llama.eval(prompt)``, then a greedy loop of
``llama_get_logits_ith(ctx, -1)`` -> masked argmax -> ``Llama.eval([token])``, ``n_threads`` and
``n_threads_batch`` = the thread count. Perplexity uses a second context with ``logits_all``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from graphopt.bench.decoders import GraphoptVariant, Run, TorchVariant, Variant, masked_argmax
from graphopt.errors import RuntimeSetupError, UsageError

logger = logging.getLogger(__name__)

GENAI_PRECISIONS = ("fp32", "int4")
#: builder --extra_options per precision
GENAI_EXTRA = {"fp32": [], "int4": ["accuracy_level=4"]}


def models_cache() -> Path:
    return Path(os.environ.get("GRAPHOPT_CACHE") or Path.home() / ".cache" / "graphopt" / "models")


def _folder_key(hf: Path, precision: str) -> str:
    h = hashlib.sha256()
    for p in sorted(hf.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{int(st.st_mtime)};".encode())
    h.update(f"{precision}:{GENAI_EXTRA[precision]}:{importlib.metadata.version('onnxruntime-genai')}".encode())
    return h.hexdigest()[:12]


def genai_build(hf: str | Path, precision: str, cache: str | Path | None = None) -> Path:
    """The GenAI model builder's output folder for ``hf`` at ``precision`` (built once, then cached)."""
    hf = Path(hf)
    if precision not in GENAI_PRECISIONS:
        raise UsageError(f"unknown GenAI precision {precision!r}", hint=f"use {', '.join(GENAI_PRECISIONS)}")
    dst = Path(cache or models_cache()) / "genai" / f"{hf.resolve().parent.name}-{hf.name}-{precision}-{_folder_key(hf, precision)}"
    if (dst / "genai_config.json").is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp / "out"),
           "-p", precision, "-e", "cpu", "-c", str(tmp / "hf-cache")]
    if GENAI_EXTRA[precision]:
        cmd += ["--extra_options", *GENAI_EXTRA[precision]]
    logger.info("building the GenAI %s model: %s", precision, " ".join(cmd))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0 or not (tmp / "out" / "genai_config.json").is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeSetupError(f"the GenAI model builder failed on {hf} ({precision}): "
                                    f"{tail[-1] if tail else 'exit ' + str(proc.returncode)}")
        os.replace(tmp / "out", dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def genai_config_overlay(threads: int) -> str:
    """The overlay giving a GenAI decoder session ``threads`` intra-op threads, one inter-op, no spinning."""
    return json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1,
        "session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}}}})


def _cache_itemsize(onnx_file: Path) -> int:
    """Bytes per element of the first past input of an ONNX decoder (its weights are not loaded)."""
    m = onnx.load(str(onnx_file), load_external_data=False)
    for i in m.graph.input:
        if i.name.startswith("past_key_values"):
            return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)).itemsize)
    return 4


class GenAIVariant(Variant):
    """A folder ONNX Runtime GenAI loads (``genai_config.json`` beside the model)."""

    kind = "onnxruntime-genai"

    def __init__(self, folder: str | Path, *, name: str, threads: int, stop_ids: Sequence[int] = ()):
        import onnxruntime_genai as og

        self.og = og
        self.name, self.model, self.threads = name, str(folder), threads
        cfg = og.Config(str(folder))
        cfg.overlay(genai_config_overlay(threads))
        self.net = og.Model(cfg)
        conf = json.loads((Path(folder) / "genai_config.json").read_text())
        dec = conf["model"]["decoder"]
        self.context_length = int(conf["model"].get("context_length") or 0)
        item = _cache_itemsize(Path(folder) / dec["filename"])
        self.kv_bytes_per_token = 2 * dec["num_hidden_layers"] * dec["num_key_value_heads"] * dec["head_size"] * item

    def _generator(self, length: int, min_length: int = 0):
        params = self.og.GeneratorParams(self.net)
        params.set_search_options(max_length=length, min_length=min_length, do_sample=False)
        return self.og.Generator(self.net, params)

    def generate(self, prompt: Sequence[int], max_new: int) -> Run:
        total = len(prompt) + max_new
        gen = self._generator(total, total)
        ids = np.asarray([list(prompt)], np.int32)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        gen.generate_next_token()
        tokens = [int(gen.get_next_tokens()[0])]
        t_first = t_last = time.perf_counter()
        while len(tokens) < max_new and not gen.is_done():
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
            t_last = time.perf_counter()
        return Run(tokens, t_first - t0, t_last - t_first)

    def window_logits(self, ids: Sequence[int]) -> np.ndarray:
        gen = self._generator(len(ids) + 1)
        gen.append_tokens(np.asarray([list(ids)], np.int32))
        logits = np.asarray(gen.get_output("logits"))
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] != len(ids):
            raise UsageError(f"{self.name}: GenAI returned logits for {logits.shape[0]} positions, not {len(ids)}")
        return logits

    def close(self) -> None:
        self.net = None


class LlamaCppVariant(Variant):
    """A GGUF file on llama.cpp (``llama_cpp``), greedy through ``Llama.eval`` + ``llama_get_logits_ith``."""

    kind = "llama.cpp"

    def __init__(self, gguf: str | Path, *, name: str, threads: int, stop_ids: Sequence[int], n_ctx: int):
        import llama_cpp

        self.lib = llama_cpp
        self.name, self.model, self.threads, self.n_ctx = name, str(gguf), threads, n_ctx
        self.stops = [int(s) for s in stop_ids]
        self.net = self._open(logits_all=False)
        self.stops = sorted({*self.stops, int(self.net.token_eos())})
        self.kv_bytes_per_token = self._kv_bytes()
        self._ppl_net = None

    def _open(self, *, logits_all: bool):
        return self.lib.Llama(model_path=self.model, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
                              n_threads=self.threads, n_threads_batch=self.threads, logits_all=logits_all,
                              verbose=False)

    def _kv_bytes(self) -> int | None:
        md = self.net.metadata or {}
        arch = md.get("general.architecture", "llama")
        try:
            layers = int(md[f"{arch}.block_count"])
            heads = int(md[f"{arch}.attention.head_count"])
            kv = int(md.get(f"{arch}.attention.head_count_kv", heads))
            key = int(md.get(f"{arch}.attention.key_length", int(md[f"{arch}.embedding_length"]) // heads))
            value = int(md.get(f"{arch}.attention.value_length", key))
        except (KeyError, ValueError):
            return None
        return layers * kv * (key + value) * 2  # llama.cpp's default cache type: f16

    def _last_logits(self) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.net.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.net.n_vocab(),))

    def generate(self, prompt: Sequence[int], max_new: int) -> Run:
        net = self.net
        net.reset()
        t0 = time.perf_counter()
        net.eval(list(prompt))
        tokens = [masked_argmax(self._last_logits(), self.stops)]
        t_first = t_last = time.perf_counter()
        while len(tokens) < max_new:
            net.eval([tokens[-1]])
            tokens.append(masked_argmax(self._last_logits(), self.stops))
            t_last = time.perf_counter()
        return Run(tokens, t_first - t0, t_last - t_first)

    def window_logits(self, ids: Sequence[int]) -> np.ndarray:
        if self._ppl_net is None:
            self._ppl_net = self._open(logits_all=True)
        net = self._ppl_net
        net.reset()
        net.eval(list(ids))
        return np.array(net.scores[:len(ids)], dtype=np.float32)

    def close(self) -> None:
        for n in (self._ppl_net, self.net):
            if n is not None and hasattr(n, "close"):
                n.close()
        self.net = self._ppl_net = None


#: variant kind -> its class (``build_variant``; the memory probe rebuilds a variant from its kind and arguments)
KINDS: dict[str, type[Variant]] = {"graphopt": GraphoptVariant, "pytorch": TorchVariant,
                                   "onnxruntime-genai": GenAIVariant, "llama.cpp": LlamaCppVariant}


def build_variant(kind: str, *, threads: int, **args) -> Variant:
    """A variant of ``kind`` at ``threads`` from its keyword arguments (plain JSON values)."""
    return KINDS[kind](threads=threads, **args)

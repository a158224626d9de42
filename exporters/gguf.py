"""GGUF files (llama.cpp's format): hyper-parameters, tokenizer facts, and each tensor's raw blocks.

``read(path)`` returns a :class:`GGUFModel`. Quantized tensors keep their blocks as stored:

* ``Q4_1``: block 32 along the input dimension K; per block an fp16 scale ``d``, an fp16 minimum
  ``m`` and 32 4-bit codes ``q`` (byte j holds element j in its low nibble and element j+16 in its
  high one); ``w = d·q + m``.
* ``Q8_0``: block 32; an fp16 scale ``d`` and 32 int8 codes; ``w = d·q``.

Other types (F32, F16, K-quants, ...) are dequantized with ``gguf.quants`` (:meth:`GGUFTensor.dequantize`);
:attr:`GGUFTensor.exact_blocks` says whether a tensor has an exact block form here.

Names: :func:`hf_name` maps a GGUF tensor name (``blk.3.attn_q.weight``) to the Hugging Face
parameter transformers gives the dequantized model (``model.layers.3.self_attn.q_proj.weight``).
llama.cpp stores the Q and K projections with their output rows permuted for its rotary layout;
transformers undoes that on load. :func:`row_order` gives the same permutation as an index over
output rows, so ``blocks[row_order]`` are the blocks of the Hugging Face weight: permuting rows
moves whole rows, the K-blocks of a row stay intact.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from graphopt.errors import ExportError

QK = 32  # block size of Q4_1 and Q8_0
BLOCK_TYPES = ("Q4_1", "Q8_0")

#: llama-family GGUF names -> Hugging Face names (per layer: ``{i}``)
_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
#: architectures whose names and Q/K permutation follow llama.cpp's llama converter
LLAMA_LIKE = ("llama", "mistral")


@dataclasses.dataclass
class GGUFTensor:
    """One tensor of a GGUF file; 2-D weights are ``[rows N, columns K]`` (torch's Linear layout)."""

    name: str
    type: str  # GGMLQuantizationType name: "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, ...]  # rows first (numpy order)
    raw: np.ndarray  # as stored: uint8 [N, bytes per row] for quantized types, else the values

    @property
    def exact_blocks(self) -> bool:
        return self.type in BLOCK_TYPES and len(self.shape) == 2 and self.shape[1] % QK == 0

    def _blocks(self, width: int) -> np.ndarray:
        n, k = self.shape
        return np.ascontiguousarray(self.raw).reshape(n, k // QK, width)

    def q4_1(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q uint8 [N, K] in 0..15, d float16 [N, K/32], m float16 [N, K/32])``."""
        self._expect("Q4_1")
        b = self._blocks(4 + QK // 2)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
        qs = b[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15 low nibbles, 16..31 high
        return q.reshape(self.shape).astype(np.uint8), d, m

    def q8_0(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q int8 [N, K], d float16 [N, K/32])``."""
        self._expect("Q8_0")
        b = self._blocks(2 + QK)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        q = b[..., 2:].copy().view(np.int8)
        return q.reshape(self.shape), d

    def dequantize(self) -> np.ndarray:
        """fp32 values ``[N, K]`` (the same arithmetic as ``gguf.quants``: fp32 ``d*q + m``)."""
        if self.type == "Q4_1":
            q, d, m = self.q4_1()
            return dequantize_q4_1(q, d, m)
        if self.type == "Q8_0":
            q, d = self.q8_0()
            return dequantize_q8_0(q, d)
        if self.type in ("F32", "F16", "BF16"):
            return np.asarray(self.raw, dtype=np.float32).reshape(self.shape)
        import gguf

        return gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.type]).reshape(self.shape)

    def _expect(self, t: str) -> None:
        if self.type != t or not self.exact_blocks:
            raise ExportError(f"{self.name}: a {self.type} tensor of shape {self.shape}, not {t} blocks of {QK}")


def dequantize_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    n, k = q.shape
    qb = q.reshape(n, k // QK, QK).astype(np.float32)
    return (d.astype(np.float32)[..., None] * qb + m.astype(np.float32)[..., None]).reshape(n, k)


def dequantize_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    n, k = q.shape
    return (d.astype(np.float32)[..., None] * q.reshape(n, k // QK, QK).astype(np.float32)).reshape(n, k)


@dataclasses.dataclass
class GGUFModel:
    """What a GGUF file holds, read once."""

    path: Path
    architecture: str
    hparams: dict[str, object]  # "<arch>.*" keys without the prefix, e.g. "block_count"
    tokenizer: dict[str, object]  # "tokenizer.ggml.*" scalars (model, pre, bos/eos ids) and the vocab size
    tensors: dict[str, GGUFTensor]
    file_type: int | None = None

    @property
    def heads(self) -> int:
        return int(self.hparams["attention.head_count"])

    @property
    def kv_heads(self) -> int:
        return int(self.hparams.get("attention.head_count_kv", self.heads))

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.type] = out.get(t.type, 0) + 1
        return out

    def hf_tensors(self) -> dict[str, tuple[GGUFTensor, np.ndarray | None]]:
        """Hugging Face parameter name -> (GGUF tensor, row order or None); see :func:`row_order`."""
        out = {}
        for name, t in self.tensors.items():
            hf = hf_name(name, self.architecture)
            if hf is not None:
                out[hf] = (t, row_order(name, t.shape[0], self.heads, self.kv_heads, self.architecture))
        return out


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # an older gguf without contents(): the last part is the scalar
        return field.parts[field.data[-1]].tolist()[0] if field.data else None


def read(path: str | Path) -> GGUFModel:
    """Read ``path`` (tensors are memory-mapped views)."""
    try:
        import gguf
    except ImportError as e:
        raise ExportError("reading GGUF files needs the gguf package", hint="pip install 'graphopt[export]'") from e
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ExportError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e
    fields = reader.fields
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        raise ExportError(f"{path}: no general.architecture in the GGUF metadata")
    arch = str(_field_value(arch_field))
    hparams, tok = {}, {}
    for key, f in fields.items():
        if key.startswith(arch + "."):
            hparams[key[len(arch) + 1:]] = _field_value(f)
        elif key.startswith("tokenizer.ggml."):
            short = key[len("tokenizer.ggml."):]
            if short in ("tokens", "token_type", "merges", "scores"):
                if short == "tokens":
                    tok["vocab_size"] = len(f.data)
                continue
            tok[short] = _field_value(f)
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(list(t.shape)))  # GGUF lists ne0 (K) first
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data)
    ft = fields.get("general.file_type")
    return GGUFModel(path, arch, hparams, tok, tensors, int(_field_value(ft)) if ft is not None else None)


def hf_name(name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face parameter name of GGUF tensor ``name`` (None when unknown here)."""
    if architecture not in LLAMA_LIKE:
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        pattern = _LLAMA_NAMES.get("blk.{i}." + m.group(2))
        return pattern.format(i=m.group(1)) if pattern else None
    return _LLAMA_NAMES.get(name)


def row_order(name: str, rows: int, heads: int, kv_heads: int, architecture: str = "llama") -> np.ndarray | None:
    """Index over output rows taking the GGUF layout to the Hugging Face one (None: same order).

    The inverse of llama.cpp's rotary permutation, as transformers applies it on load
    (``reshape(h, rows/h/2, 2, ...).swapaxes(1, 2)``), with ``h`` the head count for Q and the KV
    head count for K.
    """
    if architecture not in LLAMA_LIKE:
        return None
    if ".attn_q." in name:
        h = heads
    elif ".attn_k." in name:
        h = kv_heads
    else:
        return None
    idx = np.arange(rows)
    return idx.reshape(h, rows // h // 2, 2).swapaxes(2, 1).reshape(rows)

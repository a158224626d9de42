"""A tiny llama GGUF written with ``gguf.GGUFWriter``: Q4_1 projections, a Q8_0 tied embedding, a byte-level BPE vocab.

The blocks are quantized here with numpy (llama.cpp's rounding), so the test knows every code, scale and minimum.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, QK = 64, 128, 2, 4, 2, 32


def quantize_q4_1(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 -> GGUF Q4_1 bytes ``[N, K/32*20]`` (d, m fp16; q low nibbles 0..15, high 16..31)."""
    n, k = w.shape
    b = w.reshape(n, k // QK, QK).astype(np.float32)
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    d = (hi - lo) / 15
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    q = np.clip(np.trunc((b - lo) * inv + 0.5), 0, 15).astype(np.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8), qs], axis=-1)
    return out.reshape(n, -1)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 -> GGUF Q8_0 bytes ``[N, K/32*34]`` (d fp16, 32 int8 codes)."""
    n, k = w.shape
    b = w.reshape(n, k // QK, QK).astype(np.float32)
    d = np.abs(b).max(-1, keepdims=True) / 127
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    q = np.clip(np.round(b * inv), -127, 127).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1).reshape(n, -1)


def _byte_vocab() -> tuple[list[str], list[str]]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = ["<|endoftext|>"] + [chr(c) for c in cs]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    return tokens, merges


def write(path: Path, seed: int = 0, pre: str = "gpt2") -> dict[str, np.ndarray]:
    """Write the tiny GGUF at ``path``; returns the GGUF bytes of each tensor by GGUF name. ``pre``: the
    pre-tokenizer name (llama.cpp knows GPT-2's as ``gpt-2``, not ``gpt2``)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges = _byte_vocab()
    vocab = len(tokens)
    head = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head)
    w.add_vocab_size(vocab)
    w.add_file_type(3)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    stored: dict[str, np.ndarray] = {}

    def add(name, data, qtype):
        stored[name] = data
        w.add_tensor(name, data, raw_dtype=qtype)

    Q41, Q80, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    add("token_embd.weight", quantize_q8_0(rng.standard_normal((vocab, HIDDEN)).astype(np.float32) * 0.5), Q80)
    for i in range(LAYERS):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head, HIDDEN), "attn_v": (KV_HEADS * head, HIDDEN),
                  "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
                  "ffn_down": (HIDDEN, INTER)}
        add(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), F32)
        add(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), F32)
        for short, shape in shapes.items():
            add(f"blk.{i}.{short}.weight", quantize_q4_1(rng.standard_normal(shape).astype(np.float32) * 0.15), Q41)
    add("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored

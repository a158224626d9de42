"""``q8-tables``: a GGUF Q8_0 token embedding / LM head read from its int8 blocks, exactly (no fp32 table).

A Q8_0 table (blocks of 32 int8 codes ``q``, one scale ``d`` each: ``w = d·q``; written by
``exporters.gguf_blocks`` as ``Reshape(Mul(Cast(codes), Cast(scales)))``) is folded by ONNX Runtime into a float
table at load: 4 bytes a weight, and the LM head reads all of it per token (113 MB for SmolLM2's 49,152 x 576
tied table). Its readers become ONNX Runtime contrib ops on the blocks themselves::

    ids ── Gather(table) ──▶ h           ==>  ids ── GatherBlockQuantized(q + 128, d; bits 8, block 32) ──▶ h
    x ── MatMul(Transpose(table)) ──▶ y  ==>  x ─┬─ MatMulNBits(hi; 16d) ──────────────── Add ──▶ y
                                                 └─ MatMulNBits(lo; d, zero points 0) ──┘

The LM head is not a single 8-bit ``MatMulNBits``: ONNX Runtime 1.32 has no fp32-activation kernel for 8 bits
(at ``accuracy_level`` 1 it dequantizes the whole weight per call, ~30x the fp32 MatMul; level 4 quantizes the
activations to int8, lossy). Instead each code ``u = q + 128`` (0..255) is split into its nibbles,
``u = 16·hi + lo``, so ``w = d·(u - 128) = 16d·(hi - 8) + d·(lo - 0)``: two 4-bit weights with scales ``16d``
and ``d``, the high one with ONNX Runtime's implied zero point 8 (its faster kernel), the low one with zero
points 0, every weight exact in fp32, both fp32-activation kernels (``accuracy_level`` 1): 1.25 bytes a weight
instead of 4. On SmolLM2's 49,152 x 576 head at batch 1, 1 thread (AMD EPYC, AVX-512): 3.19 ms against 3.85 ms
for the fp32 MatMul, and 4.40 ms for the earlier form, one kernel over ``Concat(x, x)`` with K = 2·576. The
products are those of the fp32 table; only the order of the fp32 summation differs (rounding, ~1e-7 relative).

Declined (graph unchanged, a note) where the table is not Q8_0 blocks (a plain float table: a dequantized export
has no blocks to keep; ``quantize-int4`` re-quantizes, lossy), or a reader is not in these forms (that reader
keeps the float table). The float table goes once nothing reads it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common.q8_table import add_initializer, prune_unread, q8_codes

BLOCK = 32


def _is(node: ir.Node, op: str) -> bool:
    return node.op_type == op and node.domain in ("", "ai.onnx")


def nibble_blocks(codes: np.ndarray, scales: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                   tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Q8_0 (int8 codes [N, blocks, 32], scales [N, blocks]) as two MatMulNBits 4-bit weights over the same K:
    the high nibbles (packed uint8 [N, blocks, 16], scales ``16d`` float32 [N·blocks]; implied zero point 8) and
    the low ones (packed codes, scales ``d``, packed zero points 0 uint8 [N, ceil(blocks / 2)])."""
    u = codes.astype(np.int16) + 128

    def pack(q: np.ndarray) -> np.ndarray:
        q = q.astype(np.uint8)
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)

    d = scales.astype(np.float32)
    n, nb = d.shape
    high = (pack(u >> 4), np.ascontiguousarray(d * np.float32(16)).reshape(-1))
    low = (pack(u & 15), np.ascontiguousarray(d).reshape(-1), np.zeros((n, (nb + 1) // 2), np.uint8))
    return high, low


class Q8TablesPass(GraphoptPass):
    """Read a Q8_0 embedding / LM head table from its int8 blocks (GatherBlockQuantized, 4-bit nibble MatMulNBits)."""

    name = "q8-tables"
    exact = True
    emits = ("com.microsoft::GatherBlockQuantized", "com.microsoft::MatMulNBits")
    in_default_recipe = False
    run_after = ("cleanup",)

    def __init__(self, *, embedding: bool = True, head: bool = True):
        super().__init__()
        for k, v in (("embedding", embedding), ("head", head)):
            if not isinstance(v, bool):
                raise UsageError(f"q8-tables.{k} must be true or false, got {v!r}")
        self.embedding, self.head = embedding, head

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        g = model.graph
        counts: dict[str, int] = {}
        notes: list[str] = []
        tables: dict[int, tuple[ir.Value, tuple[np.ndarray, np.ndarray]]] = {}
        for node in g:
            if _is(node, "Gather") or _is(node, "Transpose"):
                v = node.inputs[0]
                if v is not None and id(v) not in tables:
                    b = q8_codes(v)
                    if b is not None and b[0].shape[2] == BLOCK:
                        tables[id(v)] = (v, b)
        if not tables:
            notes.append("not applied: no Q8_0 table (Reshape(Mul(Cast(int8 codes), Cast(scales))), blocks of 32) "
                         "feeds a Gather or the LM head's Transpose")
            return PassResult(model, False, notes=notes)
        for v, (codes, scales) in tables.values():
            vocab, k = codes.shape[0], codes.shape[1] * codes.shape[2]
            for use in list(v.uses()):
                node = use.node
                if self.embedding and _is(node, "Gather") and use.idx == 0 \
                        and node.attributes.get_int("axis", 0) == 0:
                    self._gather(g, node, codes, scales)
                    counts["q8-embedding"] = counts.get("q8-embedding", 0) + 1
                elif self.head and _is(node, "Transpose") and list(node.attributes.get_ints("perm", [1, 0])) == [1, 0]:
                    n = sum(self._head(g, mm, codes, scales) for mm in
                            [u.node for u in node.outputs[0].uses() if _is(u.node, "MatMul") and u.idx == 1])
                    if n:
                        counts["q8-head"] = counts.get("q8-head", 0) + n
                        prune_unread(g, [node.outputs[0]])
            prune_unread(g, [v])
            left = [f"{u.node.op_type} {u.node.name}" for u in v.uses()]
            notes.append(f"Q8_0 table {v.name} [{vocab}, {k}]: " + (
                f"still read as float by {', '.join(left)}" if left else "no float copy left"))
        if counts:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        return PassResult(model, bool(counts), notes=notes, rule_counts=counts)

    @staticmethod
    def _gather(g: ir.Graph, node: ir.Node, codes: np.ndarray, scales: np.ndarray) -> None:
        vocab = codes.shape[0]
        data = add_initializer(g, f"{node.name or 'embedding'}.q8", (codes.astype(np.int16) + 128).astype(np.uint8)
                               .reshape(vocab, -1))
        sc = add_initializer(g, f"{node.name or 'embedding'}.scales8", np.ascontiguousarray(scales, np.float32))
        # uint8 data without zero points: the implied zero point of 8 bits is 128
        new = ir.node("GatherBlockQuantized", [data, node.inputs[1], sc],
                      {"gather_axis": 0, "quantize_axis": 1, "block_size": BLOCK, "bits": 8}, domain=MS_DOMAIN,
                      name=f"{node.name or 'embedding'}_q8")
        y = node.outputs[0]
        new.outputs[0].shape, new.outputs[0].type = y.shape, y.type
        ir.convenience.replace_nodes_and_values(g, node, [node], [new], [y], [new.outputs[0]])

    @staticmethod
    def _head(g: ir.Graph, mm: ir.Node, codes: np.ndarray, scales: np.ndarray) -> int:
        x = mm.inputs[0]
        k = codes.shape[1] * codes.shape[2]
        if x is None or (x.shape is not None and isinstance(x.shape[-1], int) and x.shape[-1] != k):
            return 0
        (hq, hs), (lq, ls, lz) = nibble_blocks(codes, scales)
        stem = mm.name or "lm_head"
        attrs = {"K": k, "N": codes.shape[0], "bits": 4, "block_size": BLOCK, "accuracy_level": 1}
        high = ir.node("MatMulNBits", [x, add_initializer(g, f"{stem}.high_nibbles", hq),
                                       add_initializer(g, f"{stem}.high_scales", hs)],
                       attrs, domain=MS_DOMAIN, name=f"{stem}_q8_high")
        low = ir.node("MatMulNBits", [x, add_initializer(g, f"{stem}.low_nibbles", lq),
                                      add_initializer(g, f"{stem}.low_scales", ls),
                                      add_initializer(g, f"{stem}.low_zero_points", lz)],
                      attrs, domain=MS_DOMAIN, name=f"{stem}_q8_low")
        y = mm.outputs[0]
        both = ir.node("Add", [high.outputs[0], low.outputs[0]], name=f"{stem}_q8_sum")
        for v in (high.outputs[0], low.outputs[0], both.outputs[0]):
            v.shape, v.type = y.shape, y.type
        freed = list(mm.inputs)
        ir.convenience.replace_nodes_and_values(g, mm, [mm], [high, low, both], [y], [both.outputs[0]])
        prune_unread(g, freed[1:])
        return 1


register(Q8TablesPass)

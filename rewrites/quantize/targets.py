"""Quantization targets: the nodes whose float weight ``quantize`` can store in 8 (or 4) bits, and their plan.

A *target* is a node whose float weight can be stored in 8 (or 4) bits:

- ``MatMul(x, W)`` with a constant 2-D ``W`` (optionally followed by ``Add(·, b)`` with a constant
  ``b`` of length N, folded in as the bias; or by ``com.microsoft::BiasGelu(·, b)``, whose ``b`` is folded
  in likewise and which becomes ``com.microsoft::Gelu``: the integer op adds the bias in its output
  stage, and ORT's CPU Gelu is ~1.8x faster than BiasGelu, bit-identical; or by a ``Sum(·, r, b)``
  of three or more operands with one constant ``b`` of length N, folded in and dropped from the Sum);
- ``com.microsoft::Attention(x, W_qkv, b_qkv, mask)`` (the fused form; becomes ``QAttention``);
- ``Gather(table, ids)`` with a constant 2-D float table (embeddings; only when asked).

:class:`QConfig` is how one target is quantized (mode, format, activation range, SmoothQuant factors);
:mod:`.qdq` writes the replacements.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN
from graphopt.runtime.contrib import attention_inputs


@dataclasses.dataclass
class Target:
    """One quantizable node, identified by ``key`` (stable across clones of a model)."""

    key: str
    kind: str  # "matmul" | "attention" | "gather" | "embed_table"
    node: ir.Node
    act: ir.Value | None  # float activation input (None for gather)
    weight: ir.Value
    bias_add: ir.Node | None = None  # Add folded into the integer op
    bias_gelu: ir.Node | None = None  # BiasGelu whose bias is folded into the integer op (then plain Gelu)
    bias_sum: ir.Node | None = None  # Sum(y, ..., b): its constant b is folded into the integer op

    @property
    def weight_array(self) -> np.ndarray:
        """The float weight. One in external data is copied out and its file unmapped again: pages
        of a mapping count in the resident memory once read, so a pass reading every weight would
        otherwise end up holding the whole model."""
        tensor = self.weight.const_value
        if isinstance(tensor, ir.ExternalTensor):
            arr = np.array(tensor.numpy())
            release(tensor)
            return arr
        return tensor.numpy()

    @property
    def macs_per_row(self) -> int:
        w = self.weight.shape
        if self.kind in ("gather", "embed_table"):
            return 0
        return int(w[0]) * int(w[1]) if w is not None and len(w) == 2 else 0


@dataclasses.dataclass
class QConfig:
    """How to quantize one target."""

    mode: str  # "dynamic" | "static" | "int4" | "gather"
    act_range: tuple[float, float] | None = None  # static: calibrated (min, max)
    act_type: str = "u8"  # "u8" | "s8"
    fmt: str = "qop"  # "qop" | "qdq"
    weights: str = "s8"  # int8 weight storage: "s8" | "u8" (zero point 128) | "s7" (numeric.int8_weights)
    smooth: np.ndarray | None = None  # SmoothQuant: W rows *= smooth (x /= smooth is done upstream)
    block_size: int = 32
    accuracy_level: int = 4
    int4_q: tuple[np.ndarray, np.ndarray] | None = None  # GPTQ result: (q uint8 [K,N] in 0..15, scales [nb,N])
    whole_table_dq: bool = True  # embed_table: dequantize the whole table per run when it cannot be unfused


def const_array(v: ir.Value | None) -> np.ndarray | None:
    if v is None or v.const_value is None:
        return None
    try:
        return v.const_value.numpy()
    except Exception:  # noqa: BLE001 - unreadable external data etc.
        return None


def _is_float(v: ir.Value | None) -> bool:
    return v is not None and v.dtype in (ir.DataType.FLOAT, None)


def _key(node: ir.Node) -> str:
    return node.name or f"{node.op_type}:{node.outputs[0].name}"


def _plain_qkv(node: ir.Node, warr: np.ndarray) -> bool:
    """Attention that QAttention can run: no rotary width, and no ``qkv_hidden_sizes`` beyond equal thirds."""
    a = node.attributes
    if "rotary_embedding_dim" in a and a["rotary_embedding_dim"].value:
        return False
    if "qkv_hidden_sizes" in a:
        sizes = list(a["qkv_hidden_sizes"].value)
        if len(sizes) != 3 or len(set(sizes)) != 1 or sum(sizes) != warr.shape[1]:
            return False
    return True


def find_targets(model: ir.Model, *, embeddings: bool = False) -> list[Target]:
    """Quantizable nodes of the main graph, in graph order."""
    out: list[Target] = []
    for node in model.graph:
        if node.op_type == "MatMul" and node.domain == "":
            x, w = node.inputs[0], node.inputs[1]
            warr = const_array(w)
            if warr is None or warr.ndim != 2 or warr.dtype != np.float32 or const_array(x) is not None:
                continue
            if not _is_float(x) or x is None:
                continue
            bias_add = bias_gelu = bias_sum = None
            y = node.outputs[0]
            uses = list(y.uses())
            if len(uses) == 1 and not y.is_graph_output():
                user, idx = uses[0]
                if user.op_type == "Add" and user.domain == "" and len(user.inputs) == 2:
                    b = const_array(user.inputs[1 - idx])
                    if b is not None and b.dtype == np.float32 and b.shape == (warr.shape[1],):
                        bias_add = user
                elif user.op_type == "BiasGelu" and user.domain == MS_DOMAIN and idx == 0 and len(user.inputs) == 2:
                    b = const_array(user.inputs[1])
                    if b is not None and b.dtype == np.float32 and b.shape == (warr.shape[1],):
                        bias_gelu = user
                elif user.op_type == "Sum" and user.domain == "" and sum_bias_index(user, idx, warr.shape[1]) is not None:
                    bias_sum = user
            out.append(Target(_key(node), "matmul", node, x, w, bias_add, bias_gelu, bias_sum))
        elif node.op_type == "Attention" and node.domain == MS_DOMAIN:
            a = attention_inputs(node)
            warr = const_array(a.weights)
            if warr is None or warr.ndim != 2 or warr.dtype != np.float32:
                continue
            if a.past_state or a.attention_bias is not None or not _plain_qkv(node, warr):
                continue
            if len(node.outputs) > 1 and any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
                continue
            out.append(Target(_key(node), "attention", node, a.input, a.weights))
        elif embeddings and node.op_type == "Gather" and node.domain == "":
            warr = const_array(node.inputs[0])
            if warr is None or warr.ndim != 2 or warr.dtype != np.float32 or warr.shape[0] < 2:
                continue
            if node.attributes.get_int("axis", 0) != 0:
                continue
            out.append(Target(_key(node), "gather", node, None, node.inputs[0]))
        elif embeddings and node.op_type == "EmbedLayerNormalization" and node.domain == MS_DOMAIN:
            warr = const_array(node.inputs[2]) if len(node.inputs) > 2 else None
            if warr is None or warr.ndim != 2 or warr.dtype != np.float32:
                continue
            out.append(Target(_key(node), "embed_table", node, None, node.inputs[2]))
    return out


def release(tensor) -> None:
    """Unmap a tensor read from external data (mapped again if read again): pages of a mapping count
    in the resident memory once touched."""
    if isinstance(tensor, ir.ExternalTensor):
        try:
            tensor.release()
        except BufferError:  # an array still views the mapping: leave it mapped
            pass


def sum_bias_index(node: ir.Node, idx: int, n: int) -> int | None:
    """The input index of the one constant ``[n]`` float operand of ``Sum`` (read by it alone), when the Sum
    keeps at least two other operands; else None."""
    if len(node.inputs) < 3:
        return None
    found = [i for i, v in enumerate(node.inputs) if i != idx and const_array(v) is not None]
    if len(found) != 1:
        return None
    v = node.inputs[found[0]]
    b = const_array(v)
    ok = b.dtype == np.float32 and b.shape == (n,) and len(v.uses()) == 1 and not v.is_graph_output()
    return found[0] if ok else None

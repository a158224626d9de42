"""One attention layer as ``prune-heads`` sees it (fused or unfused) and the refusal of a graph it cannot prune.

Shared by :mod:`.layers` (fused attention ops) and :mod:`.unfused` (the exporters' MatMul/Softmax attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir


class Refusal(Exception):
    """A layer (or the graph) this pass cannot prune; the message is the note."""


@dataclasses.dataclass
class Layer:
    """One attention layer: its copies, projections and head geometry."""

    index: int
    copies: list[ir.Node]
    num_heads: int
    head_size: int
    out_matmul: ir.Node
    #: Attention: the packed QKV weight and bias; MHA: the Q, K, V MatMuls and the packed bias
    qkv_weight: ir.Value | None = None
    qkv_bias: ir.Value | None = None
    proj: tuple[ir.Node, ir.Node, ir.Node] | None = None
    reshapes: list[ir.Node] = dataclasses.field(default_factory=list)
    #: unfused attention: the Q/K/V bias Adds and the index of their constant [H] input
    proj_biases: list[tuple[ir.Node, int]] = dataclasses.field(default_factory=list)
    #: unfused attention: the values between the Q/K/V projections and the output projection
    region: list[ir.Value] | None = None

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_size

    @property
    def out_weight(self) -> ir.Value:
        return self.out_matmul.inputs[1]

    @property
    def model_dim(self) -> int:
        return int(self.out_weight.const_value.shape[1])

    def name(self) -> str:
        return f"layer {self.index} ({self.copies[0].op_type} {self.copies[0].name!r}" + (
            f" +{len(self.copies) - 1} copies)" if len(self.copies) > 1 else ")")

    def channels(self, heads: Iterable[int]) -> np.ndarray:
        """Context channels of ``heads`` (sorted)."""
        d = self.head_size
        return np.concatenate([np.arange(h * d, (h + 1) * d) for h in sorted(heads)]).astype(np.int64)


def const_array(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``v`` as an array (None: not a constant)."""
    t = None if v is None else ir.convenience.get_const_tensor(v)
    return None if t is None else t.numpy()

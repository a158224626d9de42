"""Named access to the inputs and attributes of ONNX Runtime's ``com.microsoft`` attention ops.

A contrib op's optional inputs are positional (``Attention(x, W, b, mask_index, past, attention_bias)``),
so code that reads them by index (``node.inputs[5]``) says nothing about what it reads and breaks
silently where two ops number the same input differently (``mask_index`` is input 3 of Attention and
5 of QAttention). Passes read them here by the names of ORT's operator schemas
(``docs/ContribOperators.md``; ``contrib_test.py`` checks the tables against the schemas of the
installed onnxruntime)::

    a = attention_inputs(node)            # Attention, MultiHeadAttention, PackedMultiHeadAttention, ...
    a.weights, a.mask_index, a.attention_bias, a.past_state
    attrs = attention_attributes(node)    # num_heads, scale, qkv_hidden_sizes, ...
    attention_input_list("MultiHeadAttention", query=q, key=k, value=v, key_padding_mask=m)

An input the op does not have (absent, empty, or not in its schema) reads as ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx_ir as ir

from graphopt.errors import GraphoptError
from graphopt.opsets import MS_DOMAIN

#: op type -> input names, in schema order (ORT docs/ContribOperators.md)
ATTENTION_SCHEMAS: dict[str, tuple[str, ...]] = {
    "Attention": ("input", "weights", "bias", "mask_index", "past", "attention_bias", "past_sequence_length"),
    "MultiHeadAttention": ("query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key",
                           "past_value", "past_sequence_length", "cache_indirection"),
    "PackedAttention": ("input", "weights", "bias", "token_offset", "cumulative_sequence_length", "attention_bias"),
    "PackedMultiHeadAttention": ("query", "key", "value", "bias", "token_offset", "cumulative_sequence_length",
                                 "attention_bias"),
    "QAttention": ("input", "weight", "bias", "input_scale", "weight_scale", "mask_index", "input_zero_point",
                   "weight_zero_point", "past"),
}
#: EmbedLayerNormalization's inputs (not an attention op; read the same way)
EMBED_SCHEMA: tuple[str, ...] = ("input_ids", "segment_ids", "word_embedding", "position_embedding",
                                 "segment_embedding", "gamma", "beta", "mask", "position_ids")

_PAST = ("past", "past_key", "past_value", "past_sequence_length", "cache_indirection")


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """The inputs of one com.microsoft attention op by schema name (``None``: absent or not in its schema)."""

    op_type: str
    input: ir.Value | None = None
    weights: ir.Value | None = None
    weight: ir.Value | None = None  # QAttention's name for weights
    query: ir.Value | None = None
    key: ir.Value | None = None
    value: ir.Value | None = None
    bias: ir.Value | None = None
    mask_index: ir.Value | None = None
    key_padding_mask: ir.Value | None = None
    attention_bias: ir.Value | None = None
    past: ir.Value | None = None
    past_key: ir.Value | None = None
    past_value: ir.Value | None = None
    past_sequence_length: ir.Value | None = None
    cache_indirection: ir.Value | None = None
    token_offset: ir.Value | None = None
    cumulative_sequence_length: ir.Value | None = None
    input_scale: ir.Value | None = None
    weight_scale: ir.Value | None = None
    input_zero_point: ir.Value | None = None
    weight_zero_point: ir.Value | None = None

    @property
    def mask(self) -> ir.Value | None:
        """The op's padding mask input: ``mask_index`` (Attention, QAttention) or ``key_padding_mask`` (MHA)."""
        return self.mask_index if self.mask_index is not None else self.key_padding_mask

    @property
    def past_state(self) -> tuple[ir.Value, ...]:
        """The past / cache inputs present (empty for self-attention without state)."""
        return tuple(v for v in (getattr(self, n) for n in _PAST) if v is not None)


@dataclasses.dataclass(frozen=True)
class EmbedInputs:
    """The inputs of a com.microsoft EmbedLayerNormalization by schema name."""

    input_ids: ir.Value | None = None
    segment_ids: ir.Value | None = None
    word_embedding: ir.Value | None = None
    position_embedding: ir.Value | None = None
    segment_embedding: ir.Value | None = None
    gamma: ir.Value | None = None
    beta: ir.Value | None = None
    mask: ir.Value | None = None
    position_ids: ir.Value | None = None


def _named(node: ir.Node, names: Sequence[str], inputs: Sequence[ir.Value | None] | None
           ) -> dict[str, ir.Value | None]:
    values = node.inputs if inputs is None else inputs
    if len(values) > len(names):
        raise GraphoptError(f"{node.op_type} {node.name!r} has {len(values)} inputs; its schema has "
                            f"{len(names)} ({', '.join(names)})")
    return dict(zip(names, values))


def is_attention(node: ir.Node, *op_types: str) -> bool:
    """``node`` is a com.microsoft attention op (of one of ``op_types`` when given)."""
    return node.domain == MS_DOMAIN and node.op_type in (op_types or ATTENTION_SCHEMAS)


def attention_inputs(node: ir.Node, inputs: Sequence[ir.Value | None] | None = None) -> AttentionInputs:
    """The inputs of a com.microsoft attention op (see ``ATTENTION_SCHEMAS``) by name.

    ``inputs``: read these instead of ``node.inputs`` (e.g. the replacements a rewrite made for them).
    """
    names = ATTENTION_SCHEMAS.get(node.op_type)
    if node.domain != MS_DOMAIN or names is None:
        raise GraphoptError(f"{node.op_type} {node.name!r} (domain {node.domain!r}) is not a com.microsoft "
                            f"attention op ({', '.join(ATTENTION_SCHEMAS)})")
    return AttentionInputs(node.op_type, **_named(node, names, inputs))


def embed_inputs(node: ir.Node, inputs: Sequence[ir.Value | None] | None = None) -> EmbedInputs:
    """The inputs of a com.microsoft EmbedLayerNormalization by name (``inputs``: as for ``attention_inputs``)."""
    if node.domain != MS_DOMAIN or node.op_type != "EmbedLayerNormalization":
        raise GraphoptError(f"{node.op_type} {node.name!r} is not a com.microsoft EmbedLayerNormalization")
    return EmbedInputs(**_named(node, EMBED_SCHEMA, inputs))


def attention_input_list(op_type: str, **named: ir.Value | None) -> list[ir.Value | None]:
    """Positional inputs of a new ``op_type`` node from named ones (trailing absent inputs dropped)."""
    names = ATTENTION_SCHEMAS[op_type]
    unknown = sorted(set(named) - set(names))
    if unknown:
        raise ValueError(f"{op_type} has no input {unknown[0]!r} (inputs: {', '.join(names)})")
    inputs = [named.get(n) for n in names]
    while inputs and inputs[-1] is None:
        inputs.pop()
    return inputs


@dataclasses.dataclass(frozen=True)
class AttentionAttributes:
    """The attributes of a com.microsoft attention op (absent ones: ``None`` or the schema default 0)."""

    #: ``op_type 'name'`` of the node, for messages
    where: str
    num_heads: int | None = None
    scale: float | None = None
    mask_filter_value: float | None = None
    qkv_hidden_sizes: tuple[int, ...] | None = None
    unidirectional: int = 0
    do_rotary: int = 0
    past_present_share_buffer: int = 0

    @property
    def stateless_bidirectional(self) -> bool:
        """Not causal, no rotary embedding, no shared past/present buffer."""
        return not (self.unidirectional or self.do_rotary or self.past_present_share_buffer)

    def qkv_sizes(self, width: int) -> list[int]:
        """Widths of Q, K, V in a packed QKV projection ``width`` wide (equal thirds by default)."""
        return list(self.qkv_hidden_sizes) if self.qkv_hidden_sizes else [width // 3] * 3

    def for_mha(self, *names: str) -> dict[str, int | float]:
        """Attributes of a new MultiHeadAttention-like op: ``num_heads`` and those of ``names`` that are set."""
        if self.num_heads is None:
            raise GraphoptError(f"{self.where} has no num_heads attribute")
        attrs: dict[str, int | float] = {"num_heads": int(self.num_heads)}
        for name in names:
            if getattr(self, name) is not None:
                attrs[name] = float(getattr(self, name))
        return attrs


def attention_attributes(node: ir.Node) -> AttentionAttributes:
    """The attributes of an attention op, read once."""
    a = node.attributes
    sizes = a.get_ints("qkv_hidden_sizes")
    return AttentionAttributes(
        where=f"{node.op_type} {node.name!r}",
        num_heads=a.get_int("num_heads"),
        scale=a.get_float("scale"),
        mask_filter_value=a.get_float("mask_filter_value"),
        qkv_hidden_sizes=tuple(int(s) for s in sizes) if sizes else None,
        unidirectional=a.get_int("unidirectional", 0),
        do_rotary=a.get_int("do_rotary", 0),
        past_present_share_buffer=a.get_int("past_present_share_buffer", 0),
    )

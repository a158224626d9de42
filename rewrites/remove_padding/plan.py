"""The plan of ``remove-padding``: which ops run packed, how each input enters, how attention runs.

``make_plan`` walks the graph once in topological order and returns a ``Plan`` (or raises ``Refusal``
with the reason). The questions it asks of a node (``_Planner.spec``, ``_Planner.attention_choice``)
are queries: they read the graph and the probed labels and write nothing. The plan is all the
rewrite (``emit.py``) needs: it does not ask again.
"""

from __future__ import annotations

import dataclasses
import enum

import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, node_domain
from graphopt.runtime.contrib import attention_attributes, attention_inputs, embed_inputs, is_attention

from .index import Lead
from .probe import TOKEN_DIMS, Dim, DimLabels
from .tokenwise import Mode, first_token_pool, input_modes, norm_axis

#: ops allowed between an unpacked value and the point where it is packed again (the attention core)
_CORE_OPS = frozenset(
    "Reshape Transpose MatMul Mul Div Add Sub Softmax Where IsNaN Not Cast Slice Squeeze Unsqueeze Expand "
    "Concat Shape Gather Sqrt Identity Split Equal And Or Neg ConstantOfShape Range Constant Max Min Less "
    "Greater LessOrEqual GreaterOrEqual".split()
)
#: fused attention ops the pass runs on packed tokens (or leaves in the attention core)
FUSED_ATTENTION = ("MultiHeadAttention", "Attention")
#: core ops allowed on shape vectors only: on data they could move values between positions
#: (e.g. CLS pooling, a token shift), which is exact only where the padding is
_SELECTING = frozenset("Slice Gather Concat Split Expand".split())


class Refusal(Exception):
    """The pass cannot prove the rewrite exact; the message says why."""


class AttentionStrategy(enum.Enum):
    """How a fused attention op runs on the packed tokens."""

    GROUPED = "grouped"  # MultiHeadAttention per length-sorted group of rows (CPU formulation)
    PACKED = "packed"  # com.microsoft PackedMultiHeadAttention on the packed rows (CUDA)


@dataclasses.dataclass(frozen=True)
class Step:
    """One op that runs packed: its input modes, output rank, how each input enters."""

    node: ir.Node
    modes: tuple[Mode, ...]
    rank: int
    #: per input: how an unpacked input is packed on entry (None: as it is, or its packed twin)
    entries: tuple[Lead | None, ...]
    attention: AttentionStrategy | None = None
    #: the layout of its outputs: 2 for ``[B, S, ...]`` (packed ``[1, N+1, ...]``), 1 for row-major
    #: ``[B*S, ...]`` (packed ``[N+1, ...]``)
    lead: int = 2
    #: first-token pooling (position 0 of each row): its output is ``[B, ...]`` (one row per sequence,
    #: read from the packed rows at each sequence's start), not a packed value
    pool: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``emit.rewrite`` needs: the steps in graph order, the labels, and notes for the report."""

    mask: ir.Value
    labels: DimLabels
    groups: int
    steps: tuple[Step, ...]
    notes: tuple[str, ...]

    def count(self, strategy: AttentionStrategy | None) -> int:
        """Number of steps with this attention strategy (None: the token-wise ops, not fused attention or pooling)."""
        return sum(1 for s in self.steps if s.attention is strategy and not s.pool)

    @property
    def pools(self) -> int:
        """Number of first-token poolings read from the packed rows."""
        return sum(1 for s in self.steps if s.pool)


def _static_weights(labels: DimLabels, weights: ir.Value | None) -> bool:
    """A ``[hidden, width]`` weight with static dims."""
    w = labels(weights)
    return w is not None and len(w) == 2 and all(isinstance(d, int) for d in w)


def _stateless(node: ir.Node) -> bool:
    """Self-attention without past state, causality, rotary embedding, or read extra outputs."""
    return (not attention_inputs(node).past_state and attention_attributes(node).stateless_bidirectional
            and not any(o.uses() for o in node.outputs[1:]))


def splittable_attention(node: ir.Node, labels: DimLabels) -> bool:
    """A com.microsoft Attention that becomes packed MatMul + MultiHeadAttention on unpacked Q/K/V."""
    if not is_attention(node, "Attention") or not _stateless(node):
        return False
    a = attention_inputs(node)
    if not _static_weights(labels, a.weights):
        return False
    # 3-D/4-D masks have no MultiHeadAttention key_padding_mask form
    return a.mask_index is None or labels.rank(a.mask_index) in (1, 2)


def make_plan(model: ir.Model, mask: ir.Value, labels: DimLabels, *, groups: int, packed_attention: bool) -> Plan:
    """The plan, or ``Refusal``. ``packed_attention``: fused attention may run as PackedMultiHeadAttention."""
    return _Planner(model, mask, labels, groups, packed_attention).plan()


def _forward_closure(roots, skip_shape: bool) -> set[int]:
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        for user, _ in v.uses():
            if skip_shape and user.op_type in ("Shape", "Size"):
                continue
            todo.extend(o for o in user.outputs)
    return seen


@dataclasses.dataclass(frozen=True)
class _Spec:
    modes: tuple[Mode, ...]
    rank: int
    lead: int = 2


class _Planner:
    """The analyses a plan is made from (computed once, read-only afterwards) and the walk that makes it."""

    def __init__(self, model: ir.Model, mask: ir.Value, labels: DimLabels, groups: int, packed_attention: bool):
        self.graph = model.graph
        self.mask = mask
        self.lab = labels
        self.groups = max(0, int(groups))
        self.packed_attention = packed_attention
        self.hidden = _forward_closure([v for v in self.graph.inputs if v is not mask], skip_shape=True)
        self.mask_derived = _forward_closure([mask], skip_shape=False)

    # ------------------------------------------------------------ queries (write nothing)

    def classify(self, v: ir.Value, rank: int, lead: int = 2) -> Lead | None:
        """How a non-packed operand of a rank-``rank`` token-wise op in layout ``lead`` is packed (None: it cannot be)."""
        labs = self.lab(v)
        if labs is None:
            return None
        if lead == 1:  # a [B*S, ...] op: the operand broadcasts (no token dims) or has the same rows
            if len(labs) > rank or any(d in TOKEN_DIMS for d in labs[1 if len(labs) == rank else 0:]):
                return None
            if len(labs) < rank or labs[0] == 1:
                return Lead.FREE
            return Lead.FLAT if labs[0] == Dim.BS and self.row_major_flat(v) else None
        k = len(labs)
        if k <= rank - 2:
            return Lead.FREE if not any(d in TOKEN_DIMS for d in labs) else None
        if any(d in TOKEN_DIMS for d in labs[2 - (rank - k):]):
            return None
        if k == rank - 1:
            return Lead.FREE if labs[0] == 1 else Lead.SEQUENCE if labs[0] == Dim.S else None
        if k != rank:
            return None
        pair = (labs[0], labs[1])
        if pair == (1, 1):
            return Lead.FREE
        if pair in (Lead.TOKENS.value, Lead.POSITIONS.value, Lead.ROWS.value):
            return Lead(pair)
        return None

    def row_major_flat(self, v: ir.Value) -> bool:
        """``v`` is ``Reshape(x [B, S, *fixed], [B*S, *fixed'])``: its rows are the tokens in row-major order.

        (A Reshape keeps the row-major element order and the element count, so row ``i`` of ``v`` holds
        exactly the values of token ``i`` of ``x``.)
        """
        p = v.producer()
        if p is None or node_domain(p) != "" or p.op_type != "Reshape":
            return False
        src, out = self.layout(p.inputs[0]), self.layout(v)
        return src is not None and src[1] == 2 and out is not None and out[1] == 1

    def token_major(self, v: ir.Value | None) -> int | None:
        """The rank of a ``[B, S, fixed...]`` value, else None."""
        layout = self.layout(v)
        return layout[0] if layout is not None and layout[1] == 2 else None

    def layout(self, v: ir.Value | None) -> tuple[int, int] | None:
        """(rank, lead) of a ``[B, S, fixed...]`` (lead 2) or ``[B*S, fixed...]`` (lead 1) value, else None."""
        labs = self.lab(v)
        if labs is None or not labs:
            return None
        lead = 2 if labs[:2] == Lead.TOKENS.value else 1 if labs[0] == Dim.BS else 0
        if not lead or any(d in TOKEN_DIMS for d in labs[lead:]):
            return None
        return len(labs), lead

    def spec(self, node: ir.Node) -> _Spec | None:
        """Input modes, output rank and layout when ``node`` is token-wise by op type and attributes, else None.

        Fused attention is not decided here (see ``attention_spec``).
        """
        if node.domain == MS_DOMAIN and node.op_type == "EmbedLayerNormalization":
            return self._spec_embed(node)
        outs = [o for o in node.outputs if o.name]
        if not outs:
            return None
        layouts = {self.layout(o) for o in outs}
        if len(layouts) != 1 or None in layouts:
            return None
        ((r, lead),) = layouts
        if node_domain(node) == "" and node.op_type == "Reshape":
            return self._spec_reshape(node, r, lead)
        modes = input_modes(node, self.lab, r, lead)
        return None if modes is None else _Spec(tuple(modes), r, lead)

    def _spec_reshape(self, node: ir.Node, r: int, lead: int) -> _Spec | None:
        """A Reshape that only merges or splits the token dims (``[B, S, *rest] <-> [B*S, *rest]``, or keeps them)."""
        src, out = self.layout(node.inputs[0]), self.lab(node.outputs[0])
        if src is None or self.lab(node.inputs[0])[src[1]:] != out[lead:]:
            return None
        return _Spec((Mode.OWN, Mode.SKIP), r, lead)

    def pool_spec(self, node: ir.Node, packed_values: dict[int, int]) -> _Spec | None:
        """First-token pooling (``tokenwise.first_token_pool``) of a packed ``[B, S, ...]`` value, else None."""
        x = node.inputs[0] if node.inputs else None
        if x is None or packed_values.get(id(x)) != 2:
            return None
        rank = first_token_pool(node, self.lab)
        return None if rank is None else _Spec((Mode.OWN,) + (Mode.SKIP,) * (len(node.inputs) - 1), rank)

    def _spec_embed(self, node: ir.Node) -> _Spec | None:
        """EmbedLayerNormalization: ids/segments/position ids are token inputs; runs as Gathers+LayerNorm."""
        outs = node.outputs
        if self.token_major(outs[0]) != 3:
            return None
        if len(outs) > 2 and outs[2].name and self.token_major(outs[2]) != 3:
            return None
        mask_index_used = len(outs) > 1 and bool(outs[1].uses())
        if mask_index_used and embed_inputs(node).mask is None:
            return None  # mask_index is used but there is no mask to compute it from
        if mask_index_used and node.attributes.get_int("mask_index_type", 1) != 1:
            return None
        own, param = Mode.OWN, Mode.PARAM
        modes = (own, own, param, param, param, param, param, Mode.SKIP, own)
        return _Spec(modes[: len(node.inputs)], 3)

    def attention_spec(self, node: ir.Node) -> _Spec | None:
        """Self-attention with a padding mask: runs on the packed tokens (length groups or packed)."""
        if self.token_major(node.outputs[0]) != 3 or any(o.uses() for o in node.outputs[1:]):
            return None
        if not attention_attributes(node).stateless_bidirectional:
            return None
        a = attention_inputs(node)
        if a.past_state:
            return None
        own, param, skip = Mode.OWN, Mode.PARAM, Mode.SKIP
        if node.op_type == "Attention":
            if self.token_major(a.input) != 3 or not _static_weights(self.lab, a.weights):
                return None
            modes = (own, param, param, skip, skip, skip)
        else:
            if any(self.token_major(x) != 3 for x in (a.query, a.key, a.value)):
                return None
            if a.bias is not None and self.lab.rank(a.bias) != 1:
                return None
            modes = (own, own, own, param, skip, skip)
        kpm, bias = a.mask, a.attention_bias
        if kpm is None and bias is None:
            return None  # nothing masks the padded keys: real outputs depend on padding
        if kpm is not None and (self.lab(kpm) != Lead.TOKENS.value or id(kpm) not in self.mask_derived):
            return None
        if bias is not None:
            lab = self.lab(bias)
            if lab is None or len(lab) != 4 or lab[0] not in (Dim.B, 1) or lab[1] != 1 or lab[2:] != (Dim.S, Dim.S):
                return None
            if bias.dtype not in (None, ir.DataType.FLOAT) or id(bias) not in self.mask_derived:
                return None
        return _Spec(modes[: len(node.inputs)], 3)

    def packed_attention_refusal(self, node: ir.Node) -> str | None:
        """Why a fused attention op cannot be PackedMultiHeadAttention (None: it can, exactly).

        PackedMultiHeadAttention masks by sequence lengths alone, so it is exact only when the op's
        mask is the key padding mask of the real tokens (the attention mask input itself) and there
        is no other attention bias.
        """
        a = attention_inputs(node)
        if node.op_type == "Attention":
            sizes = attention_attributes(node).qkv_hidden_sizes
            if sizes and sizes[0] != sizes[1]:
                return f"query and key widths differ ({sizes[0]} vs {sizes[1]})"
        else:
            wq, wk = self.lab(a.query), self.lab(a.key)
            if wq is None or wk is None or wq[2] != wk[2] or not isinstance(wq[2], int):
                return "query and key widths differ or are unknown"
        if a.attention_bias is not None:
            return (f"it has an attention bias {a.attention_bias.name!r} (PackedMultiHeadAttention masks by "
                    "sequence lengths only)")
        kpm = a.mask
        if kpm is None:
            return "it has no key padding mask"
        v = kpm
        while v is not self.mask:
            p = v.producer()
            if p is None or node_domain(p) != "" or p.op_type not in ("Cast", "Identity"):
                return (f"its mask {kpm.name!r} is not the attention mask {self.mask.name!r} itself (through "
                        "Cast/Identity), so it may not be a plain key padding mask")
            v = p.inputs[0]
        if node.outputs[0].dtype not in (None, ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return f"its type {node.outputs[0].dtype} is neither float nor float16"
        return None

    def attention_choice(self, node: ir.Node) -> tuple[AttentionStrategy | None, str | None]:
        """How a fused attention op runs packed (None: it stays on the padded batch) and why not packed."""
        reason = self.packed_attention_refusal(node) if self.packed_attention else None
        if self.packed_attention and reason is None:
            return AttentionStrategy.PACKED, None
        return (AttentionStrategy.GROUPED if self.groups > 0 else None), reason

    def _is_data(self, v: ir.Value) -> bool:
        """A tensor with batch/sequence-sized dims (not a shape vector or a scalar)."""
        labs = self.lab(v)
        return labs is None or (len(labs) >= 2 and any(d in TOKEN_DIMS for d in labs))

    # ------------------------------------------------------------ the walk

    def plan(self) -> Plan:
        steps: list[Step] = []
        notes: list[str] = []
        packed_values: dict[int, int] = {}  # packed value -> its layout (lead)
        fused = self.groups > 0 or self.packed_attention
        for node in self.graph:
            strategy, reason = None, None
            if is_attention(node, *FUSED_ATTENTION):
                spec = self.attention_spec(node) if fused else None
                if spec is not None:
                    strategy, reason = self.attention_choice(node)
                    if strategy is None:  # no length groups asked for: attention stays on the padded batch
                        notes.append(f"{_label(node)} stays on the padded batch (attention_groups=0), not "
                                     f"PackedMultiHeadAttention: {reason}")
                        continue
            else:
                spec = self.spec(node)
                pool = None if spec is not None else self.pool_spec(node, packed_values)
                if pool is not None:
                    steps.append(Step(node, pool.modes, pool.rank, (None,) * len(node.inputs), pool=True))
                    continue
            if spec is None:
                continue
            entries = self._entries(node, spec, packed_values)
            if entries is None:
                continue
            steps.append(Step(node, spec.modes, spec.rank, entries, strategy, lead=spec.lead))
            for o in node.outputs:
                layout = self.layout(o)
                if layout is not None and layout[1] == spec.lead:
                    packed_values[id(o)] = spec.lead
            if strategy is AttentionStrategy.GROUPED and reason is not None:
                notes.append(f"{_label(node)} runs as MultiHeadAttention per length group, not "
                             f"PackedMultiHeadAttention: {reason}")
        if not steps:
            raise Refusal("no token-wise op on hidden states found")
        self._check_core(steps)
        pools = [s.node for s in steps if s.pool]
        if pools:
            notes.append(f"{len(pools)} first-token pooling(s) ({_label(pools[0])}) read each sequence's first real "
                         "token from the packed rows: position 0 of a right-padded row; a row whose position 0 is "
                         "padding (left padding) pools its first real token instead")
        return Plan(self.mask, self.lab, self.groups, tuple(steps), tuple(notes))

    def _entries(self, node: ir.Node, spec: _Spec, packed_values: dict[int, int]) -> tuple[Lead | None, ...] | None:
        """How each input enters when ``node`` runs packed; None when it does not (no packed or hidden input)."""
        entries: list[Lead | None] = []
        trigger = False
        for x, mode in zip(node.inputs, spec.modes):
            entries.append(None)
            if x is None or mode is Mode.SKIP:
                continue
            if id(x) in packed_values:
                if mode is Mode.PARAM or (mode is Mode.BCAST and (self.lab.rank(x) != spec.rank
                                                                   or packed_values[id(x)] != spec.lead)):
                    return None
                trigger = True
                continue
            if mode is Mode.PARAM:
                labs = self.lab(x)
                if labs is None or any(d in TOKEN_DIMS for d in labs):
                    return None
                continue
            if mode is Mode.BCAST:
                lead = self.classify(x, spec.rank, spec.lead)
            else:  # a token input in its own layout
                labs = self.lab(x)
                lead = self.classify(x, len(labs), 1 if labs and labs[0] == Dim.BS else 2) if labs else None
            if lead is None:
                return None
            if lead in (Lead.TOKENS, Lead.FLAT) and id(x) in self.hidden:  # hidden-state data (not the mask alone)
                trigger = True
            entries[-1] = None if lead is Lead.FREE else lead
        return tuple(entries) if trigger else None

    def _check_core(self, steps: list[Step]) -> None:
        """Every op reached from an unpacked value before it is packed again is an attention-core op."""
        packed_set = {id(s.node) for s in steps}
        outputs = set(map(id, self.graph.outputs))
        frontier: list[ir.Node] = []
        for step in steps:
            if step.pool:  # its output is [B, ...] rows read from the packed tokens, not a packed value
                continue
            for o in step.node.outputs:
                for user, _ in o.uses():
                    if id(user) in packed_set or (user.op_type == "Shape" and not user.domain):
                        if user.op_type == "Shape" and id(user.outputs[0]) in outputs:
                            raise Refusal("a Shape of a packed value is a graph output")
                        continue
                    frontier.append(user)
        seen: set[int] = set()
        softmaxes: list[ir.Node] = []
        attention: list[ir.Node] = []
        while frontier:
            node = frontier.pop()
            if id(node) in seen or id(node) in packed_set:
                continue
            seen.add(id(node))
            if node_domain(node) == "" and node.op_type in _CORE_OPS:
                if node.op_type == "Softmax":
                    softmaxes.append(node)
                if node.op_type in _SELECTING and any(self._is_data(o) for o in node.outputs):
                    raise Refusal(f"{node.op_type} {node.name!r} selects or shifts positions of padded values")
            elif is_attention(node, *FUSED_ATTENTION):
                attention.append(node)
            else:
                raise Refusal(
                    f"{node.op_type} {node.name!r} mixes positions outside attention (reached from a packed value)"
                )
            for o in node.outputs:
                if id(o) in outputs:
                    raise Refusal(f"graph output {o.name!r} is computed from padded values by {node.op_type} {node.name!r}")
                frontier.extend(u for u, _ in o.uses())
        if seen and not softmaxes and not attention:
            raise Refusal("values leave the packed region but reach no attention softmax")
        for sm in softmaxes:
            if sm.inputs[0] is None or id(sm.inputs[0]) not in self.mask_derived:
                raise Refusal(f"Softmax {sm.name!r} does not depend on the attention mask")
            rank = self.lab.rank(sm.inputs[0])
            if norm_axis(sm.attributes.get_int("axis", -1), rank) != rank - 1:
                raise Refusal(f"Softmax {sm.name!r} is not over the last (key) axis")
        for att in attention:
            a = attention_inputs(att)
            if not any(m is not None and id(m) in self.mask_derived for m in (a.mask, a.attention_bias)):
                raise Refusal(f"{att.op_type} {att.name!r} has no mask input derived from the attention mask")


def _label(node: ir.Node) -> str:
    return f"{node.op_type} {node.name or node.outputs[0].name!r}"

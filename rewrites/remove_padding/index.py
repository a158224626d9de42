"""The pack/unpack index machinery of ``remove-padding``, built once from the ``[B, S]`` attention mask::

    flat    = Reshape(mask, [-1])                 [B*S]
    idx     = NonZero(flat)                       [1, N]    real-token flat positions
    idx_ext = Concat(idx, idx[0])                 [1, N+1]  plus the scratch row (flat position 0 if N=0)
    idx_s   = Mod(idx_ext, S), idx_b = Div(idx_ext, S)      sequence / batch index of each packed row
    pos_map = Where(flat != 0, CumSum(flat != 0) - 1, N) reshaped to [B, S]
                                                  packed row of each position (N = scratch row)

Packed tensors are ``[1, N+1, *rest]``: the N real tokens in row-major order plus one scratch row (a
copy of the first real token) that padded positions read when unpacked, so unpacking is one Gather and
every padded slot holds finite values of a real token::

    pack   [B, S, *rest] -> [1, N+1, *rest]:  Gather(Reshape(x, [B*S, *rest]), idx_ext, axis=0)
    unpack [1, N+1, *rest] -> [B, S, *rest]:  Gather(Squeeze(p, 0), pos_map, axis=0)

Attention on the packed rows: ``GroupIndex`` (length-sorted groups of rows for MultiHeadAttention, the
CPU formulation) and ``PackedAttentionIndex`` (``token_offset`` / ``cumulative_sequence_length`` of
com.microsoft PackedMultiHeadAttention, CUDA only).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from .probe import Dim


class Lead(enum.Enum):
    """The leading dimensions of an operand of a packed op, which say how it is packed."""

    FREE = "free"  # no batch/sequence dims (or [1, 1, ...]): used as it is
    TOKENS = (Dim.B, Dim.S)  # [B, S, ...]: gathered by token
    POSITIONS = (1, Dim.S)  # [1, S, ...]: gathered by each token's sequence index
    ROWS = (Dim.B, 1)  # [B, 1, ...]: gathered by each token's batch index
    SEQUENCE = (Dim.S,)  # [S, ...], one rank below the op: gathered by sequence index
    FLAT = (Dim.BS,)  # [B*S, ...] rows in row-major (batch, position) order: gathered by token, kept flat


_CONSTANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _constant(tape: ir.tape.Tape, key: tuple, array: np.ndarray) -> ir.Value:
    """One Constant node per distinct int64 value per tape."""
    cache = _CONSTANTS.setdefault(tape, {})
    if key not in cache:
        cache[key] = tape.op("Constant", [], {"value": ir.tensor(array)})
    return cache[key]


def const_ints(tape: ir.tape.Tape, values: Sequence[int]) -> ir.Value:
    """A Constant node holding a 1-D int64 tensor (shared per tape)."""
    vals = tuple(int(v) for v in values)
    return _constant(tape, ("1d", vals), np.asarray(vals, dtype=np.int64))


def const_scalar(tape: ir.tape.Tape, value: int) -> ir.Value:
    """A Constant node holding an int64 scalar (shared per tape)."""
    return _constant(tape, ("0d", int(value)), np.asarray(int(value), dtype=np.int64))


class PackIndex:
    """The index values computed once from the mask, and pack/unpack builders that use them."""

    def __init__(self, tape: ir.tape.Tape, mask: ir.Value):
        self.tape = tape
        self.mask = mask
        t = tape
        self.mask_shape = t.op("Shape", [mask])  # [B, S]
        flat = t.op("Reshape", [mask, const_ints(t, [-1])])
        self.is_real = t.op("Cast", [flat], {"to": ir.DataType.BOOL})
        self.idx = t.op("NonZero", [self.is_real])  # [1, N] int64
        self.idx.name = "packing_token_index"
        # the scratch row N: a copy of the first real token (flat position 0 when there is none)
        first = t.op("Gather", [t.op("Pad", [t.op("Reshape", [self.idx, const_ints(t, [-1])]), const_ints(t, [0, 1])]),
                                const_ints(t, [0])], {"axis": 0})
        self.idx_ext = t.op("Concat", [self.idx, t.op("Unsqueeze", [first, const_ints(t, [0])])], {"axis": 1})
        self.idx_ext.name = "packing_row_index"  # [1, N + 1]
        seq = t.op("Gather", [self.mask_shape, const_scalar(t, 1)], {"axis": 0})
        self.idx_s = t.op("Mod", [self.idx_ext, seq])
        self.idx_b = t.op("Div", [self.idx_ext, seq])
        ones = t.op("Cast", [self.is_real], {"to": ir.DataType.INT64})
        rank = t.op("Sub", [t.op("CumSum", [ones, const_scalar(t, 0)]), const_scalar(t, 1)])
        total = t.op("Shape", [self.idx], {"start": 1, "end": 2})  # [N]
        self.total = total
        flat_map = t.op("Where", [self.is_real, rank, total])
        self.pos_map = t.op("Reshape", [flat_map, self.mask_shape])  # [B, S]
        self.pos_map.name = "packing_position_map"
        self._packed: dict[tuple[int, Lead], ir.Value] = {}
        self._rows_index: ir.Value | None = None
        self._row_starts: ir.Value | None = None
        self._flat_map: ir.Value | None = None

    def pack(self, value: ir.Value, lead: Lead) -> ir.Value:
        """``value`` with leading dims ``lead`` -> ``[1, N+1, *rest]`` (one per value and lead)."""
        key = (id(value), lead)
        if key in self._packed:
            return self._packed[key]
        t = self.tape
        if lead is Lead.TOKENS:
            rest = t.op("Shape", [value], {"start": 2})
            flat = t.op("Reshape", [value, t.op("Concat", [const_ints(t, [-1]), rest], {"axis": 0})])
            out = t.op("Gather", [flat, self.idx_ext], {"axis": 0})
        elif lead is Lead.POSITIONS:
            out = t.op("Gather", [t.op("Squeeze", [value, const_ints(t, [0])]), self.idx_s], {"axis": 0})
        elif lead is Lead.ROWS:
            out = t.op("Gather", [t.op("Squeeze", [value, const_ints(t, [1])]), self.idx_b], {"axis": 0})
        elif lead is Lead.SEQUENCE:  # rank r-1 operand aligned with [S, *rest]
            out = t.op("Gather", [value, self.idx_s], {"axis": 0})
        elif lead is Lead.FLAT:  # [B*S, *rest] -> [N+1, *rest]
            out = t.op("Gather", [value, self.rows_index], {"axis": 0})
        else:
            raise ValueError(f"cannot pack leading dims {lead}")
        out.name = f"{value.name}_packed" if value.name else None
        self._packed[key] = out
        return out

    @property
    def rows_index(self) -> ir.Value:
        """``[N+1]``: the flat position of each packed row (``idx_ext`` as a vector)."""
        if self._rows_index is None:
            self._rows_index = self.tape.op("Reshape", [self.idx_ext, const_ints(self.tape, [-1])])
        return self._rows_index

    @property
    def row_starts(self) -> ir.Value:
        """``[B]``: the packed row of each sequence's first real token (the real tokens of the rows before it)."""
        if self._row_starts is None:
            t = self.tape
            mask2d = t.op("Reshape", [t.op("Cast", [self.is_real], {"to": ir.DataType.INT64}), self.mask_shape])
            lengths = t.op("ReduceSum", [mask2d, const_ints(t, [1])], {"keepdims": 0})  # [B]
            self._row_starts = t.op("CumSum", [lengths, const_scalar(t, 0)], {"exclusive": 1})
            self._row_starts.name = "packing_row_starts"
        return self._row_starts

    def unpack(self, packed: ir.Value, name: str | None = None, *, flat: bool = False) -> ir.Value:
        """``[1, N+1, *rest]`` -> ``[B, S, *rest]``; padded positions get the scratch row (a real token's values).

        ``flat``: ``[N+1, *rest]`` -> ``[B*S, *rest]`` (the row-major flattened layout).
        """
        t = self.tape
        if flat:
            if self._flat_map is None:
                self._flat_map = t.op("Reshape", [self.pos_map, const_ints(t, [-1])])
            out = t.op("Gather", [packed, self._flat_map], {"axis": 0})
            if name:
                out.name = name
            return out
        rows = t.op("Squeeze", [packed, const_ints(t, [0])])  # [N + 1, *rest]
        out = t.op("Gather", [rows, self.pos_map], {"axis": 0})
        if name:
            out.name = name
        return out

    def unpack_zeros(self, packed: ir.Value, rank: int, dtype: ir.DataType | None, *, flat: bool = False) -> ir.Value:
        """Like :meth:`unpack`, with zeros at padded positions (for graph outputs)."""
        t = self.tape
        keep = self.is_real if flat else t.op("Reshape", [self.is_real, self.mask_shape])
        lead = 1 if flat else 2
        if rank > lead:
            keep = t.op("Unsqueeze", [keep, const_ints(t, list(range(lead, rank)))])
        np_dtype = dtype.numpy() if dtype is not None else np.dtype(np.float32)
        zero = t.op("Constant", [], {"value": ir.tensor(np.zeros((), dtype=np_dtype))})
        return t.op("Where", [keep, self.unpack(packed, flat=flat), zero])

    def real_rows(self, packed: ir.Value, *, flat: bool = False) -> ir.Value:
        """``[1, N+1, *rest]`` (``flat``: ``[N+1, *rest]``) -> ``[N, *rest]`` (drops the scratch row)."""
        t = self.tape
        rows = t.op("Slice", [packed, const_ints(t, [0]), self.total, const_ints(t, [0 if flat else 1])])
        return rows if flat else t.op("Squeeze", [rows, const_ints(t, [0])])

    def padded_shape(self, packed: ir.Value, *, flat: bool = False) -> ir.Value:
        """The shape ``[B, S, *rest]`` (``flat``: ``[B*S, *rest]``) of the unpacked form of ``packed``."""
        t = self.tape
        rest = t.op("Shape", [packed], {"start": 1 if flat else 2})
        return t.op("Concat", [t.op("Shape", [self.is_real]) if flat else self.mask_shape, rest], {"axis": 0})


class GroupIndex:
    """Length-sorted groups of rows, for attention on compact per-group layouts (built once).

    Rows are sorted by real length (descending) and cut into ``groups`` consecutive groups of about
    ``B / groups`` rows (with ``nonempty``, a group left without rows when ``B < groups`` gets one row of
    filler slots); group ``g`` is laid out as ``[B_g, L_g]`` with ``L_g`` its longest row, real
    tokens first, filler slots (masked keys) after. ``map`` gives the packed row of each slot (the
    scratch row ``N`` for fillers), ``seq_pos`` its position in the original padded row, ``inverse`` the slot of each packed
    row in the concatenation of all groups (flattened).
    """

    def __init__(self, tape: ir.tape.Tape, index: PackIndex, groups: int, *, nonempty: bool = False):
        t = self.tape = tape
        self.index = index
        self.groups = groups
        mask2d = t.op("Reshape", [t.op("Cast", [index.is_real], {"to": ir.DataType.INT64}), index.mask_shape])
        lengths = t.op("ReduceSum", [mask2d, const_ints(t, [1])], {"keepdims": 0})  # [B]
        batch = t.op("Shape", [index.mask], {"start": 0, "end": 1})  # [1]
        self.seq = t.op("Shape", [index.mask], {"start": 1, "end": 2})  # [1]
        sorted_len, order = t.op_multi_out("TopK", [lengths, batch], {"axis": 0, "largest": 1, "sorted": 1},
                                           num_outputs=2)
        starts = t.op("CumSum", [lengths, const_scalar(t, 0)], {"exclusive": 1})  # first packed token of each row
        total = t.op("Squeeze", [index.total, const_ints(t, [0])])  # N (scalar)
        # sequence position of each packed row (the scratch row N included: fillers read it)
        seq_pos_tok = t.op("Reshape", [index.idx_s, const_ints(t, [-1])])
        self.rows: list[ir.Value] = []
        self.map: list[ir.Value] = []
        self.valid: list[ir.Value] = []
        self.seq_pos: list[ir.Value] = []
        tok_parts, slot_parts = [], []
        offset = const_scalar(t, 0)
        for g in range(groups):
            lo = t.op("Div", [t.op("Mul", [batch, const_ints(t, [g])]), const_ints(t, [groups])])
            hi = t.op("Div", [t.op("Mul", [batch, const_ints(t, [g + 1])]), const_ints(t, [groups])])
            rows = t.op("Slice", [order, lo, hi])  # [Bg]
            lens = t.op("Slice", [sorted_len, lo, hi])
            if nonempty:  # an empty group (B < groups) gets one row of filler slots: ONNX Attention needs B >= 1
                need = t.op("Sub", [const_ints(t, [1]), t.op("Min", [t.op("Shape", [rows]), const_ints(t, [1])])])
                pad = t.op("Slice", [const_ints(t, [0]), const_ints(t, [0]), need])  # [] or [0]
                rows = t.op("Concat", [rows, pad], {"axis": 0})
                lens = t.op("Concat", [lens, pad], {"axis": 0})
            longest = t.op("ReduceMax", [t.op("Concat", [lens, const_ints(t, [1])], {"axis": 0})], {"keepdims": 0})
            j = t.op("Range", [const_scalar(t, 0), longest, const_scalar(t, 1)])  # [Lg]
            first = t.op("Unsqueeze", [t.op("Gather", [starts, rows], {"axis": 0}), const_ints(t, [1])])
            tok = t.op("Add", [first, j])  # [Bg, Lg]
            valid = t.op("Less", [j, t.op("Unsqueeze", [lens, const_ints(t, [1])])])
            slot_map = t.op("Where", [valid, tok, total])
            self.rows.append(rows)
            self.map.append(slot_map)
            self.valid.append(valid)
            self.seq_pos.append(t.op("Gather", [seq_pos_tok, slot_map], {"axis": 0}))
            size = t.op("Size", [slot_map])
            slots = t.op("Reshape", [t.op("Range", [offset, t.op("Add", [offset, size]), const_scalar(t, 1)]),
                                     t.op("Shape", [slot_map])])
            offset = t.op("Add", [offset, size])
            flat_valid = t.op("Reshape", [valid, const_ints(t, [-1])])
            tok_parts.append(t.op("Compress", [t.op("Reshape", [slot_map, const_ints(t, [-1])]), flat_valid], {"axis": 0}))
            slot_parts.append(t.op("Compress", [t.op("Reshape", [slots, const_ints(t, [-1])]), flat_valid], {"axis": 0}))
        zeros = t.op("ConstantOfShape", [index.total], {"value": ir.tensor(np.zeros(1, np.int64))})
        inverse = t.op("ScatterElements", [zeros, t.op("Concat", tok_parts, {"axis": 0}),
                                           t.op("Concat", slot_parts, {"axis": 0})], {"axis": 0})
        # the scratch row takes slot 0 (group 0 is never empty of slots: L_g >= 1)
        inverse = t.op("Concat", [inverse, const_ints(t, [0])], {"axis": 0})
        self.inverse = t.op("Unsqueeze", [inverse, const_ints(t, [0])])  # [1, N + 1]
        self.inverse.name = "packing_group_inverse"
        self._rows_cache: dict[int, ir.Value] = {}
        self._bias_cache: dict[tuple[int, int], ir.Value] = {}

    def padded_rows(self, packed: ir.Value) -> ir.Value:
        """``[1, N+1, *rest]`` -> ``[N+1, *rest]`` (fillers read the scratch row N)."""
        if id(packed) not in self._rows_cache:
            self._rows_cache[id(packed)] = self.tape.op("Squeeze", [packed, const_ints(self.tape, [0])])
        return self._rows_cache[id(packed)]

    def gather(self, packed: ir.Value, g: int) -> ir.Value:
        """Group ``g`` layout ``[B_g, L_g, *rest]`` of a packed value (filler slots: the scratch row)."""
        return self.tape.op("Gather", [self.padded_rows(packed), self.map[g]], {"axis": 0})

    def attention_bias(self, bias: ir.Value, lead_batch: bool, g: int, fill: float) -> ir.Value:
        """Group ``g`` of a ``[B|1, 1, S, S]`` additive bias: ``[B_g, 1, L_g, L_g]``, filler keys = ``fill``."""
        key = (id(bias), g)
        if key not in self._bias_cache:
            t = self.tape
            flat = t.op("Reshape", [bias, const_ints(t, [-1])])
            pos = self.seq_pos[g]  # [Bg, Lg]
            seq = t.op("Squeeze", [self.seq, const_ints(t, [0])])
            idx = t.op("Add", [t.op("Unsqueeze", [t.op("Mul", [pos, seq]), const_ints(t, [2])]),
                               t.op("Unsqueeze", [pos, const_ints(t, [1])])])  # [Bg, Lg, Lg]
            if lead_batch:
                base = t.op("Mul", [self.rows[g], t.op("Mul", [seq, seq])])
                idx = t.op("Add", [idx, t.op("Unsqueeze", [base, const_ints(t, [1, 2])])])
            vals = t.op("Gather", [flat, idx], {"axis": 0})
            keys_valid = t.op("Unsqueeze", [self.valid[g], const_ints(t, [1])])  # [Bg, 1, Lg]
            fill_v = t.op("Constant", [], {"value": ir.tensor(np.asarray(fill, dtype=np.float32))})
            vals = t.op("Where", [keys_valid, vals, fill_v])
            self._bias_cache[key] = t.op("Unsqueeze", [vals, const_ints(t, [1])])
        return self._bias_cache[key]

    def key_mask(self, mask: ir.Value, g: int) -> ir.Value:
        """Group ``g`` of a ``[B, S]`` key padding mask: ``[B_g, L_g]`` int32, fillers 0."""
        key = (id(mask), g)
        if key not in self._bias_cache:
            t = self.tape
            flat = t.op("Reshape", [mask, const_ints(t, [-1])])
            seq = t.op("Squeeze", [self.seq, const_ints(t, [0])])
            idx = t.op("Add", [t.op("Unsqueeze", [t.op("Mul", [self.rows[g], seq]), const_ints(t, [1])]),
                               self.seq_pos[g]])
            keep = t.op("And", [t.op("Cast", [t.op("Gather", [flat, idx], {"axis": 0})], {"to": ir.DataType.BOOL}),
                                self.valid[g]])
            self._bias_cache[key] = t.op("Cast", [keep], {"to": ir.DataType.INT32})
        return self._bias_cache[key]


class PackedAttentionIndex:
    """``token_offset`` and ``cumulative_sequence_length`` of com.microsoft PackedMultiHeadAttention (built once).

    The op takes the packed rows ``[N+1]`` as sequences: ``cumulative_sequence_length`` ``[B'+1]``
    (int32) gives each sequence's run of rows (what the fused CUDA kernels read), ``token_offset``
    ``[B', L]`` (int32) each row's slot in a right-padded ``[B', L]`` layout, the rows' slots first in
    row order, then the padding slots (what the unfused CUDA kernel reads)::

        lengths   = real tokens per row ++ [1]                  [B+1]   (the scratch row N: one more sequence)
        cu        = [0, cumsum(lengths)]                        [B+2]
        L         = max(lengths)                                (>= 1)
        valid     = j < lengths[b] over the grid (b, j)         [B+1, L]
        token_offset = Compress(b*L + j, valid) ++ Compress(b*L + j, not valid), as [B+1, L]

    The packed rows are the real tokens in row-major (batch, position) order, so row b's real tokens
    are one contiguous run: sequence b of a *virtual right-padded layout*, whatever the padding side
    or holes in the mask (attention under a key padding mask does not depend on where in the row the
    keys sit; positions were added to the embeddings before). The scratch row is a sequence of its
    own, so the op takes the packed rows as they are (token_count N+1, never 0) and the scratch row's
    context is finite. ``L`` is the longest row, not the padded length, so the unfused kernel's
    padded work is as small as it can be.
    """

    def __init__(self, tape: ir.tape.Tape, index: PackIndex):
        t = self.tape = tape
        mask2d = t.op("Reshape", [t.op("Cast", [index.is_real], {"to": ir.DataType.INT64}), index.mask_shape])
        lengths = t.op("ReduceSum", [mask2d, const_ints(t, [1])], {"keepdims": 0})  # [B]
        lengths = t.op("Concat", [lengths, const_ints(t, [1])], {"axis": 0})  # [B+1]
        cum = t.op("Concat", [const_ints(t, [0]), t.op("CumSum", [lengths, const_scalar(t, 0)])], {"axis": 0})
        self.cumulative_sequence_length = t.op("Cast", [cum], {"to": ir.DataType.INT32})
        self.cumulative_sequence_length.name = "packing_cumulative_sequence_length"
        longest = t.op("ReduceMax", [lengths], {"keepdims": 0})  # scalar >= 1
        j = t.op("Range", [const_scalar(t, 0), longest, const_scalar(t, 1)])  # [L]
        valid = t.op("Less", [t.op("Unsqueeze", [j, const_ints(t, [0])]),
                              t.op("Unsqueeze", [lengths, const_ints(t, [1])])])  # [B+1, L]
        grid = t.op("Concat", [t.op("Shape", [lengths]), t.op("Reshape", [longest, const_ints(t, [1])])], {"axis": 0})
        slots = t.op("Range", [const_scalar(t, 0), t.op("Mul", [t.op("Size", [lengths]), longest]), const_scalar(t, 1)])
        flat_valid = t.op("Reshape", [valid, const_ints(t, [-1])])
        offset = t.op("Concat", [t.op("Compress", [slots, flat_valid], {"axis": 0}),
                                 t.op("Compress", [slots, t.op("Not", [flat_valid])], {"axis": 0})], {"axis": 0})
        self.token_offset = t.op("Cast", [t.op("Reshape", [offset, grid])], {"to": ir.DataType.INT32})
        self.token_offset.name = "packing_token_offset"

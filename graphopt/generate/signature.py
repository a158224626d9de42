"""A decoder graph's IO contract, read from an ONNX Runtime session (or its inputs and outputs).

The contract (``exporters/tasks.py``, task ``causal-lm-with-past``)::

    input_ids       int64 [batch, sequence]
    attention_mask  int64 [batch, past_sequence + sequence]
    position_ids    int64 [batch, sequence]                        (optional)
    past_key_values.N.key / .value   [batch, kv_heads, past_sequence, head_dim]
    ->  logits      [batch, sequence, vocab]  (all positions)  or  [batch, vocab] / [batch, 1, vocab] (last only)
        present.N.key / .value       [batch, kv_heads, past_sequence + sequence, head_dim]

Anything else (no past, a past without its present, unknown inputs, dynamic kv_heads or head_dim, mixed cache
dtypes) is refused with one line naming what is wrong.

A graph whose attention is ``GroupQueryAttention`` (pass ``group-query-attention``) says so in its metadata
(``graphopt.kv_cache = shared-buffer``, ``graphopt.max_positions``): it takes one buffer
``[batch, kv_heads, max_length, head_dim]`` bound as both past and present, right-padded rows, and at most
``max_positions`` positions (its rotary caches).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate import kivi as kivi_form
from graphopt.generate import quant_cache

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")
_KIVI_PART = re.compile(r"^past_key_values\.\d+\.(key|value)\.(codes\d|scale|min)$")
_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
           "tensor(bfloat16)": None}


@dataclasses.dataclass(frozen=True)
class DecoderSignature:
    """What the runtime needs to know to drive a decoder graph."""

    layers: int
    past_names: tuple[tuple[str, str], ...]  # (key, value) input names per layer
    present_names: tuple[tuple[str, str], ...]  # (key, value) output names per layer
    kv_heads: int
    head_dim: int
    dtype: np.dtype  # of the cache tensors
    has_position_ids: bool
    logits_all_positions: bool  # False: the graph returns only the last position's logits
    vocab: int | None  # None when the logits' last axis is dynamic
    #: past and present share one buffer per cache tensor; rows are right-padded (GroupQueryAttention)
    shared_buffer: bool = False
    max_positions: int | None = None  # the most positions the graph supports, when it says
    #: the cache is held quantized at this many bits (``quant_cache``); ``head_dim`` is then the stored width
    kv_bits: int | None = None
    #: the graph takes ``logits_to_keep`` (pass ``logits-to-keep``): logits of the last N positions only
    logits_to_keep: bool = False
    #: the cache is in KIVI form (pass ``kivi-kv-cache``, ``graphopt.generate.kivi``): its format
    kivi: kivi_form.KiviFormat | None = None

    @property
    def cache_names(self) -> list[tuple[str, str]]:
        """(past input, present output) pairs, keys then values, layer by layer."""
        return [(p, q) for lp, lq in zip(self.past_names, self.present_names, strict=True) for p, q in zip(lp, lq)]


def _dims(arg) -> list:
    return list(arg.shape) if arg.shape is not None else []


#: the optional input of pass logits-to-keep: how many last positions get logits (0: all)
LOGITS_TO_KEEP = "logits_to_keep"
#: model metadata written by the group-query-attention pass
KV_CACHE_KEY, MAX_POSITIONS_KEY = "graphopt.kv_cache", "graphopt.max_positions"


def read_signature(session_or_io, outputs=None, *, name: str = "model",
                   metadata: dict[str, str] | None = None) -> DecoderSignature:
    """The DecoderSignature of ``session_or_io`` (an ORT session, or its ``get_inputs()`` with ``outputs``
    and the model's ``metadata``); UsageError in one line when the graph is not a decoder with past."""
    optional: set[str] = set()  # inputs with a default (initializers a caller may override)
    if outputs is None:
        inputs, outputs = session_or_io.get_inputs(), session_or_io.get_outputs()
        metadata = dict(session_or_io.get_modelmeta().custom_metadata_map)
        optional = {a.name for a in session_or_io.get_overridable_initializers()}
    else:
        inputs = session_or_io
    metadata = metadata or {}
    ins = {a.name: a for a in inputs}
    outs = {a.name: a for a in outputs}

    def refuse(why: str) -> UsageError:
        return UsageError(f"{name}: not a decoder with past: {why}",
                          hint="export it with graphopt export SRC -o OUT --task causal-lm-with-past")

    for req in ("input_ids", "attention_mask"):
        if req not in ins:
            raise refuse(f"no '{req}' input (inputs: {', '.join(ins) or 'none'})")
    if "logits" not in outs:
        raise refuse(f"no 'logits' output (outputs: {', '.join(outs) or 'none'})")
    kivi = None
    if metadata.get(KV_CACHE_KEY) == kivi_form.FORM:
        try:
            kivi = kivi_form.KiviFormat.loads(metadata.get(kivi_form.KIVI_KEY, "{}"))
        except (ValueError, UsageError) as e:
            raise refuse(str(e)) from None
    past: dict[tuple[int, str], str] = {}
    for n in ins:
        m = _PAST.match(n)
        if m:
            past[(int(m.group(1)), m.group(2))] = n
        elif kivi is not None and _KIVI_PART.match(n):
            continue
        elif n not in ("input_ids", "attention_mask", "position_ids", LOGITS_TO_KEEP):
            raise refuse(f"unexpected input '{n}'")
    if not past:
        raise refuse("no past_key_values.N.key/value inputs")
    present = {(int(m.group(1)), m.group(2)): n for n in outs if (m := _PRESENT.match(n))}
    layers = 1 + max(i for i, _ in past)
    pairs_in, pairs_out = [], []
    for i in range(layers):
        for kind in ("key", "value"):
            if (i, kind) not in past:
                raise refuse(f"no input 'past_key_values.{i}.{kind}'")
            if (i, kind) not in present:
                raise refuse(f"input 'past_key_values.{i}.{kind}' has no output 'present.{i}.{kind}'")
        pairs_in.append((past[(i, "key")], past[(i, "value")]))
        pairs_out.append((present[(i, "key")], present[(i, "value")]))
    axes = (2, 3) if kivi is not None else (1, 3)  # a KIVI cache is position-major
    shapes = {tuple(_dims(ins[n])[i] for i in axes) if len(_dims(ins[n])) == 4 else None for n in past.values()}
    if len(shapes) != 1 or None in shapes:
        raise refuse(f"past tensors are not all [batch, kv_heads, past_sequence, head_dim] alike ({sorted(map(str, shapes))})")
    kv_heads, head_dim = next(iter(shapes))
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int)):
        raise refuse(f"kv_heads and head_dim must be static (got {kv_heads}, {head_dim})")
    types = {ins[n].type for n in past.values()}
    try:  # a cache held quantized (pass quantize-kv-cache) says so in the metadata
        quant = quant_cache.cache_format(metadata, next(iter(types))) if len(types) == 1 else None
    except ValueError as e:
        raise refuse(str(e)) from None
    if quant is None and (len(types) != 1 or next(iter(types)) not in _DTYPES or _DTYPES[next(iter(types))] is None):
        raise refuse(f"cache dtype {', '.join(sorted(types))} is not float, float16 or double alike")
    dtype = quant[1] if quant else np.dtype(_DTYPES[next(iter(types))])
    for n in ("input_ids", "attention_mask", "position_ids"):
        if n in ins and ins[n].type != "tensor(int64)":
            raise refuse(f"'{n}' is {ins[n].type}, not tensor(int64)")
    logits = _dims(outs["logits"])
    if len(logits) not in (2, 3):
        raise refuse(f"'logits' has rank {len(logits)}, not [batch, sequence, vocab] or [batch, vocab]")
    # [batch, sequence, vocab] with a symbolic sequence: all positions; [batch, vocab] or [batch, 1, vocab]: last only
    all_positions = len(logits) == 3 and logits[1] != 1
    vocab = logits[-1] if isinstance(logits[-1], int) else None
    shared = metadata.get(KV_CACHE_KEY) == "shared-buffer"
    limit = metadata.get(MAX_POSITIONS_KEY, "")
    return DecoderSignature(layers, tuple(pairs_in), tuple(pairs_out), kv_heads, head_dim, dtype,
                            "position_ids" in ins, all_positions, vocab, shared_buffer=shared,
                            max_positions=int(limit) if limit.isdigit() else None, kv_bits=quant and quant[0],
                            logits_to_keep=LOGITS_TO_KEEP in ins or LOGITS_TO_KEEP in optional, kivi=kivi)


def last_logits(logits: np.ndarray) -> np.ndarray:
    """[batch, vocab] logits of the last position, whatever form the graph returns."""
    if logits.ndim == 2:
        return logits
    return logits[:, -1, :]

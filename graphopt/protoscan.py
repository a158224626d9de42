"""Read a large self-contained ONNX file without reading its weights: they stay in the file, as external data.

``onnx.load`` of a 400 MB model holds the file's bytes and the parsed proto at once (2x the file), and the
parsed weights stay in memory for the whole run (1x) beside every ONNX Runtime session's copy. Yet the
weights of a self-contained model already lie in its file, each as one contiguous ``raw_data`` field.
:func:`read_in_place` walks the protobuf's wire format (``ModelProto.graph`` -> ``GraphProto.initializer``
-> ``TensorProto.raw_data``), skipping the bytes of the large weights, and gives back the ModelProto with
those initializers turned into external-data references into the model file itself (``location`` the
file's name, ``offset`` and ``length`` of its ``raw_data`` bytes): onnx-ir memory-maps them on first use,
the checker and ONNX Runtime read them from the file in place (``graphopt.io.write_referencing`` points
at them, no copy). The tensors so read are marked (:func:`is_in_place`): the model is still self-contained,
and ``graphopt.io.save`` writes them inline again (``graphopt.protostream``).

Anything unusual (a repeated ``graph`` field, groups, a tensor with its ``raw_data`` given twice or
with ``external_data`` of its own; a file reached through a symlink or with several hard links, which
onnx-ir refuses as external data) reads the whole file with ``onnx.load`` instead: the model is the same.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import onnx
import onnx_ir as ir

from graphopt import protostream

#: initializers whose ``raw_data`` has at least this many bytes are left in the file (each is one mapping of
#: it, in onnx-ir and in ONNX Runtime: 2 GB at most of 1 MiB tensors stay well below Linux's 65530 mappings)
IN_PLACE_BYTES = 2**20
#: the onnx-ir tensor ``meta`` key that marks a tensor read in place from its (self-contained) model file
IN_PLACE = "graphopt.in_place"

_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data


class _Unusual(Exception):
    """The file is not laid out as this reader expects; read it whole instead."""


def _varint(buf, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(buf):
            raise _Unusual("truncated varint")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7
        if shift > 63:
            raise _Unusual("varint too long")


def _fields(buf, start: int, end: int):
    """``(field number, wire type, field start, value start, value end)`` for each field in ``buf[start:end]``."""
    pos = start
    while pos < end:
        key, vpos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, vend = _varint(buf, vpos)
        elif wire == 1:
            vend = vpos + 8
        elif wire == 2:
            n, vpos = _varint(buf, vpos)
            vend = vpos + n
        elif wire == 5:
            vend = vpos + 4
        else:
            raise _Unusual(f"wire type {wire}")
        if vend > end:
            raise _Unusual("field past its message")
        yield number, wire, pos, vpos, vend
        pos = vend


def _entry(number: int, payload: bytes) -> bytes:
    return protostream.varint(number << 3 | 2) + protostream.varint(len(payload)) + payload


def _tensor_in_place(buf, start: int, end: int, location: str) -> bytes | None:
    """The TensorProto at ``buf[start:end]`` as an external-data reference to its ``raw_data`` in the file, or
    None when it is to stay inline (small, no raw_data, strings)."""
    header = bytearray()
    raw = None
    for number, _, fstart, vstart, vend in _fields(buf, start, end):
        if number == _RAW_DATA:
            if raw is not None:
                raise _Unusual("raw_data twice")
            raw = (vstart, vend - vstart)
        else:
            header += buf[fstart:vend]
    if raw is None or raw[1] < IN_PLACE_BYTES:
        return None
    t = onnx.TensorProto.FromString(bytes(header))
    if t.external_data or t.data_location == onnx.TensorProto.EXTERNAL:
        raise _Unusual("a tensor with raw_data and external_data")
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED) or t.metadata_props:
        return None
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(raw[0])), ("length", str(raw[1]))):
        t.external_data.add(key=key, value=value)
    return t.SerializeToString()


def _scan(buf, location: str) -> tuple[bytes, list[str]]:
    """The model's bytes with its large initializers as references into the file, and their names."""
    out = bytearray()
    graphs = 0
    moved: list[str] = []
    for number, wire, fstart, vstart, vend in _fields(buf, 0, len(buf)):
        if number != _GRAPH or wire != 2:
            out += buf[fstart:vend]
            continue
        graphs += 1
        if graphs > 1:
            raise _Unusual("graph given twice")
        graph = bytearray()
        for gnumber, gwire, gstart, gvstart, gvend in _fields(buf, vstart, vend):
            ref = _tensor_in_place(buf, gvstart, gvend, location) if gnumber == _INITIALIZER and gwire == 2 else None
            if ref is None:
                graph += buf[gstart:gvend]
            else:
                graph += _entry(_INITIALIZER, ref)
                moved.append(onnx.TensorProto.FromString(ref).name)
        out += _entry(_GRAPH, bytes(graph))
    return bytes(out), moved


def read_in_place(path: str | Path) -> tuple[onnx.ModelProto, list[str]]:
    """``onnx.load(path, load_external_data=False)``, with the large weights of a self-contained file left in it
    as external data (see the module docstring), and the names of the initializers so left. Raises what
    ``onnx.load`` raises for a file that is no ONNX."""
    path = Path(path)
    # onnx-ir refuses external data through a link (a symlink out of the folder, a file of several hard links)
    if path.is_symlink() or path.stat().st_nlink > 1:
        return onnx.load(str(path), load_external_data=False), []
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            data, moved = _scan(buf, path.name)
    except (_Unusual, ValueError, OSError):
        return onnx.load(str(path), load_external_data=False), []
    return onnx.ModelProto.FromString(data), moved


def mark(model: ir.Model, names: list[str]) -> int:
    """Mark the main-graph initializers ``names`` (from :func:`read_in_place`) as read in place; returns how many."""
    n = 0
    for name in names:
        v = model.graph.initializers.get(name)
        if v is not None and isinstance(v.const_value, ir.ExternalTensor):
            v.const_value.meta[IN_PLACE] = True
            n += 1
    return n


def is_in_place(tensor) -> bool:
    """Whether ``tensor`` is a weight of a self-contained model read in place (:func:`read_in_place`)."""
    return isinstance(tensor, ir.ExternalTensor) and bool(tensor.meta.get(IN_PLACE))


def iter_tensor_protos(graph: onnx.GraphProto):
    """Every TensorProto of ``graph``: initializers, tensor attributes, and those of subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_tensor_protos(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_tensor_protos(g)


def inline(proto: onnx.ModelProto, model: ir.Model) -> onnx.ModelProto:
    """``proto`` (a serialization of ``model``) with the references to tensors read in place filled in with their
    bytes, in place: ``graphopt.protostream`` writes the large ones itself; these are the ones a pass moved
    out of its reach (a subgraph, a constant) or below its size."""
    sources = {str(t.location): Path(t.base_dir) for t in _tensors(model) if is_in_place(t)}
    for t in iter_tensor_protos(proto.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if info.get("location") not in sources:
            continue
        with open(sources[info["location"]] / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            t.raw_data = f.read(int(info["length"]))
        t.ClearField("data_location")
        del t.external_data[:]
    return proto


def _tensors(model: ir.Model):
    for g in model.graphs():
        for v in g.initializers.values():
            if v.const_value is not None:
                yield v.const_value
        for node in g:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    yield attr.value

"""A model's protobuf without copies of its large weights: for shape inference, and written one tensor at a time.

Serializing a whole ``ModelProto`` holds every weight twice more (the proto, then its bytes): for a 400 MB
encoder that is most of ``optimize``'s peak. Two things need less:

- shape inference needs the weights' shapes, not their bytes: :func:`serialize_without` gives the model
  without chosen initializers (their types stay in ``value_info``, as in a whole serialization), and the caller declares them as
  shaped inputs;
- saving: protobuf reads fields in any order, and a repeated field from several places, so
  :func:`write_model` writes the model without its large initializers, then extends its graph field (7)
  by one ``initializer`` entry (GraphProto field 5) per large tensor, each serialized on its own. The
  file is the same message ``onnx.load`` and ONNX Runtime read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir

#: initializers of at least this many bytes are written one at a time by ``write_model``
STREAM_TENSOR_BYTES = 2**20


def big_initializers(model: ir.Model, *, min_bytes: int = 0, min_elements: int = 0) -> list[tuple[str, ir.Value]]:
    """Main-graph initializers with data of at least ``min_bytes`` bytes and ``min_elements`` elements, in order."""
    return [(n, v) for n, v in model.graph.initializers.items()
            if v.const_value is not None and v.const_value.nbytes >= min_bytes and v.const_value.size >= min_elements]


def serialize_without(model: ir.Model, names: set[str],
                      serialize: Callable[[ir.Model], onnx.ModelProto] = ir.serde.serialize_model) -> onnx.ModelProto:
    """``serialize(model)`` with the initializers ``names`` left out; ``model`` is left as it was (order too)."""
    g = model.graph
    order = list(g.initializers.items())
    try:
        for n in names:
            g.initializers.pop(n)
        proto = serialize(model)
    finally:
        for n, _ in order:
            if n in g.initializers:
                g.initializers.pop(n)
        for n, v in order:
            g.initializers[n] = v
    return proto


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _header(name: str, value: ir.Value) -> bytes:
    """A TensorProto's fields but its data; the data follows as ``raw_data`` (field 9), written apart."""
    t = value.const_value
    proto = onnx.TensorProto(name=name, dims=[int(d) for d in t.shape], data_type=ir.DataType(t.dtype).value)
    if t.doc_string:
        proto.doc_string = t.doc_string
    return proto.SerializeToString()


def _streamable(value: ir.Value) -> bool:
    t = value.const_value
    return t.dtype != ir.DataType.STRING and not t.metadata_props


def release(tensor) -> None:
    """Unmap a weight read from external data once written (mapped again if read again): the pages of a
    mapping count in the resident memory once read, and saving reads every weight."""
    if isinstance(tensor, ir.ExternalTensor):
        try:
            tensor.release()
        except BufferError:  # an array still views the mapping: it stays mapped
            pass


def write_model(model: ir.Model, path: Path, serialize: Callable[[ir.Model], onnx.ModelProto]) -> int:
    """Write ``model`` to ``path`` as one self-contained file, large weights one at a time; returns its size.

    ``serialize`` turns the model without its large initializers into a ModelProto (the caller's own, with
    its error handling). Raises RuntimeError if a tensor's bytes do not match its declared size.
    """
    big = [(n, v) for n, v in big_initializers(model, min_bytes=STREAM_TENSOR_BYTES) if _streamable(v)]
    proto = serialize_without(model, {n for n, _ in big}, serialize)
    # a whole serialization types every initializer in value_info, initializers first: so does this file
    infos = {vi.name: vi for vi in proto.graph.value_info}
    infos.update({n: ir.serde.serialize_value(v) for n, v in big})
    inits = [n for n in model.graph.initializers if n in infos]
    ordered = [infos[n] for n in inits] + [vi for vi in proto.graph.value_info if vi.name not in set(inits)]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(ordered)
    headers = [_header(n, v) for n, v in big]
    sizes = [len(h) + 1 + len(varint(v.const_value.nbytes)) + v.const_value.nbytes for h, (_, v) in zip(headers, big)]
    graph_head = proto.graph.SerializeToString()
    proto.ClearField("graph")
    head = proto.SerializeToString()
    graph_len = len(graph_head) + sum(1 + len(varint(s)) + s for s in sizes)
    with open(path, "wb") as f:
        f.write(head)
        f.write(b"\x3a" + varint(graph_len))  # ModelProto field 7 (graph), length-delimited
        f.write(graph_head)
        for header, (n, v), size in zip(headers, big, sizes):
            data = v.const_value.tobytes()  # little-endian, as raw_data holds it
            if len(data) != v.const_value.nbytes:
                raise RuntimeError(f"tensor {n!r} gave {len(data)} bytes for {v.const_value.nbytes}")
            f.write(b"\x2a" + varint(size) + header)  # GraphProto field 5 (initializer)
            f.write(b"\x4a" + varint(len(data)))  # TensorProto field 9 (raw_data)
            f.write(data)
            del data
            release(v.const_value)
    return len(head) + 1 + len(varint(graph_len)) + graph_len

"""Load and save ONNX models over onnx-ir: external data, >2 GB models, atomic writes.

``load`` leaves external data memory-mapped (lazy). ``save`` writes into a temporary folder beside
the target, then renames the external-data file (if any) and the model file into place, model last,
so a reader never sees a half-written model. The input is never overwritten unless asked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

from graphopt import protoscan, protostream
from graphopt.errors import MissingFileError, ModelLoadError, ModelSaveError, OutputPathError, first_line
from graphopt.interrupt import uninterrupted

logger = logging.getLogger(__name__)

#: protobuf's hard limit is 2 GiB; stay clear of it
PROTO_LIMIT = 2**31 - 64 * 2**20
#: default external-data threshold for tensors when external data is used
EXTERNAL_THRESHOLD = 1024


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise MissingFileError(f"{path}: no such file", hint="check the path")
    if path.is_dir():
        raise MissingFileError(f"{path}: is a folder, not an ONNX file")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: file is empty", hint="expected an ONNX protobuf (.onnx)")


def load(path: str | os.PathLike, *, check_external: bool = True, in_place: bool = False) -> ir.Model:
    """Load an ONNX model; external data stays on disk (memory-mapped on first use).

    ``in_place``: the weights of a self-contained file of at least ``STREAM_BYTES`` stay in it too
    (``graphopt.protoscan``; ``save`` writes them inline again).
    Raises ModelLoadError for a missing, empty, truncated or non-ONNX file, or missing external data.
    """
    path = Path(path)
    _check_readable(path)
    left: list[str] = []
    try:
        if in_place and STREAM_BYTES <= path.stat().st_size < PROTO_LIMIT:
            proto, left = protoscan.read_in_place(path)
        else:
            proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise ModelLoadError(
            f"{path}: not a valid ONNX model ({type(e).__name__}: {first_line(e, default='parse failed')})",
            hint="the file may be truncated or not an ONNX protobuf",
        ) from None
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise ModelLoadError(f"{path}: not a valid ONNX model (no graph)", hint="expected an ONNX protobuf (.onnx)")
    _check_tensor_types(proto, path)
    if check_external:
        _check_external_files(proto, path)
    _stash_map_types(proto.graph)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read the ONNX graph: {e}") from None
    ir.external_data.set_base_dir(model.graph, str(path.parent))
    if left:
        protoscan.mark(model, left)
    notes = normalize(model)
    if notes:
        logger.info("%s: normalized on load: %s", path, "; ".join(notes))
    return model


#: ``model.meta`` key (kept in memory, never saved) listing what :func:`normalize` changed on load
NORMALIZED = "graphopt.normalized"


def _unsorted(graph: ir.Graph) -> bool:
    """Whether a node of ``graph`` (or of a subgraph) reads a value produced by a later node."""
    seen: set[int] = set()
    for node in graph:
        for v in node.inputs:
            if v is not None and v.producer() is not None and v.producer().graph is graph and id(v.producer()) not in seen:
                return True
        seen.add(id(node))
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH and _unsorted(attr.value):
                return True
            if attr.type == ir.AttributeType.GRAPHS and any(_unsorted(g) for g in attr.value):
                return True
    return False


def normalize(model: ir.Model) -> list[str]:
    """Bring a model that ONNX Runtime accepts but the ONNX checker refuses into checker form, in place.

    Today: nodes out of topological order (ORT runs them; the checker says "Nodes in a graph must be
    topologically sorted") are sorted, stably. Returns what was done, one phrase each, and records it in
    ``model.meta[NORMALIZED]`` for the report; a model already in form is left untouched.
    """
    notes = []
    if _unsorted(model.graph) or any(_unsorted(f) for f in model.functions.values()):
        try:
            model.graph.sort()
            for f in model.functions.values():
                f.sort()
        except ValueError as e:
            raise ModelLoadError(f"the graph has a cycle and cannot be sorted: {first_line(e)}") from None
        notes.append("nodes sorted into topological order")
    if notes:
        model.meta[NORMALIZED] = list(notes)
    return notes


_iter_tensor_protos = protoscan.iter_tensor_protos


_TYPE_KEY = "graphopt.type_proto"


def _has_map(t: onnx.TypeProto) -> bool:
    kind = t.WhichOneof("value")
    if kind == "map_type":
        return True
    if kind == "sequence_type":
        return _has_map(t.sequence_type.elem_type)
    if kind == "optional_type":
        return _has_map(t.optional_type.elem_type)
    return False


def _stash_map_types(graph: onnx.GraphProto) -> None:
    """onnx-ir cannot hold map types (scikit-learn's ZipMap output is a sequence of maps): the type of
    such a graph input or output is kept in a metadata entry (restored by ``_serialize``)."""
    for vi in [*graph.input, *graph.output]:
        if _has_map(vi.type):
            entry = vi.metadata_props.add()
            entry.key, entry.value = _TYPE_KEY, vi.type.SerializeToString().hex()
            vi.ClearField("type")
    keep = [vi for vi in graph.value_info if not _has_map(vi.type)]
    if len(keep) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(keep)


def _restore_map_types(proto: onnx.ModelProto) -> onnx.ModelProto:
    for vi in [*proto.graph.input, *proto.graph.output]:
        for i, entry in enumerate(vi.metadata_props):
            if entry.key == _TYPE_KEY:
                vi.type.ParseFromString(bytes.fromhex(entry.value))
                del vi.metadata_props[i]
                break
    return proto


_DATA_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}


def _check_tensor_types(proto: onnx.ModelProto, path: Path) -> None:
    for t in _iter_tensor_protos(proto.graph):
        if t.data_type not in _DATA_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has no valid data type ({t.data_type})",
                                 hint="the file may be corrupt")


def _check_external_files(proto: onnx.ModelProto, path: Path) -> None:
    for t in _iter_tensor_protos(proto.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        f = path.parent / loc
        if loc and (Path(loc).is_absolute() or not _inside(f, path.parent)):
            raise ModelLoadError(
                f"{path}: external data location {loc!r} of tensor {t.name!r} lies outside the model's folder",
                hint="external data files must lie in the model's folder or below it",
            )
        if not loc or not f.is_file():
            raise ModelLoadError(
                f"{path}: external data file {loc!r} of tensor {t.name!r} not found",
                hint=f"it must lie beside the model, in {path.parent}",
            )
        need = int(info.get("offset", 0)) + int(info.get("length", 0))
        if f.stat().st_size < need:
            raise ModelLoadError(
                f"{path}: external data file {loc!r} is too short for tensor {t.name!r} "
                f"({f.stat().st_size} bytes, needs {need})"
            )


def _inside(f: Path, folder: Path) -> bool:
    try:
        f.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def _serialize(model: ir.Model) -> onnx.ModelProto:
    """``ir.serde.serialize_model``, its failures (a hostile model's broken fields) as one error line."""
    try:
        return _restore_map_types(ir.serde.serialize_model(model))
    except Exception as e:
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ModelSaveError(f"cannot serialize the model: {type(cause).__name__}: {str(cause)[:200]}") from e


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of all initializers (and constant attributes) of the main graph and subgraphs."""
    total = 0
    for graph in [model.graph, *(g for g in _subgraphs(model.graph))]:
        for v in graph.initializers.values():
            if v.const_value is not None:
                total += v.const_value.nbytes
    return total


def _subgraphs(graph: ir.Graph):
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield attr.value
            elif attr.type == ir.AttributeType.GRAPHS:
                yield from attr.value


def check_output_path(src: str | os.PathLike | None, dst: str | os.PathLike, *, in_place: bool = False) -> Path:
    """Validate an output path before any work is done; returns it resolved."""
    dst = Path(dst)
    if src is not None and not in_place:
        s = Path(src)
        if s.exists() and (dst.resolve() == s.resolve() or (dst.exists() and os.path.samefile(s, dst))):
            raise OutputPathError(
                f"{dst}: output path is the input path", hint="choose another -o, or pass --in-place"
            )
    parent = dst.resolve().parent
    for p in [parent, *parent.parents]:
        if p.exists():
            if not p.is_dir():
                raise ModelSaveError(f"{dst}: cannot write here, {p} is a file, not a folder")
            break
    if dst.is_dir():
        raise ModelSaveError(f"{dst}: is a folder; give a file name ending in .onnx")
    return dst


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` so a reader never sees a half-written file.

    A new file beside the target, created with mode 0o666 so the kernel applies the process umask
    (as ``open()`` does; the umask is never read or changed), is renamed over ``path``.
    Raises ModelSaveError naming the path when it cannot be written.
    """
    p = Path(path)
    if p.is_dir():
        raise ModelSaveError(f"{p}: is a folder; give a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_beside(p)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            with uninterrupted():
                os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as e:
        raise ModelSaveError(f"{p}: cannot write: {e.strerror or e}") from None
    return p


def _create_beside(p: Path) -> tuple[int, Path]:
    """A new, uniquely named hidden file in ``p``'s folder, opened for writing."""
    for _ in range(100):
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {p}")


def save(
    model: ir.Model,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    src: str | os.PathLike | None = None,
    in_place: bool = False,
) -> Path:
    """Save ``model`` to ``path`` atomically.

    ``external_data``: True writes initializers to ``<name>.data`` beside the model; None decides:
    external when the model's weights came from external data (never a model file pointing into
    its input's data) or above ~2 GB, where protobuf cannot hold the model.
    """
    dst = check_output_path(src, path, in_place=in_place)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:  # weights read from external data are written out the same way, streaming
        external_data = _has_external(model, in_place=False) or tensor_bytes(model) >= PROTO_LIMIT
    data_name = dst.name + ".data"
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        tmp_model = tmpdir / dst.name
        if external_data:
            # Loading every external tensor first keeps the source readable while we write,
            # even when the output data file replaces the input's.
            ir.save(model, tmp_model, external_data=data_name, size_threshold_bytes=EXTERNAL_THRESHOLD)
        else:
            _save_inline(model, tmp_model)
        with uninterrupted():
            if external_data:
                os.replace(tmpdir / data_name, dst.parent / data_name)
            os.replace(tmp_model, dst)
    except OSError as e:
        raise ModelSaveError(f"{dst}: cannot write: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    logger.info("saved %s", dst)
    return dst


def _save_inline(model: ir.Model, path: Path) -> None:
    if tensor_bytes(model) >= STREAM_BYTES and not _has_external(model, in_place=False):  # one tensor at a time
        if protostream.write_model(model, path, _self_contained) >= PROTO_LIMIT:
            raise ModelSaveError(f"{path.name}: model over 2 GB; save it with external data")
        return
    proto = to_proto(model)  # external tensors read in: the file must not point into another's data
    if proto.ByteSize() >= PROTO_LIMIT:
        raise ModelSaveError(f"{path.name}: model over 2 GB; save it with external data")
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """Serialize to a self-contained ModelProto (external tensors are read into memory).

    The model itself is left as it is (its external tensors stay lazy).
    """
    if any(isinstance(v.const_value, ir.ExternalTensor) for g in model.graphs() for v in g.initializers.values()):
        model = ir.external_data.load_to_model(model.clone())
    return _serialize(model)


#: models whose tensors hold at least this many bytes, or whose weights lie in external data, reach
#: the checker and ORT as a temporary model file referencing the weights on disk (no in-memory copy)
STREAM_BYTES = 256 * 2**20


def streams(model: ir.Model) -> bool:
    """Whether ``materialize`` hands ``model`` over as a file with its weights on disk."""
    return _has_external(model) or tensor_bytes(model) >= min(STREAM_BYTES, PROTO_LIMIT)


def _has_external(model: ir.Model, *, in_place: bool = True) -> bool:
    """Whether a tensor of ``model`` lies in external data (``in_place=False``: not counting the weights of a
    self-contained file read in place, ``graphopt.protoscan``)."""
    return any(isinstance(t := v.const_value, ir.ExternalTensor) and (in_place or not protoscan.is_in_place(t))
               for g in model.graphs() for v in g.initializers.values())


def unmap(model: ir.Model) -> None:
    """Unmap the weights of ``model`` read from external data (mapped again when read again): a pass that read
    them leaves their pages resident in this process beside ONNX Runtime's own mapping of the same file."""
    for g in model.graphs():
        for v in g.initializers.values():
            protostream.release(v.const_value)


def _self_contained(model: ir.Model) -> onnx.ModelProto:
    """``_serialize(model)`` with the tensors read in place inline again (``graphopt.protoscan.inline``)."""
    return protoscan.inline(_serialize(model), model)


@contextlib.contextmanager
def materialize(model: ir.Model):
    """Yield something onnx.checker and ORT accept: a self-contained ModelProto for small models,
    else (see :func:`streams`) the path of a temporary model file whose weights stay on disk."""
    if not streams(model):
        yield to_proto(model)
        return
    folder = _external_folder(model)
    paths: list[Path] = []
    try:
        try:
            if folder is None:
                raise PermissionError("no external data")
            path = write_referencing(model, folder, f".graphopt-{secrets.token_hex(4)}", created=paths)
        except OSError as e:  # a read-only folder: a full copy in a temporary folder
            for p in paths:
                p.unlink(missing_ok=True)
            paths.clear()
            d = Path(tempfile.mkdtemp(prefix="graphopt-big-"))
            paths.append(d)
            if folder is not None:
                logger.info("cannot write beside %s (%s); copying the weights to %s", folder, e.strerror or e, d)
            path = write_referencing(model, d, "model")
        yield str(path)
    finally:
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _external_folder(model: ir.Model) -> Path | None:
    """The folder most of the model's external data lies in (by bytes), or None."""
    sizes: dict[Path, int] = {}
    for g in model.graphs():
        for v in g.initializers.values():
            t = v.const_value
            if isinstance(t, ir.ExternalTensor):
                d = (Path(t.base_dir) / t.location).resolve().parent
                sizes[d] = sizes.get(d, 0) + t.nbytes
    return max(sizes, key=sizes.__getitem__) if sizes else None


def write_referencing(model: ir.Model, folder: Path, stem: str, *, created: list[Path] | None = None) -> Path:
    """Write ``model`` as ``folder/<stem>.onnx`` without copying the weights already in ``folder``.

    External tensors whose files lie in ``folder`` stay where they are (the ONNX checker accepts
    external data only beside the model file, and no links); every other tensor above
    ``EXTERNAL_THRESHOLD`` is written, tensor by tensor, to ``folder/<stem>.data``. ``model`` itself
    is left as it is. The files made are appended to ``created``. Returns the model path.
    """
    created = [] if created is None else created
    folder = folder.resolve()
    work = model.clone()  # shares the tensors; only the clone's values are pointed elsewhere
    to_write: list[ir.Value] = []
    for g in work.graphs():
        for v in g.initializers.values():
            t = v.const_value
            if isinstance(t, ir.ExternalTensor) and not Path(t.location).is_absolute() \
                    and (Path(t.base_dir) / t.location).resolve().parent == folder \
                    and Path(t.base_dir).resolve() == folder:
                continue
            if t is not None and t.nbytes > EXTERNAL_THRESHOLD:
                to_write.append(v)
    path, data = folder / f"{stem}.onnx", folder / f"{stem}.data"
    created += [path, data]
    new = ir.external_data.convert_tensors_to_external([v.const_value for v in to_write], folder, data.name)
    for v, t in zip(to_write, new):
        protostream.release(v.const_value)  # one copied from external data: its pages leave the resident set
        v.const_value = t
    proto = _serialize(work)
    with open(path, "xb") as f:
        f.write(proto.SerializeToString())
    return path


@contextlib.contextmanager
def staged_dir(dst: str | os.PathLike, *, replace: bool = False):
    """A temporary folder beside ``dst`` to fill; renamed to ``dst`` when the block ends without an error
    (``replace``: an existing ``dst`` is removed first), removed otherwise: nothing half-written."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        yield tmp
        with uninterrupted():
            if replace and dst.exists():
                shutil.rmtree(dst)
            os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

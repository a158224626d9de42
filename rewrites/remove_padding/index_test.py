"""Tests of remove-padding's index machinery (pack / unpack by each Lead) and dimension probing."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from graphopt.rewrites.remove_padding.index import Lead, PackIndex
from graphopt.rewrites.remove_padding.probe import Dim, probe_labels
from graphopt.runtime.session import make_session, run

H = 3
F32, I64 = ir.DataType.FLOAT, ir.DataType.INT64


def _input(name: str, dtype: ir.DataType, dims) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))


def _index_model() -> ir.Model:
    """Packs x [B,S,H], pos [1,S,H], row [B,1,H], seq [S,H], rows [B*S,H] by the mask; unpacks x and rows."""
    mask = _input("attention_mask", I64, ["B", "S"])
    ins = {"x": ["B", "S", H], "pos": [1, "S", H], "row": ["B", 1, H], "seq": ["S", H], "rows": ["BS", H]}
    values = {n: _input(n, F32, d) for n, d in ins.items()}
    tape = ir.tape.Tape()
    index = PackIndex(tape, mask)
    leads = {"x": Lead.TOKENS, "pos": Lead.POSITIONS, "row": Lead.ROWS, "seq": Lead.SEQUENCE, "rows": Lead.FLAT}
    outs = {f"packed_{n}": index.pack(values[n], lead) for n, lead in leads.items()}
    assert index.pack(values["x"], Lead.TOKENS) is outs["packed_x"], "one pack per value and lead"
    outs["unpacked"] = index.unpack(outs["packed_x"])
    outs["zeros"] = index.unpack_zeros(outs["packed_x"], 3, F32)
    outs["real"] = index.real_rows(outs["packed_x"])
    outs["shape"] = index.padded_shape(outs["packed_x"])
    # the flattened [B*S, H] layout: packed [N+1, H]
    outs["unpacked_rows"] = index.unpack(outs["packed_rows"], flat=True)
    outs["zeros_rows"] = index.unpack_zeros(outs["packed_rows"], 2, F32, flat=True)
    outs["real_rows"] = index.real_rows(outs["packed_rows"], flat=True)
    outs["shape_rows"] = index.padded_shape(outs["packed_rows"], flat=True)
    outs["starts"] = index.row_starts
    for name, v in outs.items():
        v.name = name
    graph = ir.Graph([mask, *values.values()], list(outs.values()), nodes=tape.nodes, opset_imports={"": 17})
    return ir.Model(graph, ir_version=9)


@pytest.mark.parametrize("mask", [
    [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]],  # right padding and an empty row
    [[0, 1, 0, 1], [1, 0, 1, 1], [0, 0, 1, 1]],  # holes and left padding
    [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],  # no real token: the scratch row is flat position 0
])
def test_pack_unpack(mask):
    mask = np.asarray(mask, np.int64)
    b, s = mask.shape
    rng = np.random.default_rng(0)
    feed = {"attention_mask": mask, "x": rng.standard_normal((b, s, H)).astype(np.float32),
            "pos": rng.standard_normal((1, s, H)).astype(np.float32),
            "row": rng.standard_normal((b, 1, H)).astype(np.float32),
            "seq": rng.standard_normal((s, H)).astype(np.float32),
            "rows": rng.standard_normal((b * s, H)).astype(np.float32)}
    out = run(make_session(_index_model(), optimize=False), [feed])[0]
    flat = np.flatnonzero(mask)
    rows = np.append(flat, flat[0] if flat.size else 0)  # the N real tokens, then the scratch row
    bi, si = rows // s, rows % s
    np.testing.assert_array_equal(out["packed_x"], feed["x"].reshape(b * s, H)[rows][None])
    np.testing.assert_array_equal(out["packed_pos"], feed["pos"][0][si][None])
    np.testing.assert_array_equal(out["packed_row"], feed["row"][:, 0][bi][None])
    np.testing.assert_array_equal(out["packed_seq"], feed["seq"][si][None])
    real = mask.astype(bool)
    np.testing.assert_array_equal(out["unpacked"][real], feed["x"][real])
    scratch = feed["x"].reshape(b * s, H)[rows[-1]]
    assert np.all(out["unpacked"][~real] == scratch), "padded positions read the scratch row"
    np.testing.assert_array_equal(out["zeros"], np.where(real[..., None], feed["x"], 0))
    np.testing.assert_array_equal(out["real"], feed["x"][real])
    np.testing.assert_array_equal(out["shape"], [b, s, H])
    np.testing.assert_array_equal(out["packed_rows"], feed["rows"][rows])
    flat_real = real.reshape(-1)
    np.testing.assert_array_equal(out["unpacked_rows"][flat_real], feed["rows"][flat_real])
    assert np.all(out["unpacked_rows"][~flat_real] == feed["rows"][rows[-1]])
    np.testing.assert_array_equal(out["zeros_rows"], np.where(flat_real[:, None], feed["rows"], 0))
    np.testing.assert_array_equal(out["real_rows"], feed["rows"][flat_real])
    np.testing.assert_array_equal(out["shape_rows"], [b * s, H])
    np.testing.assert_array_equal(out["starts"], np.concatenate([[0], np.cumsum(mask.sum(1))[:-1]]))


def test_probe_labels():
    """Batch, sequence, their product and fixed dims are told apart by two probe runs."""
    mask = _input("attention_mask", I64, ["B", "S"])
    x = _input("x", F32, ["B", "S", H])
    tape = ir.tape.Tape()
    flat = tape.op("Reshape", [x, tape.op("Constant", [], {"value": ir.tensor(np.array([-1, H], np.int64))})])
    flat.name = "flat"
    fm = tape.op("Cast", [mask], {"to": F32})
    fm.name = "maskf"
    y = tape.op("Add", [x, tape.op("Unsqueeze", [fm, tape.op("Constant", [], {"value": ir.tensor(np.array([2]))})])])
    y.name = "y"
    graph = ir.Graph([mask, x], [y], nodes=tape.nodes, opset_imports={"": 17})
    labels = probe_labels(ir.Model(graph, ir_version=9), mask)
    assert labels(y) == (Dim.B, Dim.S, H) and labels(graph.node(0).outputs[0]) == (2,)
    assert labels(next(n.outputs[0] for n in graph if n.op_type == "Reshape")) == (Dim.BS, H)
    assert labels.rank(y) == 3 and labels(None) is None and labels.rank(ir.Value(name="nowhere")) == 0

"""The shared name allocator: names taken by the graph or handed out before are never handed out again."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.rewrites.common.names import Names, unique_name


def _graph() -> ir.Graph:
    x = ir.Value(name="x", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", const_value=ir.tensor(np.ones(2, np.float32), name="w"))
    add = ir.node("Add", [x, w], name="add")
    add.outputs[0].name = "y"
    g = ir.Graph([x], add.outputs, nodes=[add], initializers=[w], name="g")
    return g


def test_graph_names_and_handed_out_names_are_taken():
    g = _graph()
    names = Names(g)
    assert [names.unique(b) for b in ("x", "w", "y", "z", "z", "w")] == ["x_1", "w_1", "y_1", "z", "z_1", "w_2"]
    # one-shot: only what the graph holds counts
    assert unique_name(g, "z") == "z" and unique_name(g, "y") == "y_1"


def test_initializer_is_registered_under_a_fresh_name_with_its_shape_and_a_copy():
    g = _graph()
    names = Names(g)
    arr = np.arange(6, dtype=np.int8).reshape(2, 3).T  # not C-ordered
    v = names.initializer("w", arr)
    assert v.name == "w_1" and g.initializers["w_1"] is v
    assert list(v.shape) == [3, 2] and v.dtype == ir.DataType.INT8
    np.testing.assert_array_equal(v.const_value.numpy(), arr)
    arr[0, 0] = 100
    assert v.const_value.numpy()[0, 0] == 0  # a copy, not a view of the caller's array
    s = names.initializer("scale", np.float32(0.5))
    assert list(s.shape) == [] and s.const_value.numpy().shape == ()  # 0-d stays 0-d
    assert names.unique("w_1") == "w_1_1"

"""Fresh names for what a pass adds to a graph: one allocator for every pass.

A name is taken when an initializer, a graph input or a node output of the main graph carries it, or when
this allocator has already handed it out. ``unique("w")`` returns ``w`` when free, else the first free one
of ``w_1``, ``w_2``, …; node names come from the same allocator, so a new node never shares a name with a
value the pass created.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


class Names:
    """Hands out names not used in ``graph`` yet, each at most once."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.taken: set[str] = set(graph.initializers) | {v.name for v in graph.inputs if v.name}
        self.taken.update(o.name for node in graph for o in node.outputs if o.name)

    def unique(self, base: str) -> str:
        """``base``, or ``base_<i>`` with the smallest free ``i >= 1``; taken from now on."""
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def initializer(self, base: str, array: np.ndarray) -> ir.Value:
        """A new initializer holding a C-ordered copy of ``array`` under a fresh name, registered in the graph."""
        name = self.unique(base)
        arr = np.array(array, order="C", copy=True)  # not ascontiguousarray: it makes 0-d arrays 1-d
        t = ir.tensor(arr, name=name)
        v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(t.dtype), const_value=t)
        self.graph.register_initializer(v)
        return v


def unique_name(graph: ir.Graph, base: str) -> str:
    """A name not used in ``graph`` yet (for one name; a pass adding many keeps one :class:`Names`)."""
    return Names(graph).unique(base)

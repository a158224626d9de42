"""Run a model in consecutive segments, so that few of many requested intermediates are alive at once.

Asking ONNX Runtime for every intermediate of a model as extra graph outputs keeps all of them in
memory until the run ends (MiniLM, 32 sentences: 1.1 GB). ``StagedRun`` cuts the model, in
topological order, into segments that end where a group of wanted values is complete; each segment
is its own session whose inputs are the values crossing the cut (the *frontier*: a transformer's
hidden state and mask) and whose outputs are its wanted values plus the frontier for later segments.
One forward pass in all, the same kernels on the same inputs (optimizations off), so the numbers are
those of the whole model; memory holds one group, the frontier and values produced ahead of their group.

::

    whole model:   in ─▶ [n0 n1 n2 n3 n4 n5 n6 n7] ─▶ out + all 8 intermediates at once
    staged:        in ─▶ [n0 n1 n2] ─h─▶ [n3 n4 n5] ─h─▶ [n6 n7] ─▶ out
                         group 0         group 1          group 2     (h: frontier)

Refuses (raises ``ValueError``) on what it cannot cut: a cycle, a frontier value of unknown type.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)


def _subgraph_refs(node: onnx.NodeProto, out: set[str]) -> None:
    """Every name a node's subgraphs read (their own values included; callers filter)."""
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for g in graphs:
            for n in g.node:
                out.update(x for x in n.input if x)
                _subgraph_refs(n, out)


def _topo_order(nodes: Sequence[onnx.NodeProto], uses: list[set[str]]) -> list[int]:
    """Stable topological order of ``nodes`` (original order where the graph allows)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{producer[u] for u in us if u in producer and producer[u] != i} for i, us in enumerate(uses)]
    users: list[list[int]] = [[] for _ in nodes]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    pending = [len(ds) for ds in deps]
    heap = [i for i, k in enumerate(pending) if k == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(heap, u)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle")
    return order


def _copy(msg):
    """A standalone copy of a proto message (a sub-message would keep its whole model alive)."""
    out = type(msg)()
    out.CopyFrom(msg)
    return out


class _Segment:
    def __init__(self, nodes: list[onnx.NodeProto]):
        self.nodes = nodes               # emptied once the session is made
        self.size = len(nodes)
        self.inputs: list[str] = []      # names the segment reads from the feed or the frontier
        self.graph_inputs: set[str] = set()
        self.initializers: list[str] = []
        self.outputs: list[str] = []
        self.sess = None


class StagedRun:
    """Run ``proto`` segment by segment; ``run(feed)`` yields, per group, the group's values.

    ``groups[c]`` lists the value names wanted at step ``c``; a name in several groups is given with
    its first. Values that no node produces (graph inputs, initializers) are taken from the feed or
    the initializer. Sessions are made at the first run (a frontier value's type may only be known
    then) on CPU, optimizations off, without the memory arena (which would keep each segment's peak).
    """

    def __init__(self, proto: onnx.ModelProto, groups: Sequence[Sequence[str]]):
        g = proto.graph
        self._proto = proto
        nodes = list(g.node)
        self._inits = {t.name: t for t in g.initializer}
        self._graph_inputs = {v.name: v for v in g.input}
        produced = {o for n in nodes for o in n.output if o}
        known = produced | set(self._inits) | set(self._graph_inputs)
        uses: list[set[str]] = []
        for n in nodes:
            us = {x for x in n.input if x}
            inner: set[str] = set()
            _subgraph_refs(n, inner)
            uses.append(us | (inner & known))
        order = _topo_order(nodes, uses)
        pos = {o: k for k, i in enumerate(order) for o in nodes[i].output if o}
        self._types = {v.name: _copy(v.type) for v in (*g.value_info, *g.output, *g.input)
                       if v.type.WhichOneof("value")}
        self._graph_inputs = {n: _copy(v) for n, v in self._graph_inputs.items()}

        seen: set[str] = set()
        self.groups: list[list[str]] = []
        for grp in groups:
            names = [n for n in dict.fromkeys(grp) if n not in seen]
            seen.update(names)
            self.groups.append(names)
        self._wanted = seen
        # segment c runs the nodes (end[c-1], end[c]] in topological order
        self.segments: list[_Segment] = []
        start = 0
        for names in self.groups:
            end = max([start, *(pos[n] + 1 for n in names if n in pos)])
            self.segments.append(_Segment([nodes[i] for i in order[start:end]]))
            start = end
        seg_of = {o: c for c, s in enumerate(self.segments) for n in s.nodes for o in n.output if o}
        node_uses = {id(n): u for n, u in zip(nodes, uses)}
        self._last_use: dict[str, int] = {}
        for c, s in enumerate(self.segments):
            reads: set[str] = set()
            for n in s.nodes:
                reads |= node_uses[id(n)]
            mine = {o for n in s.nodes for o in n.output if o}
            for r in sorted(reads - mine):
                if r in self._inits:
                    s.initializers.append(r)
                    if r in self._graph_inputs:  # an overridable initializer: the feed may override it
                        s.graph_inputs.add(r)
                        s.inputs.append(r)
                elif r in self._graph_inputs:
                    s.graph_inputs.add(r)
                    s.inputs.append(r)
                elif r in seg_of:
                    s.inputs.append(r)
                    self._last_use[r] = max(self._last_use.get(r, -1), c)
        for c, s in enumerate(self.segments):
            mine = [o for n in s.nodes for o in n.output if o]
            s.outputs = [o for o in mine if o in self._wanted or self._last_use.get(o, -1) > c]
        # wanted values no node produces: initializers (graph inputs come from the feed)
        self._const = {n: onnx.numpy_helper.to_array(self._inits[n]) for n in self._wanted
                       if n not in produced and n in self._inits}

    def _build(self, s: _Segment, frontier: Mapping[str, Any]) -> None:
        import onnxruntime as ort


        g = onnx.GraphProto(name="segment")
        g.node.extend(s.nodes)
        g.initializer.extend(self._inits[n] for n in s.initializers)
        for name in s.inputs:
            if name in s.graph_inputs and name in self._graph_inputs:
                g.input.append(self._graph_inputs[name])
                continue
            vi = onnx.ValueInfoProto(name=name)
            value = frontier[name]
            if isinstance(value, np.ndarray):
                vi.type.tensor_type.elem_type = ir.DataType.from_numpy(value.dtype).value
                shape = vi.type.tensor_type.shape
                for _ in range(value.ndim):
                    shape.dim.add()  # rank known, sizes free: every feed's shapes fit
            elif name in self._types:
                vi.type.CopyFrom(self._types[name])
            else:
                raise ValueError(f"frontier value {name!r} ({type(value).__name__}) has no known type")
            g.input.append(vi)
        g.output.extend(onnx.ValueInfoProto(name=n) for n in s.outputs)
        m = onnx.ModelProto(ir_version=self._proto.ir_version, graph=g, producer_name="graphopt-staged")
        m.opset_import.extend(self._proto.opset_import)
        m.functions.extend(self._proto.functions)
        so = runtime.session_options(optimize=False, spinning=False)
        so.enable_cpu_mem_arena = False
        s.sess = ort.InferenceSession(m.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
        s.nodes = []
        del m, g
        if all(x.sess is not None or not x.size for x in self.segments):
            # every session holds its own weights now: let go of the model's proto
            self._inits = {}
            self._proto = None

    def _static(self, name: str, feed: Mapping[str, Any]) -> Any:
        if name in feed and name in self._graph_inputs:
            return feed[name]
        return self._const.get(name)

    def run(self, feed: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """Yield, for each group in order, ``{name: value}`` of that group's values on ``feed``."""
        env: dict[str, Any] = {}   # frontier values still to be read by a later segment
        held: dict[str, Any] = {}  # wanted values produced by this or an earlier segment
        for c, (s, names) in enumerate(zip(self.segments, self.groups)):
            if s.size:
                inputs = {n: (feed[n] if n in s.graph_inputs else env[n]) for n in s.inputs
                          if n in env or (n in s.graph_inputs and n in feed)}
                if s.sess is None:
                    self._build(s, env)
                vals = s.sess.run(s.outputs, inputs)
                del inputs
                for name, v in zip(s.outputs, vals):
                    if self._last_use.get(name, -1) > c:
                        env[name] = v
                    if name in self._wanted:
                        held[name] = v
                del vals
                for name in [n for n in env if self._last_use[n] <= c]:
                    del env[name]
            out = {}
            for n in names:
                if n in held:
                    out[n] = held.pop(n)
                else:
                    v = self._static(n, feed)
                    if v is not None:
                        out[n] = v
            yield out
            del out

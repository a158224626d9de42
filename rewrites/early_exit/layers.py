"""``early-exit``: layer boundaries found from the graph itself (see the package docstring).

In topological order, a normalization output is a *cut* when it is the only value of its shape computed
before it and still used after it (the whole residual stream passes through it); a cut opens a layer when
the stretch up to the next cut holds an attention.
"""

from __future__ import annotations

import onnx_ir as ir

_NORMS = {("", "LayerNormalization"), ("com.microsoft", "SkipLayerNormalization"),
          ("com.microsoft", "EmbedLayerNormalization"), ("", "RMSNormalization"),
          ("com.microsoft", "SimplifiedLayerNormalization"), ("com.microsoft", "SkipSimplifiedLayerNormalization")}
_ATTENTION = {"Softmax", "Attention", "MultiHeadAttention", "QAttention", "GroupQueryAttention",
              "PackedAttention", "PackedMultiHeadAttention"}


def find_layers(graph: ir.Graph) -> tuple[list[ir.Value], str]:
    """The residual-stream value after each transformer layer, in order, or ([], why not)."""
    nodes = list(graph)
    last_use: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for v in n.inputs:
            if v is not None and v.producer() is not None:
                last_use[id(v)] = i
    outs = {id(v) for v in graph.outputs}

    def signature(v: ir.Value):
        if v.shape is None:
            return None
        return (len(v.shape), v.shape[-1] if len(v.shape) else None)

    cuts: list[tuple[int, ir.Value]] = []
    for i, n in enumerate(nodes):
        if (n.domain, n.op_type) not in _NORMS or not n.outputs or n.outputs[0].shape is None:
            continue
        h = n.outputs[0]
        if len(h.shape) != 3 or not (h.uses() or id(h) in outs):
            continue
        sig = signature(h)
        crossing = False
        for m in nodes[: i + 1]:
            for v in m.outputs:
                if v is h or signature(v) != sig:
                    continue
                if last_use.get(id(v), -1) > i or id(v) in outs:
                    crossing = True
                    break
            if crossing:
                break
        if not crossing:
            cuts.append((i, h))
    if len(cuts) < 3:
        return [], (f"found {len(cuts)} normalization outputs that carry the whole residual stream "
                    "(a post-LN encoder has two per layer plus the embeddings'); no layer boundaries")
    opens = []
    for j, (i, _h) in enumerate(cuts):
        end = cuts[j + 1][0] if j + 1 < len(cuts) else len(nodes)
        if any(m.op_type in _ATTENTION for m in nodes[i + 1 : end]):
            opens.append(j)
    if len(opens) < 2:
        return [], f"{len(cuts)} residual-stream cuts but {len(opens)} followed by attention; no layer boundaries"
    layers = [cuts[j][1] for j in opens[1:]]
    if opens[-1] != len(cuts) - 1:
        layers.append(cuts[-1][1])
    return layers, ""

"""Layer-skip self-speculation: the target's first L layers and a fitted exit head draft, the target verifies.

A graph made by the ``layer-skip-draft`` pass carries the exit head as two initializers (``layer_skip.map``
[hidden, hidden], ``layer_skip.bias`` [hidden]) and the metadata ``graphopt.speculative = layer-skip`` and
``graphopt.layer_skip`` (JSON: ``layers`` L, ``hidden`` the name of the residual stream entering layer L, the
draft length and acceptance the pass measured). The runtime cuts the draft graph out of the target
(``draft_graph``): the nodes that make layer L's input and the presents of layers 0 .. L-1, then::

    h_L ── RMS-normalise (no weight) ── MatMul(map) ── Add(bias) ── the target's LM head ──▶ logits

The exit head maps the layer-L hidden state to the final normed hidden state (least squares on the model's own
greedy text, pass ``layer-skip-draft``) and reuses the target's (tied) LM head, whatever its kind (MatMul,
MatMulNBits). The draft is a decoder with past for L layers whose K/V are the target's for those layers (same
nodes, same tokens): on a shared-buffer graph (GroupQueryAttention) it binds the target's own cache buffers
(``cache.SharedLayers``); on other graphs it keeps its own cache of L layers (``draft_model.ModelDraft``).
CALM's early exit made lossless: the target checks every drafted token. The draft is a second ONNX Runtime
session: it holds its own copy of the embedding, the first L layers and the LM head (on SmolLM2-135M fp32, L = 15:
about 330 MB beside the model's 540 MB).
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from graphopt.analysis import lm_head
from graphopt.errors import UsageError
from graphopt.generate.draft_model import ModelDraft
from graphopt.generate.loop import Decoder
from graphopt.runtime.ort_compat import model_path
from graphopt.runtime.session import make_session

SPECULATIVE_KEY, TAG, LAYER_SKIP_KEY = "graphopt.speculative", "layer-skip", "graphopt.layer_skip"
MAP, BIAS = "layer_skip.map", "layer_skip.bias"
EPS = 1e-6


def spec_of(metadata: dict[str, str]) -> dict | None:
    """The layer-skip record of a model's metadata (None: the graph carries no layer-skip draft)."""
    if metadata.get(SPECULATIVE_KEY) != TAG or LAYER_SKIP_KEY not in metadata:
        return None
    return json.loads(metadata[LAYER_SKIP_KEY])


def carries_layer_skip(session) -> bool:
    return spec_of(dict(session.get_modelmeta().custom_metadata_map)) is not None


def rms_normalise(x: np.ndarray) -> np.ndarray:
    """What the draft graph does to h_L before the map (numpy, for fitting)."""
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)


def draft_graph(model: ir.Model, layers: int, hidden: str, a: np.ndarray | None = None,
                c: np.ndarray | None = None) -> ir.Model:
    """Cut ``model`` (changed in place, and returned) down to the layer-skip draft of its first ``layers``
    layers; the exit head is ``a``/``c`` when given, else the model's ``layer_skip.map``/``layer_skip.bias``."""
    g = model.graph
    values = {v.name: v for n in g for v in n.outputs}
    values.update({v.name: v for v in g.inputs})
    if hidden not in values:
        raise UsageError(f"layer-skip: the graph has no value '{hidden}' (the hidden state entering layer {layers})")
    outs = {o.name: o for o in g.outputs}
    final = lm_head.head_input(g)
    if isinstance(final, str):
        raise UsageError(f"layer-skip: {final}")
    presents = [outs[f"present.{i}.{kind}"] for i in range(layers) for kind in ("key", "value")]

    def const(name: str, array: np.ndarray | None) -> ir.Value:
        if array is None:
            if name not in g.initializers:
                raise UsageError(f"layer-skip: the graph has no '{name}' initializer (run the layer-skip-draft pass)")
            return g.initializers[name]
        if name in g.initializers:
            g.initializers.pop(name)
        v = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(array, np.float32), name=name))
        v.shape, v.type = ir.Shape(array.shape), ir.TensorType(ir.DataType.FLOAT)
        g.register_initializer(v)
        return v

    nodes: list[ir.Node] = []

    def op(op_type: str, *inputs: ir.Value, name: str, **attrs) -> ir.Value:
        node = ir.Node("", op_type, inputs, attributes=[ir.Attr(k, ir.AttributeType.INT, v) for k, v in attrs.items()],
                       name=f"layer_skip/{name}", num_outputs=1)
        node.outputs[0].name = f"layer_skip/{name}_out"
        nodes.append(node)
        return node.outputs[0]

    h = values[hidden]
    two = const("layer_skip.two", np.array(2.0, np.float32))
    eps = const("layer_skip.eps", np.array(EPS, np.float32))
    axes = ir.Value(name="layer_skip.axes", const_value=ir.tensor(np.array([-1], np.int64), name="layer_skip.axes"))
    g.register_initializer(axes)
    mean = op("ReduceMean", op("Pow", h, two, name="square"), axes, name="mean", keepdims=1)
    normed = op("Div", h, op("Sqrt", op("Add", mean, eps, name="add_eps"), name="rms"), name="normalise")
    y = op("Add", op("MatMul", normed, const(MAP, a), name="map"), const(BIAS, c), name="bias")
    g.extend(nodes)
    final.replace_all_uses_with(y)  # the model's own LM head, whatever its form, reads the exit head's output
    logits = outs["logits"]
    g.outputs.clear()
    g.outputs.extend([logits, *presents])
    ir_passes.RemoveUnusedNodesPass()(model)
    g.sort()
    keep = {f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")}
    for v in [v for v in g.inputs if v.name.startswith("past_key_values.") and v.name not in keep]:
        if v.uses():
            raise UsageError(f"layer-skip: layers 0 .. {layers - 1} read '{v.name}': '{hidden}' is not the input "
                             f"of layer {layers}")
        g.inputs.remove(v)
    for v in [v for v in g.inputs if v.name not in keep and not v.uses()
              and v.name in ("position_ids",)]:
        g.inputs.remove(v)
    model.metadata_props.pop(SPECULATIVE_KEY, None)
    model.metadata_props.pop(LAYER_SKIP_KEY, None)
    return model


def draft_decoder(path, layers: int, hidden: str, *, threads: int | None = None) -> Decoder:
    """A Decoder over the layer-skip draft cut out of the ONNX file ``path``."""
    return Decoder(make_session(draft_graph(ir.load(path), layers, hidden), threads=threads),
                   name=f"{path} (layer-skip draft)")


class LayerSkipDraft(ModelDraft):
    """The layer-skip draft of the target decoder's graph (sharing its cache where the graph allows)."""

    def __init__(self, target: Decoder):
        spec = spec_of(dict(target.session.get_modelmeta().custom_metadata_map))
        path = model_path(target.session)
        if spec is None:
            raise UsageError("--speculative layer-skip: the graph carries no layer-skip draft",
                             hint="add it with graphopt optimize --passes layer-skip-draft, or use --speculative lookup")
        if path is None:
            raise UsageError("--speculative layer-skip cuts its draft out of the model's file; this session has none")
        threads = target.session.get_session_options().intra_op_num_threads or None
        dec = draft_decoder(path, int(spec["layers"]), spec["hidden"], threads=threads)
        super().__init__(dec, share=True, name=TAG, priors={TAG: float(spec.get("acceptance", 0.5))})
        self.layers, self.max_draft = int(spec["layers"]), int(spec.get("drafts", 4))

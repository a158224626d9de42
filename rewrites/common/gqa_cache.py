"""What the passes that change a GroupQueryAttention decoder's KV cache check first (``quantize-kv-cache``,
``kivi-kv-cache``)."""

from __future__ import annotations

import onnx_ir as ir

from graphopt.generate.quant_cache import KV_QUANT_KEY
from graphopt.generate.signature import KV_CACHE_KEY
from graphopt.opsets import MS_DOMAIN


def cache_attention_nodes(model: ir.Model, dtypes: tuple[ir.DataType, ...]) -> tuple[list[ir.Node], str | None]:
    """The GroupQueryAttention nodes of a shared-buffer decoder whose past are graph inputs of one of ``dtypes``,
    or the reason to refuse."""
    if model.metadata_props.get(KV_CACHE_KEY) != "shared-buffer":
        return [], "not a shared-buffer GroupQueryAttention decoder (run group-query-attention first)"
    if KV_QUANT_KEY in model.metadata_props:
        return [], f"the KV cache is already quantized ({model.metadata_props[KV_QUANT_KEY]})"
    inputs = set(model.graph.inputs)
    nodes = [n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    if not nodes:
        return [], "no GroupQueryAttention"
    for n in nodes:
        past = n.inputs[3:5]
        if len(past) < 2 or any(p is None or p not in inputs for p in past):
            return [], f"GroupQueryAttention {n.name!r}: past_key / past_value are not graph inputs"
        if any(p.dtype not in dtypes for p in past):
            return [], (f"GroupQueryAttention {n.name!r}: past is {past[0].dtype}, not "
                        f"{' / '.join(d.name.lower() for d in dtypes)}")
    return nodes, None

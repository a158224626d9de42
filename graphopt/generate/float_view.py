"""A decoder graph whose KV cache is held in another form, seen with the float cache contract it replaced: what
verification and the speed guard feed (past ``[batch, kv_heads, P, D]`` floats) and read back.

Two forms: a cache ONNX Runtime's ``GroupQueryAttention`` holds quantized (``quant_cache``, pass
``quantize-kv-cache``) and KIVI's form (``kivi``, pass ``kivi-kv-cache``).
"""

from __future__ import annotations

from graphopt.generate import kivi, quant_cache
from graphopt.generate.signature import KV_CACHE_KEY, read_signature


def _is_kivi(session) -> bool:
    meta = session.get_modelmeta().custom_metadata_map if hasattr(session, "get_modelmeta") else {}
    return meta.get(KV_CACHE_KEY) == kivi.FORM


def float_io(session, model):
    """``session`` itself, or an adapter over it that takes and returns a float cache."""
    if _is_kivi(session):
        return kivi.KiviIO(session, read_signature(session))
    return quant_cache.float_io(session, model)


def graph_feeds(session, model, feeds):
    """``feeds`` made for the float graph as ``session``'s graph takes them (once, e.g. before timing runs)."""
    if _is_kivi(session):
        io = kivi.KiviIO(session, read_signature(session))
        return [io.prepare(f)[0] for f in feeds]
    return quant_cache.quantized_feeds(model, feeds)

"""``kivi-kv-cache``: a GroupQueryAttention decoder's KV cache in KIVI's form, keys per channel over groups of
tokens and values per token in 2-4 bits with scales that follow the data, attention in standard ops; under a
perplexity budget measured at long context.

ONNX Runtime's quantized ``GroupQueryAttention`` cache (pass ``quantize-kv-cache``) has static scales only; on
SmolLM2 its 4-bit cache costs 28% perplexity at 4,096 positions. This pass replaces every
``GroupQueryAttention`` of a shared-buffer decoder (after ``group-query-attention``) with standard-op
attention (``graph.py``) over a cache held as ``graphopt.generate.kivi`` describes::

    GroupQueryAttention(qkv, past_key float [b, h, max, D], past_value, seqlens_k, total, cos, sin)
        ─▶ output, present_key, present_value              (one shared float buffer)
                        ==>
    RotaryEmbedding(q / k, position_ids) ─ Softmax(q Kᵀ + mask) V over
        K = [float16 sink | dequant(key codes, per (group of G tokens, channel)) | float16 window | new]
        V = [float16 sink | dequant(value codes, per token over every head)      | new]
        ─▶ output, present_key / present_value float [b, h, n, D] (the new positions: the runtime quantizes them)

Defaults (``sink=4 group=128 key_bits=4 value_bits=3``): 3.9 bits a value at 4,096 positions, scales
included, under a quarter of float16. The first ``sink`` positions stay float16 (most queries attend to
them: simulated on SmolLM2 at 4,096 positions, perplexity x1.032 without them, x1.011 with 4).

The budget (``ppl_ratio``, default ``ppl_ratio<=1.02``, against the graph as given) is measured on long
windows, not the pipeline's 64-token ones, where no key group would fill: the calibration text's tokens are
cut into two halves, the first scored for calibration, the second held back, each fed in chunks of ``chunk``
positions so that the cache is quantized as it fills. ``greedy_match`` comes from the pipeline's prompts.

Refuses (model unchanged): no shared-buffer ``GroupQueryAttention`` graph, a cache already quantized, a past
that is not float32, ``softcap`` or a local window, a head size not a multiple of 8, an opset below 18; a
calibration text shorter than two windows of ``sink + 2 * group`` tokens; the budget not met.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from graphopt.data.metrics import Comparison
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate import kivi, quality
from graphopt.generate.loop import Decoder
from graphopt.generate.signature import KV_CACHE_KEY
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common import lossy
from graphopt.rewrites.common.gqa_cache import cache_attention_nodes
from graphopt.runtime import session as runtime

from .graph import Builder, attention, layer_inputs, mask_bias


def _attention_nodes(model: ir.Model) -> tuple[list[ir.Node], str | None]:
    if model.opset_imports.get("", 0) < 18:
        return [], f"opset {model.opset_imports.get('', 0)} < 18 (BitwiseAnd)"
    nodes, why = cache_attention_nodes(model, (ir.DataType.FLOAT,))
    for n in nodes:
        if n.attributes.get_float("softcap", 0.0) or n.attributes.get_int("local_window_size", -1) != -1:
            return [], f"GroupQueryAttention {n.name!r} has a softcap or a local window"
        if n.attributes.get_int("do_rotary", 0) and (len(n.inputs) < 9 or n.inputs[7] is None):
            return [], f"GroupQueryAttention {n.name!r}: rotary without cos / sin caches"
        d = n.inputs[3].shape[3] if n.inputs[3].shape is not None else None
        if not isinstance(d, int) or d % 8:
            return [], f"GroupQueryAttention {n.name!r}: head size {d} is not a static multiple of 8"
    return nodes, why


def rewrite(model: ir.Model, fmt: kivi.KiviFormat) -> int:
    """Every GroupQueryAttention of ``model`` on a KIVI-form cache (checked by ``_attention_nodes``)."""
    graph = model.graph
    nodes = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    by_name = {v.name: v for v in graph.inputs}
    positions = by_name.get("position_ids")
    if positions is None:
        positions = ir.Value(name="position_ids", shape=ir.Shape(["batch", "sequence"]),
                             type=ir.TensorType(ir.DataType.INT64))
        graph.inputs.append(positions)
    shared = Builder(graph, "kivi/")
    bias = mask_bias(shared, by_name["attention_mask"], by_name["input_ids"])
    shared.flush(nodes[0])
    outputs = {v.name: i for i, v in enumerate(graph.outputs)}
    for layer, node in enumerate(nodes):
        past_k, past_v = node.inputs[3], node.inputs[4]
        d, kv_heads = past_k.shape[3], past_k.shape[1]
        cache = layer_inputs(layer, fmt, kv_heads, d)
        b = Builder(graph, f"kivi/{layer}/", const_prefix="kivi/")  # constants shared by every layer
        out, k_new, v_new = attention(b, node, cache, fmt, positions, bias, d)
        b.flush(node)
        node.outputs[0].replace_all_uses_with(out)
        for old, new in zip(node.outputs[1:3], (k_new, v_new), strict=True):
            name = old.name
            if name in outputs:
                old.name = f"{name}.gqa"
                new.name, new.type = name, ir.TensorType(ir.DataType.FLOAT)
                new.shape = ir.Shape(["batch", kv_heads, "sequence", d])
                graph.outputs[outputs[name]] = new
        graph.remove(node, safe=True)
        at = graph.inputs.index(past_k)
        graph.inputs.pop(at)
        graph.inputs.pop(graph.inputs.index(past_v))
        for v in reversed(list(cache.values())):
            graph.inputs.insert(at, v)
    common_passes.RemoveUnusedNodesPass()(model)
    model.metadata_props[KV_CACHE_KEY] = kivi.FORM
    model.metadata_props[kivi.KIVI_KEY] = fmt.dumps()
    return len(nodes)


def long_windows(rows: quality.TextRows, least: int) -> dict[str, list[int]] | str:
    """The rows' token stream cut in two halves (calibration, held back), or why it is too short."""
    spans = sorted((a, b, w) for part in (quality.CALIB, quality.HELD)
                   for (a, b), w in zip(rows.spans[part], rows.windows[part], strict=True))
    stream: list[int] = []
    for a, _, w in spans:
        if a != len(stream):
            break
        stream.extend(w)
    half = len(stream) // 2
    if half < least:
        return f"the calibration text gives {len(stream)} contiguous tokens; two windows of {least} are needed"
    return {quality.CALIB: stream[:half], quality.HELD: stream[half:2 * half]}


class KiviKVCachePass(GraphoptPass):
    """KV cache in KIVI's form: per-channel keys, per-token values in 2-4 bits, dynamic scales, float16 sink."""

    name = "kivi-kv-cache"
    exact = False
    default_budget = "ppl_ratio<=1.02"
    emits = (f"{MS_DOMAIN}::RotaryEmbedding",)
    run_after = ("group-query-attention",)

    def __init__(self, *, sink: int = 4, group: int = 128, key_bits: int = 4, value_bits: int = 3,
                 chunk: int = 32):
        super().__init__()
        self.fmt = kivi.KiviFormat(int(sink), int(group), int(key_bits), int(value_bits))
        if int(chunk) < 1:
            raise UsageError(f"kivi-kv-cache.chunk must be >= 1 (got {chunk})")
        self.chunk = int(chunk)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        s = lossy.BudgetSearch.of(self, ctx, default_note=True)
        s.require_decoder_terms("ppl_ratio<=1.02")
        nodes, why = _attention_nodes(model)
        if why is not None:
            s.note(f"not applied: {why}")
            return s.result(model, False)
        check = ctx.decoder
        if check is None:
            check = quality.decoder_check(runtime.make_session(model, threads=1), window=128)
            s.note("measured against the model as given (a direct call)")
        wins = long_windows(check.rows, self.fmt.sink + 2 * self.fmt.group)
        if isinstance(wins, str):
            s.note(f"not applied: {wins}")
            return s.result(model, False, met=False)
        f = self.fmt
        s.note(f"{f.key_bits}-bit keys per channel over {f.group} tokens, {f.value_bits}-bit values per token, "
               f"sink {f.sink}; perplexity on two windows of {len(wins[quality.CALIB])} tokens in chunks of "
               f"{self.chunk}")
        ref_dec = Decoder(runtime.make_session(model, threads=1, spinning=False))
        ref = {p: quality.perplexity(ref_dec, [w], self.chunk) for p, w in wins.items()}
        del ref_dec
        cand = model.clone()
        layers = rewrite(cand, f)
        sess = runtime.make_session(cand, threads=1, spinning=False)
        dec = Decoder(sess)

        def score(part: str) -> Comparison:
            ppl = quality.perplexity(dec, [wins[part]], self.chunk)
            greedy = check.measure(dec, part)["greedy_match"]
            return Comparison({}, decoder={"ppl_ratio": ppl / ref[part], "ppl": ppl, "ppl_reference": ref[part],
                                           "greedy_match": greedy})

        m = s.evaluate(score)
        sig = dec.sig
        per_token = f.bytes_per_token(4096, sig.layers, sig.kv_heads, sig.head_dim)
        fp16 = sig.layers * 2 * sig.kv_heads * sig.head_dim * 2
        s.note(f"{per_token:.0f} bytes/token at 4,096 positions ({fp16 / per_token:.1f}x less than float16): "
               f"{lossy.decoder_text(m)}; {s.verdict(m)}")
        if not s.meets(m.held):
            s.note(f"budget {s.budget} not met: the cache stays as it was")
            return s.result(model, False, met=False, held=m.held.decoder if m.held else None)
        dec = sess = None  # the candidate's session is no longer needed
        rewrite(model, f)  # in place, as measured on the clone
        return s.result(model, True, met=True, held=m.held, rule_counts={"kivi_attention": layers})


register(KiviKVCachePass)

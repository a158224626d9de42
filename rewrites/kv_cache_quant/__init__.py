"""``quantize-kv-cache``: a GroupQueryAttention decoder's KV cache held in 8 or 4 bits, by ONNX Runtime's own
quantized-cache kernel, the per-channel scales calibrated on text, under a perplexity / greedy budget.

After ``group-query-attention`` every layer is::

    GroupQueryAttention(q, k, v, past_key float [b, h, max, D], past_value float, seqlens_k, total, cos, sin)
        ─▶ output, present_key float, present_value float           (past and present: one shared buffer)

Rewritten (ONNX Runtime 1.32's CPU kernel quantizes the new positions and attends over the dequantized past)::

    GroupQueryAttention(q, k, v, past_key int8 [b, h, max, D] | uint8 [b, h, max, D/2], past_value ..., ...,
                        k_scale [1, h, 1, D], v_scale [1, h, 1, D];
                        k_quant_type = v_quant_type = PER_CHANNEL, kv_cache_bit_width = 8 | 4)
        ─▶ output, present_key (same type), present_value

Keys get a scale per channel, as KIVI quantizes them (a few channels carry outliers); ONNX Runtime's kernel
has static scales only (per tensor or per channel, no per-token value scales, no full-precision window of
recent tokens), so values get a static scale per channel too. The scales come from the float graph's own cache
on the calibration windows (``calibrate.py``: keys also at random rotary positions, so a short window covers
long contexts; ``clip``: none, the default, or MSE-optimal clipping, which measured worse at 4,096 tokens). The graph's metadata says
``graphopt.kv_cache_quant = int8 | int4``; the runtime then holds the cache in that form
(``graphopt.generate.quant_cache``): 4 bits store ``layers * 2 * kv_heads * D / 2`` bytes per position,
a quarter of float16.

``bits`` lists the widths to try, fewest first; the first that meets the budget (``ppl_ratio``,
``greedy_match`` on the calibration text windows, then on the held-back ones) is kept. The default is 8 bits
only: the budget's windows are 64 tokens, and on SmolLM2-135M 4 bits that pass them (held-back ratio 1.008)
measured perplexity x1.29 at 4,096 tokens of context (8 bits: x1.020; ``docs/benchmarks.md``). 4 bits are
opt-in (``--set quantize-kv-cache.bits=4,8``) for short contexts.

Refuses (model unchanged): no ``graphopt.kv_cache = shared-buffer`` GroupQueryAttention graph (run
``group-query-attention`` first), a cache already quantized, a past that is not float / float16, an odd
head size (4 bits); no width meeting the budget (``budget_met=False``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.data.metrics import Comparison
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate import quality
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import Decoder
from graphopt.generate.quant_cache import KV_QUANT_KEY, bytes_per_token, scale_name, stored_width
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common import lossy
from graphopt.rewrites.common.gqa_cache import cache_attention_nodes
from graphopt.runtime import session as runtime

from .calibrate import channel_scales, key_samples

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
_NAMES = {8: "int8", 4: "int4"}


def _attention_nodes(model: ir.Model) -> tuple[list[ir.Node], str | None]:
    """The GroupQueryAttention nodes whose past are graph inputs, or the reason to refuse."""
    nodes, why = cache_attention_nodes(model, _FLOATS)
    for n in nodes:
        if len(n.inputs) > 12 and any(v is not None for v in n.inputs[12:]):
            return [], f"GroupQueryAttention {n.name!r} already has k_scale / v_scale"
    return nodes, why


class QuantizeKVCachePass(GraphoptPass):
    """KV cache in int8 / int4 (ONNX Runtime's quantized GroupQueryAttention), per-channel scales from text."""

    name = "quantize-kv-cache"
    exact = False
    #: as quantize-int4's: budgets are measured against the pipeline's input model, so in the int4-kv recipe
    #: this bounds the 4-bit weights and the 4-bit cache together (alone, the cache is measured at 1.02 in the
    #: benchmarks: ``--budget 'ppl_ratio<=1.02'`` on a model whose weights are already 4-bit)
    default_budget = "ppl_ratio<=1.05"
    emits = (f"{MS_DOMAIN}::GroupQueryAttention",)
    run_after = ("group-query-attention",)

    def __init__(self, *, bits: str = "8", clip: str = "max", shifts: int = 8, windows: int = 8,
                 center_values: bool = False):
        super().__init__()
        self.center_values = bool(center_values)
        try:
            self.bits = tuple(int(b) for b in str(bits).split(",") if b.strip())
        except ValueError:
            raise UsageError(f"quantize-kv-cache.bits must be comma-separated 4 / 8, got {bits!r}") from None
        if not self.bits or any(b not in _NAMES for b in self.bits):
            raise UsageError(f"quantize-kv-cache.bits must list 4 and/or 8, got {bits!r}")
        if clip not in ("mse", "max"):
            raise UsageError(f"quantize-kv-cache.clip must be mse or max, got {clip!r}")
        if int(shifts) < 0 or int(windows) < 1:
            raise UsageError(f"quantize-kv-cache needs shifts >= 0 and windows >= 1 (got {shifts}, {windows})")
        self.clip, self.shifts, self.windows = clip, int(shifts), int(windows)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        s = lossy.BudgetSearch.of(self, ctx, default_note=True)
        s.require_decoder_terms("ppl_ratio<=1.02,greedy_match>=0.5")
        nodes, why = _attention_nodes(model)
        head_dim = None
        if why is None:
            head_dim = nodes[0].inputs[3].shape[3] if nodes[0].inputs[3].shape is not None else None
            if not isinstance(head_dim, int):
                why = "the past's head_dim is not static"
            elif head_dim % 2 and 4 in self.bits:
                why = f"head_dim {head_dim} is odd: 4 bits pack two values a byte"
        if why is not None:
            s.note(f"not applied: {why}")
            return s.result(model, False)
        check = ctx.decoder
        if check is None and s.given:
            check = quality.decoder_check(runtime.make_session(model, threads=1))
            s.note("measured against the model as given (a direct call)")
        rows = check.rows if check is not None else _default_rows(model)
        s.note(rows.describe())
        samples = self._samples(model, nodes, rows.windows[quality.CALIB][:self.windows])
        layers, kv_heads = len(nodes), nodes[0].inputs[3].shape[1]
        fp = bytes_per_token(layers, kv_heads, head_dim, 2)
        values = {n.inputs[4].name for n in nodes}
        means = {name: samples[name].mean(axis=1) for name in values} if self.center_values else {}
        for name, mu in means.items():
            samples[name] = samples[name] - mu[:, None, :]
        for bits in self.bits:
            scales = {name: channel_scales(x, bits, self.clip) for name, x in samples.items()}
            if check is None:  # a direct call without a budget: the width asked for, unchecked
                _rewrite(model, scales, bits, means)
                s.note(f"no budget given: {bits} bits applied unchecked")
                return s.result(model, True, rule_counts={f"kv_cache_{_NAMES[bits]}": layers})
            cand = model.clone()
            _rewrite(cand, scales, bits, means)
            sess = runtime.make_session(cand, threads=1, spinning=False)
            m = s.evaluate(lambda part, sess=sess: Comparison({}, decoder=check.measure(sess, part)))
            del sess
            per_token = bytes_per_token(layers, kv_heads, stored_width(head_dim, bits), 1)
            s.note(f"{bits} bits ({per_token} bytes/token, {fp / per_token:.1f}x less than float16): "
                   f"{lossy.decoder_text(m)}; {s.verdict(m)}")
            if s.meets(m.held):
                _rewrite(model, scales, bits, means)
                return s.result(model, True, met=True, held=m.held, rule_counts={f"kv_cache_{_NAMES[bits]}": layers})
        s.note(f"budget {s.budget} cannot be met at {', '.join(map(str, self.bits))} bits: the cache stays float")
        return s.result(model, False, met=False)

    def _samples(self, model: ir.Model, nodes: list[ir.Node], windows) -> dict[str, np.ndarray]:
        """Past input name -> [kv_heads, n, D] float32 samples (keys also rotated, ``calibrate.key_samples``)."""
        dec = Decoder(runtime.make_session(model, threads=1, spinning=False))
        got: dict[str, list[np.ndarray]] = {}
        for w in windows:
            n = len(w)
            cache = KVCache(dec.sig, 1, n)
            dec.step(cache, np.asarray(w, np.int64)[None, :], np.ones((1, n), np.int64),
                     np.arange(n, dtype=np.int64)[None, :])
            for name, x in cache.past().items():
                got.setdefault(name, []).append(np.asarray(x[0], np.float32))
        first = nodes[0]
        cos, sin = (first.inputs[i].const_value.numpy() if len(first.inputs) > i and first.inputs[i] is not None
                    and first.inputs[i].const_value is not None else None for i in (7, 8))
        rotary = first.attributes.get_int("do_rotary", 0) == 1 and cos is not None
        interleaved = first.attributes.get_int("rotary_interleaved", 0) == 1
        keys = {n.inputs[3].name for n in nodes}
        out = {}
        for name, xs in got.items():
            x = np.concatenate(xs, axis=1)
            if name in keys and rotary and self.shifts:
                x = key_samples(x, cos.astype(np.float32), sin.astype(np.float32), interleaved, self.shifts)
            out[name] = x
        return out


def _default_rows(model: ir.Model) -> quality.TextRows:
    """Calibration windows of the default held-out text (UTF-8 bytes as token ids)."""
    logits = next((v for v in model.graph.outputs if v.name == "logits"), None)
    vocab = logits.shape[-1] if logits is not None and logits.shape is not None else None
    body, where = quality.read_text(None)
    ids = quality.text_ids(body, None, vocab if isinstance(vocab, int) else None)
    return quality.split_tokens(ids, source=f"{where} (UTF-8 bytes as token ids)")


def _const(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                 const_value=ir.tensor(arr, name=name))
    graph.register_initializer(v)
    return v


def _center(graph: ir.Graph, node: ir.Node, mu: np.ndarray) -> None:
    """``node`` attends over values less their mean ``mu`` [kv_heads, D] and adds it back to its output (exact:
    the attention weights of a query sum to 1)."""
    heads, kv_heads = node.attributes.get_int("num_heads"), node.attributes.get_int("kv_num_heads")
    d = mu.shape[-1]
    dtype = np.float16 if node.inputs[0].dtype == ir.DataType.FLOAT16 else np.float32
    packed = node.inputs[2] is None
    shift = np.concatenate([np.zeros((heads + kv_heads) * d), mu.ravel()]) if packed else mu.ravel()
    src = node.inputs[0] if packed else node.inputs[2]
    sub = ir.node("Sub", [src, _const(graph, f"{node.name}_value_mean_in", shift.astype(dtype))],
                  name=f"{node.name}_center_values")
    sub.outputs[0].name, sub.outputs[0].shape, sub.outputs[0].type = f"{node.name}_centered", src.shape, src.type
    graph.insert_before(node, sub)
    node.replace_input_with(0 if packed else 2, sub.outputs[0])
    out = node.outputs[0]
    uses = list(out.uses())
    back = np.repeat(mu, heads // kv_heads, axis=0).ravel().astype(dtype)  # query head h reads kv head h // group
    add = ir.node("Add", [out, _const(graph, f"{node.name}_value_mean_out", back)], name=f"{node.name}_uncenter")
    add.outputs[0].name, add.outputs[0].shape, add.outputs[0].type = f"{out.name}_uncentered", out.shape, out.type
    for user, index in uses:
        user.replace_input_with(index, add.outputs[0])
    graph.insert_after(node, add)


def _rewrite(model: ir.Model, scales: dict[str, np.ndarray], bits: int,
             means: dict[str, np.ndarray] | None = None) -> None:
    """Every GroupQueryAttention reads and writes its cache quantized at ``bits`` with ``scales`` (``means``:
    value input name -> the per-channel mean its values are centered on)."""
    graph = model.graph
    dtype = ir.DataType.INT8 if bits == 8 else ir.DataType.UINT8
    nodes = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    for node in nodes:
        if means and node.inputs[4].name in means:
            _center(graph, node, means[node.inputs[4].name])
        past = list(node.inputs[3:5])
        if len(node.inputs) < 14:
            node.resize_inputs(14)
        for j, (p, out) in enumerate(zip(past, node.outputs[1:3])):
            node.replace_input_with(12 + j, _const(graph, scale_name(p.name), scales[p.name].astype(np.float32)))
            for value in (p, out):
                dims = list(value.shape) if value.shape is not None else [None] * 4
                dims[3] = stored_width(int(dims[3]), bits)
                value.type, value.shape = ir.TensorType(dtype), ir.Shape(dims)
        for attr in ("k_quant_type", "v_quant_type"):
            node.attributes[attr] = ir.AttrString(attr, "PER_CHANNEL")
        node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", bits)
    model.metadata_props[KV_QUANT_KEY] = _NAMES[bits]


register(QuantizeKVCachePass)

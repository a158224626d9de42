"""Tests of quantize-kv-cache on the tiny Llama with past after the decoder recipe: the rewrite (types, scales,
attributes, metadata), the cache the runtime holds (bytes, the kernel's own bytes = quant_cache.quantize),
logits near the float cache (int8 closer than int4), greedy tokens at 8 bits, the pipeline's verification of the
quantized graph, the rotary shift used in calibration, and the refusals."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.engine.registry import PassContext
from graphopt.errors import UsageError
from graphopt.generate import quant_cache
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import generate, open_decoder
from graphopt.rewrites.kv_cache_quant import QuantizeKVCachePass
from graphopt.rewrites.kv_cache_quant.calibrate import rotate

pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny models are exported with torch")

DECODER = "cleanup,fuse,group-query-attention,merge-projections"
PROMPTS = [[5, 17, 99, 3, 250, 7, 41, 8], [901, 44, 12, 600, 601, 602]]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """(the decoder-recipe model, its path) of the tiny Llama."""
    src = load_models_module("tiny").build("llama", "causal-lm-with-past")
    model = optimize(src, OptimizeOptions(passes=DECODER)).model
    path = tmp_path_factory.mktemp("kvq") / "gqa.onnx"
    io.save(model, path)
    return model, path


@pytest.fixture(scope="module")
def quantized(gqa, tmp_path_factory):
    """bits -> (pass result, path) of the decoder-recipe model with its cache in int8 / int4 (direct calls with
    no budget: the level asked for is applied, the default budget still measured)."""
    out = {}
    for bits in (8, 4):
        model = gqa[0].clone()
        result = QuantizeKVCachePass(bits=str(bits))(model, PassContext(budget_given=False))
        path = tmp_path_factory.mktemp("kvq") / f"kv{bits}.onnx"
        io.save(result.model, path)
        out[bits] = (result, path)
    return out


def _prefill_logits(path, ids: list[int]) -> tuple[np.ndarray, KVCache]:
    dec = open_decoder(path)
    n = len(ids)
    cache = KVCache(dec.sig, 1, n + 4)
    logits = dec.step(cache, np.asarray(ids, np.int64)[None, :], np.ones((1, n), np.int64), None, all_positions=True)
    return logits[0], cache


@pytest.mark.parametrize("bits", [8, 4])
def test_rewrite_types_scales_attributes_metadata(quantized, bits):
    result, _ = quantized[bits]
    assert result.modified and result.rule_counts == {f"kv_cache_int{bits}": 2}, result.notes
    graph = result.model.graph
    assert result.model.metadata_props[quant_cache.KV_QUANT_KEY] == f"int{bits}"
    dtype = ir.DataType.INT8 if bits == 8 else ir.DataType.UINT8
    width = 16 if bits == 8 else 8  # head_dim 16
    for v in list(graph.inputs) + list(graph.outputs):
        if v.name.startswith(("past_key_values.", "present.")):
            assert v.dtype == dtype and v.shape[3] == width, (v.name, v.dtype, v.shape)
    nodes = [n for n in graph if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == 2
    for n in nodes:
        assert n.attributes.get_int("kv_cache_bit_width") == bits
        assert n.attributes.get_string("k_quant_type") == n.attributes.get_string("v_quant_type") == "PER_CHANNEL"
        for past, scale in zip(n.inputs[3:5], n.inputs[12:14]):
            assert scale.name == quant_cache.scale_name(past.name)
            arr = scale.const_value.numpy()
            assert arr.shape == (1, 2, 1, 16) and (arr > 0).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_runtime_holds_the_kernels_bytes(gqa, quantized, bits):
    """The cache buffers are bits/32 of the float ones, and layer 0's hold what quant_cache.quantize makes of
    the float graph's cache with the graph's scales (the kernel quantizes as documented)."""
    _, fpath = gqa
    result, qpath = quantized[bits]
    ids = PROMPTS[0]
    _, fcache = _prefill_logits(fpath, ids)
    _, qcache = _prefill_logits(qpath, ids)
    fbytes = sum(v.nbytes for v in fcache.past().values())
    qbytes = sum(v.nbytes for v in qcache.past().values())
    assert qbytes * 32 == fbytes * bits
    assert open_decoder(qpath).sig.kv_bits == bits
    scales = quant_cache.graph_scales(result.model)[1]
    for name in ("past_key_values.0.key", "past_key_values.0.value"):  # later layers read quantized attention
        q = qcache.past()[name]
        want = quant_cache.quantize(fcache.past()[name], scales[name], bits)
        assert (q != want).mean() < 0.02, name  # rounding ties can fall either way (different op order)
        back = quant_cache.dequantize(q, scales[name], bits)
        qmax = 127 if bits == 8 else 7
        clipped = np.clip(fcache.past()[name], -(qmax + 1) * scales[name], qmax * scales[name])
        assert (np.abs(back - clipped) <= 0.5 * scales[name] + 1e-6).mean() > 0.98, name


def test_logits_near_the_float_cache_int8_closer(gqa, quantized):
    ids = PROMPTS[0] * 4  # 32 tokens
    ref, _ = _prefill_logits(gqa[1], ids)
    err = {}
    for bits in (8, 4):
        got, _ = _prefill_logits(quantized[bits][1], ids)
        err[bits] = np.abs(got - ref).max() / np.abs(ref).max()
        cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert cos.min() > (0.999 if bits == 8 else 0.99), (bits, cos.min())
    assert err[8] < 0.05 and 3 * err[8] < err[4] < 0.25, err  # measured 0.022 and 0.10


def test_int8_greedy_tokens_are_the_float_caches(gqa, quantized):
    want = generate(gqa[1], PROMPTS, max_new_tokens=12).rows
    got = generate(quantized[8][1], PROMPTS, max_new_tokens=12).rows
    assert got == want


def test_pipeline_verifies_the_quantized_graph(gqa):
    """Through the pipeline (verification feeds carry a float past: quant_cache.FloatIO quantizes them)."""
    result = optimize(gqa[1], OptimizeOptions(passes="quantize-kv-cache", overrides=["quantize-kv-cache.bits=8"]))
    rec = next(p for p in result.report.passes if p.name == "quantize-kv-cache")
    assert result.ok and rec.status == "ok" and rec.modified, (rec.status, rec.error, rec.notes)
    assert "ppl_ratio" in rec.verification and rec.verification["ppl_ratio"] < 1.02, rec.verification
    assert result.model.metadata_props[quant_cache.KV_QUANT_KEY] == "int8"


def test_rotating_a_cached_key_by_a_table_row_shifts_its_position(gqa):
    gqa_node = next(n for n in gqa[0].graph if n.op_type == "GroupQueryAttention")
    cos, sin = (gqa_node.inputs[i].const_value.numpy() for i in (7, 8))
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 5, 16)).astype(np.float32)
    p1, p2 = rng.integers(0, 1000, 5), rng.integers(0, 1000, 5)
    twice = rotate(rotate(k, cos[p1], sin[p1], False), cos[p2], sin[p2], False)
    once = rotate(k, cos[p1 + p2], sin[p1 + p2], False)
    np.testing.assert_allclose(twice, once, atol=1e-4)


def test_refusals(gqa, quantized):
    src = load_models_module("tiny").build("llama", "causal-lm-with-past")
    plain = optimize(src, OptimizeOptions(passes="cleanup,fuse")).model
    r = QuantizeKVCachePass(bits="8")(plain, PassContext(budget_given=False))
    assert not r.modified and any("run group-query-attention first" in n for n in r.notes), r.notes
    again = quantized[8][0].model.clone()
    r = QuantizeKVCachePass(bits="4")(again, PassContext(budget_given=False))
    assert not r.modified and any("already quantized" in n for n in r.notes), r.notes
    for bad in ({"bits": "3"}, {"bits": "x"}, {"clip": "p99"}, {"windows": 0}):
        with pytest.raises(UsageError):
            QuantizeKVCachePass(**bad)


def test_signature_refuses_metadata_that_does_not_match(quantized):
    from graphopt.generate.signature import read_signature

    sess = open_decoder(quantized[8][1]).session
    meta = dict(sess.get_modelmeta().custom_metadata_map)
    meta[quant_cache.KV_QUANT_KEY] = "int4"  # the past is int8
    with pytest.raises(UsageError, match="not tensor"):
        read_signature(sess.get_inputs(), sess.get_outputs(), metadata=meta)


def test_centering_values_is_exact_in_float(gqa, tmp_path):
    """Values less a per-channel mean, the mean added to the attention output: the same logits (float cache)."""
    from graphopt.rewrites.kv_cache_quant import _center

    model = gqa[0].clone()
    rng = np.random.default_rng(1)
    nodes = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    for n in nodes:
        _center(model.graph, n, rng.standard_normal((2, 16)).astype(np.float32))
    path = tmp_path / "centered.onnx"
    io.save(model, path)
    ids = PROMPTS[0] * 2
    ref, _ = _prefill_logits(gqa[1], ids)
    got, _ = _prefill_logits(path, ids)
    np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max())
    assert sum(n.op_type in ("Sub", "Add") for n in model.graph) >= 2 * len(nodes)
    assert generate(path, PROMPTS, max_new_tokens=8).rows == generate(gqa[1], PROMPTS, max_new_tokens=8).rows

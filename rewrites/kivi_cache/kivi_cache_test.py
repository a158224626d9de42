"""Tests of kivi-kv-cache on the tiny Llama after the decoder recipe: the bit planes, the runtime's cache
(what it quantizes when, and its bytes), the graph against the float graph fed the same dequantized cache, a
mixed-length batch equal to each prompt alone, the pipeline's verification of the rewritten graph, and the
refusals."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.engine.registry import PassContext
from graphopt.errors import UsageError
from graphopt.generate import kivi
from graphopt.generate.cache import KVCache, new_cache
from graphopt.generate.loop import generate, open_decoder
from graphopt.generate.speculative import speculative_generate
from graphopt.rewrites.kivi_cache import KiviKVCachePass, rewrite

pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny models are exported with torch")

DECODER = "cleanup,fuse,group-query-attention,merge-projections"
FMT = kivi.KiviFormat(sink=2, group=4, key_bits=4, value_bits=3)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    src = load_models_module("tiny").build("llama", "causal-lm-with-past")
    model = optimize(src, OptimizeOptions(passes=DECODER)).model
    path = tmp_path_factory.mktemp("kivi") / "gqa.onnx"
    io.save(model, path)
    return model, path


@pytest.fixture(scope="module")
def kivi_path(gqa, tmp_path_factory):
    model = gqa[0].clone()
    assert rewrite(model, FMT) == 2
    path = tmp_path_factory.mktemp("kivi") / "kivi.onnx"
    io.save(model, path)
    return path


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bit_planes_round_trip_and_codes_bound_the_error(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, (3, 5, 16)).astype(np.uint8)
    planes = kivi.pack(codes, bits)
    assert sum(p.shape[-1] for p in planes) == 16 * bits // 8
    np.testing.assert_array_equal(kivi.unpack(planes, bits), codes)
    x = rng.standard_normal((7, 2, 3, 16)).astype(np.float32)
    q, scale, low = kivi.quantize(x, (2, 3), bits)
    back = q * scale.astype(np.float32) + low.astype(np.float32)
    assert np.all(np.abs(back - x) <= scale.astype(np.float32) * 0.51 + 1e-3)


def test_the_graph_equals_the_float_graph_on_the_dequantized_cache(gqa, kivi_path):
    """Step by step, KIVI's logits equal the float graph's fed the cache KIVI holds, dequantized (1e-4); the
    runtime quantizes keys per full group after the sink and values at once."""
    dec, ref = open_decoder(kivi_path), open_decoder(gqa[1])
    ids = [5, 17, 99, 3, 250, 7, 41, 8, 77, 300, 12, 600, 601, 2, 9, 44]
    cache = new_cache(dec.sig, 1, len(ids) + 1)
    assert isinstance(cache, kivi.KiviCache)
    n0 = 5
    dec.step(cache, np.asarray(ids[:n0])[None], np.ones((1, n0), np.int64), np.arange(n0)[None])
    assert (cache.length, cache.key_groups) == (5, 0)  # 2 sink + 3 in the window
    worst = 0.0
    for t in range(n0, len(ids)):
        past = [cache.dequantized(i) for i in range(dec.sig.layers)]
        fcache = KVCache(ref.sig, 1, t + 1)
        for buf, arr in zip(fcache._shared, [a for kv in past for a in kv], strict=True):
            buf[:, :, :t] = arr
        fcache.length = t
        mask = np.ones((1, t + 1), np.int64)
        want = ref.step(fcache, np.asarray([[ids[t]]]), mask, None)
        got = dec.step(cache, np.asarray([[ids[t]]]), mask, np.asarray([[t]]))
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst < 1e-4, worst
    assert cache.key_groups == (len(ids) - FMT.sink) // FMT.group == 3
    # what it holds is the float cache within the codes' steps (no position moved within a group)
    fcache = KVCache(ref.sig, 1, len(ids))
    ref.step(fcache, np.asarray(ids)[None], np.ones((1, len(ids)), np.int64), None)
    for i in range(dec.sig.layers):
        for held, exact in zip(cache.dequantized(i), (fcache._shared[2 * i], fcache._shared[2 * i + 1]), strict=True):
            err = np.abs(held - exact[:, :, :len(ids)])
            assert err.max() < 0.5 * np.abs(exact).max(), err.max()
            assert np.abs(held - exact[:, :, :len(ids)][:, :, ::-1]).max() > err.max()


def test_a_mixed_length_batch_equals_each_prompt_alone(kivi_path):
    prompts = [[5, 17, 99, 3, 250, 7, 41, 8, 9, 10, 11], [901, 44, 12], [6, 7, 8, 9, 10, 11, 12]]
    batch = generate(kivi_path, prompts, max_new_tokens=12)
    for p, row in zip(prompts, batch.token_ids, strict=True):
        assert generate(kivi_path, p, max_new_tokens=12).token_ids == row


def test_bytes_per_token_under_a_quarter_of_float16():
    f = kivi.KiviFormat()  # the pass's defaults, SmolLM2's shapes
    per = f.bytes_per_token(4096, 30, 3, 64)
    assert per <= 30 * 2 * 3 * 64 * 2 / 4, per
    assert f.bytes_per_token(4, 30, 3, 64) == 30 * 2 * 3 * 64 * 2  # all sink: float16


def test_pipeline_verifies_the_rewritten_graph(gqa):
    """Through the pipeline: verification feeds carry a float past (kivi.KiviIO quantizes them)."""
    result = optimize(gqa[1], OptimizeOptions(passes="kivi-kv-cache", budget="ppl_ratio<=1.5",
                                              overrides=["kivi-kv-cache.group=16", "kivi-kv-cache.sink=2"]))
    rec = next(p for p in result.report.passes if p.name == "kivi-kv-cache")
    assert result.ok and rec.status == "ok" and rec.modified, (rec.status, rec.error, rec.notes)
    assert result.model.metadata_props["graphopt.kv_cache"] == "kivi"
    assert any("bytes/token" in n for n in rec.notes), rec.notes


def test_refusals(gqa, kivi_path):
    src = load_models_module("tiny").build("llama", "causal-lm-with-past")
    plain = optimize(src, OptimizeOptions(passes="cleanup,fuse")).model
    r = KiviKVCachePass()(plain, PassContext(budget_given=False))
    assert not r.modified and any("shared-buffer" in n for n in r.notes), r.notes
    model = gqa[0].clone()
    r = KiviKVCachePass(group=16, sink=2)(model, PassContext(budget_given=True, budget=_budget("ppl_ratio<=1.5,greedy_match>=0.99")))
    assert not r.modified and r.budget_met is False, r.notes
    with pytest.raises(UsageError, match="2, 3 or 4 bits"):
        KiviKVCachePass(value_bits=5)
    with pytest.raises(UsageError, match="speculative"):
        speculative_generate(open_decoder(kivi_path), [5, 6, 7], max_new_tokens=4, draft="lookup")
    from graphopt.generate.scheduler import Scheduler

    with pytest.raises(UsageError, match="continuous batching"):
        Scheduler(open_decoder(kivi_path), slots=2, context=64)


def _budget(spec: str):
    from graphopt.data.metrics import parse_budget

    return parse_budget(spec)


def test_int4_kivi_recipe_on_the_tiny_llama(run_cli, tiny_llama, tmp_path):
    """The recipe end to end (exit 0): 4-bit weights, the KIVI cache, then the passes after it; it generates."""
    out = tmp_path / "k.onnx"
    code, _, err = run_cli("optimize", tiny_llama, "-o", out, "--recipe", "int4-kivi",
                           "--set", "quantize-int4.block_sizes=32", "--set", "quantize-int4.accuracy_levels=1",
                           "--set", "kivi-kv-cache.group=16", "--set", "kivi-kv-cache.sink=2",
                           "--budget", "ppl_ratio<=1.5")
    assert code == 0, err
    model = io.load(out)
    assert model.metadata_props["graphopt.kv_cache"] == "kivi"
    ops = {n.op_type for n in model.graph}
    assert "MatMulNBits" in ops and "GroupQueryAttention" not in ops
    got = generate(out, [5, 17, 99, 3] * 10, max_new_tokens=24)
    assert len(got.token_ids) == 24

"""speculative-heads (Medusa-1 heads as an extra output) and the heads draft: logits and cache bit-identical,
greedy tokens = plain decoding, the draft reads the heads of the last verified position, the pass declines when
the heads do not pay, and the runtime warns on MatMulNBits accuracy_level 4."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.engine.registry import builtin
from graphopt.errors import UsageError
from graphopt.generate.cache import KVCache
from graphopt.generate.loop import generate, open_decoder
from graphopt.generate.medusa import OUTPUT, MedusaDraft, heads_of
from graphopt.generate.speculative import speculative_generate

pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny models are exported with torch; the heads are fitted with torch")

FAST = {"prompts": 6, "new_tokens": 24, "epochs": 20, "fit_seconds": 20.0, "threads": 1}
PROMPTS = [[5, 17, 99, 3, 250, 7], [901, 44, 12, 600, 31], [8]]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    src = load_models_module("tiny").build("llama", "causal-lm-with-past")
    out = tmp_path_factory.mktemp("medusa") / "llama.gqa.onnx"
    io.save(optimize(src, OptimizeOptions()).model, out)
    return out


@pytest.fixture(scope="module")
def heads(gqa, tmp_path_factory):
    model = io.load(gqa)
    result = builtin().create("speculative-heads", {**FAST, "min_gain": 0.0})(model)
    assert result.modified, result.notes
    assert "held-out acceptance" in result.notes[0]
    out = tmp_path_factory.mktemp("medusa") / "llama.heads.onnx"
    io.save(result.model, out)
    return out


def _full(dec, seq):
    cache = KVCache(dec.sig, 1, len(seq))
    n = len(seq)
    logits = dec.step(cache, np.asarray([seq], np.int64), np.ones((1, n), np.int64),
                      np.arange(n, dtype=np.int64)[None], all_positions=True)
    return logits, dict(dec.extras)


def test_heads_output_metadata_and_bit_identical_logits_and_cache(gqa, heads):
    plain, with_heads = open_decoder(gqa), open_decoder(heads)
    assert heads_of(with_heads.session) == 3 and heads_of(plain.session) == 0
    assert dict(with_heads.session.get_modelmeta().custom_metadata_map)["graphopt.speculative"] == "medusa:3"
    plain.extra_outputs = ()
    with_heads.extra_outputs = (OUTPUT,)
    seq = [5, 17, 99, 3, 250, 7, 1, 40]
    for dec in (plain, with_heads):
        cache = KVCache(dec.sig, 1, len(seq))
        first = dec.step(cache, np.asarray([seq[:5]], np.int64), np.ones((1, 5), np.int64),
                         np.arange(5, dtype=np.int64)[None], all_positions=True)
        # a chunk on top of the past: its logits depend on the present cache of the first forward
        second = dec.step(cache, np.asarray([seq[5:]], np.int64), np.ones((1, 8), np.int64),
                          np.arange(5, 8, dtype=np.int64)[None], all_positions=True)
        dec.got = (first, second)
    for x, y in zip(plain.got, with_heads.got, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert with_heads.extras[OUTPUT].shape == (1, 3, 3, plain.got[0].shape[-1])


def test_greedy_with_heads_equals_plain(heads):
    dec = open_decoder(heads)
    for prompt in PROMPTS:
        want = generate(dec, prompt, max_new_tokens=30).token_ids
        for mode in ("heads", "auto"):
            g = speculative_generate(dec, prompt, max_new_tokens=30, draft=mode)
            assert g.token_ids == want and g.draft == "heads" and g.warning is None


def test_draft_is_the_heads_top1_at_the_last_verified_position(heads):
    dec = open_decoder(heads)
    seen = []

    class Recording(MedusaDraft):
        def propose(self, context, k):
            got = super().propose(context, k)
            seen.append((list(context), got))
            return got

    draft = Recording(dec)
    speculative_generate(dec, PROMPTS[0], max_new_tokens=20, draft=draft)
    assert len(seen) >= 5
    check = open_decoder(heads)
    check.extra_outputs = (OUTPUT,)
    for context, got in seen:
        # the newest token was chosen at position len - 2; its heads guess the tokens after it
        _, extras = _full(check, context[:-1])
        want = extras[OUTPUT][0, -1].argmax(-1)[:len(got)].tolist()
        assert got == want


def test_declines_when_the_heads_do_not_pay(gqa):
    model = io.load(gqa)
    before = ([o.name for o in model.graph.outputs], len(list(model.graph)), sorted(model.graph.initializers))
    result = builtin().create("speculative-heads", {**FAST, "epochs": 1, "min_gain": 100.0})(model)
    assert not result.modified
    assert any("declined" in n for n in result.notes)
    after = ([o.name for o in model.graph.outputs], len(list(model.graph)), sorted(model.graph.initializers))
    assert after == before and "graphopt.speculative" not in model.metadata_props


def test_refuses_a_graph_that_has_heads_and_heads_mode_needs_them(gqa, heads):
    result = builtin().create("speculative-heads", FAST)(io.load(heads))
    assert not result.modified and "already has" in result.notes[0]
    with pytest.raises(UsageError, match="no Medusa heads"):
        speculative_generate(open_decoder(gqa), PROMPTS[0], max_new_tokens=4, draft="heads")
    g = speculative_generate(open_decoder(gqa), PROMPTS[0], max_new_tokens=4, draft="auto")
    assert g.draft == "lookup"


def test_warns_on_matmulnbits_accuracy_level_4(gqa, tmp_path, caplog):
    model = io.load(gqa)
    result = builtin().create("quantize-int4", {"block_sizes": "32", "accuracy_levels": "4"})(model)
    assert result.modified
    path = tmp_path / "q4.onnx"
    io.save(result.model, path)
    with caplog.at_level(logging.WARNING, logger="graphopt.generate.multirow"):
        g = speculative_generate(str(path), PROMPTS[0], max_new_tokens=6)
        again = speculative_generate(str(path), PROMPTS[1], max_new_tokens=6)
    assert g.warning and "accuracy_level 4" in g.warning
    assert again.warning == g.warning  # every generation carries it
    assert g.as_dict()["speculative_warning"] == g.warning
    # logged once per file, not once per generation (a benchmark's log repeated it for every round)
    assert sum("accuracy_level 4" in r.getMessage() for r in caplog.records) == 1
    assert speculative_generate(str(gqa), PROMPTS[0], max_new_tokens=6).warning is None


def test_the_multirow_check_reads_a_graph_once_per_file(gqa, monkeypatch):
    """It used to load the whole ONNX file on every generation (seconds for a 540 MB fp32 decoder)."""
    from graphopt.generate import multirow

    loads = []
    real = multirow.io.load
    monkeypatch.setattr(multirow.io, "load", lambda path, *a, **k: loads.append(path) or real(path, *a, **k))
    multirow._file_warning.cache_clear()
    dec = open_decoder(gqa)
    for _ in range(3):
        assert speculative_generate(dec, PROMPTS[0], max_new_tokens=4).warning is None
    assert len(loads) == 1


def test_lm_head_tied_to_the_embedding_through_a_transpose(gqa, tmp_path):
    import onnx_ir as ir

    from graphopt.rewrites.speculative_heads.graph import add_heads, find_lm_head

    model = io.load(gqa)
    head = next(o for o in model.graph.outputs if o.name == "logits").producer()
    weight = head.inputs[1].const_value.numpy()
    tied = ir.Value(name="tied_embedding", const_value=ir.tensor(np.ascontiguousarray(weight.T), name="tied_embedding"))
    model.graph.register_initializer(tied)
    t = ir.Node("", "Transpose", [tied], attributes=[ir.AttrInt64s("perm", [1, 0])], name="tie")
    model.graph.insert_before(head, t)
    head.replace_input_with(1, t.outputs[0])
    found = find_lm_head(model)
    assert not isinstance(found, str)
    node, h, w = found
    assert node is head and np.array_equal(w, weight)
    k, hidden = 2, weight.shape[0]
    rng = np.random.default_rng(0)
    add_heads(model, node, h, rng.normal(0, 0.1, (k, hidden, hidden)).astype(np.float32),
              rng.normal(0, 0.1, (k, hidden)).astype(np.float32))
    model.metadata_props["graphopt.speculative"] = f"medusa:{k}"
    path = tmp_path / "tied.onnx"
    io.save(model, path)
    dec = open_decoder(path)
    assert heads_of(dec.session) == k
    dec.extra_outputs = (OUTPUT,)
    logits, extras = _full(dec, [5, 17, 99])
    assert extras[OUTPUT].shape == (1, 3, k, weight.shape[1])
    prompt = PROMPTS[0]
    assert speculative_generate(dec, prompt, max_new_tokens=12, draft="heads").token_ids == \
        generate(open_decoder(gqa), prompt, max_new_tokens=12).token_ids

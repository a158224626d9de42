"""layer-skip-draft (the first layers and a least-squares exit head as the draft) and separate draft models:
greedy tokens = plain decoding on the plain export (own draft cache) and the decoder recipe's shared-buffer
graph (the draft binds the model's cache), the model's outputs untouched, the decline with its table, the
residual stream found by dependency, the draft policy charging draft forwards, and the refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import summed_head

from conftest import load_models_module
from graphopt import io
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.pipeline import optimize
from graphopt.engine.registry import builtin
from graphopt.errors import UsageError
from graphopt.generate import layer_skip
from graphopt.generate.draft_model import ModelDraft, open_draft
from graphopt.generate.draft_policy import DraftPolicy
from graphopt.generate.loop import generate, open_decoder
from graphopt.generate.sampling import Sampling
from graphopt.generate.speculative import speculative_generate
from graphopt.rewrites.layer_skip.graph import find_hidden, hidden_width

pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny models are exported with torch")

PROMPTS = [[5, 17, 99, 3, 250, 7, 5, 17, 99, 3], [901, 44, 12, 600, 31], [8]]
FAST = {"prompts": 4, "prompt_tokens": 8, "new_tokens": 16, "drafts": 3, "repeats": 1, "threads": 1}


@pytest.fixture(scope="module", params=["export", "decoder-recipe", "summed-head"])
def graphs(request, tmp_path_factory):
    """(the model, the model with a layer-skip draft) as files."""
    src = load_models_module("tiny").build("llama", "causal-lm-with-past")
    d = tmp_path_factory.mktemp("ls")
    base = d / "base.onnx"
    model = io.load(src) if request.param == "export" else optimize(src, OptimizeOptions()).model
    io.save(summed_head(model) if request.param == "summed-head" else model, base)
    model = io.load(base)
    result = builtin().create("layer-skip-draft", {**FAST, "min_gain": 0.0})(model)
    assert result.modified, result.notes
    out = d / "ls.onnx"
    io.save(model, out)
    return base, out


def test_pass_keeps_the_model_and_records_the_draft(graphs):
    base, out = graphs
    a, b = open_decoder(base), open_decoder(out)
    meta = dict(b.session.get_modelmeta().custom_metadata_map)
    spec = layer_skip.spec_of(meta)
    assert spec["layers"] == 1 and spec["drafts"] >= 1 and len(spec["chain"]) == FAST["drafts"]
    assert [o.name for o in a.session.get_outputs()] == [o.name for o in b.session.get_outputs()]
    assert layer_skip.MAP in ir.load(out).graph.initializers
    from graphopt.generate.cache import KVCache

    n = len(PROMPTS[0])
    logits = []
    for d in (a, b):
        cache = KVCache(d.sig, 1, n)
        logits.append(d.step(cache, np.asarray([PROMPTS[0]], np.int64), np.ones((1, n), np.int64),
                             np.arange(n, dtype=np.int64)[None], all_positions=True))
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.parametrize("sampling", [Sampling(), Sampling().masking([2])])
def test_layer_skip_greedy_equals_plain(graphs, sampling):
    _, out = graphs
    dec = open_decoder(out)
    drafted = 0
    for prompt in PROMPTS:
        plain = generate(dec, prompt, max_new_tokens=24, sampling=sampling)
        spec = speculative_generate(dec, prompt, max_new_tokens=24, sampling=sampling, draft="layer-skip")
        assert spec.token_ids == plain.token_ids and spec.draft == "layer-skip"
        drafted += spec.drafted
        assert spec.accepted <= spec.drafted
    assert drafted > 0
    auto = speculative_generate(dec, PROMPTS[0], max_new_tokens=8, draft="auto")
    assert auto.draft == "layer-skip"


def test_layer_skip_draft_shares_the_cache_of_a_shared_buffer_graph(graphs):
    base, out = graphs
    dec = open_decoder(out)
    draft = layer_skip.LayerSkipDraft(dec)
    from graphopt.generate.cache import KVCache, SharedLayers

    cache = KVCache(dec.sig, 1, 32)
    draft.attach(cache)
    assert isinstance(draft.cache, SharedLayers) == dec.sig.shared_buffer
    assert draft.decoder.sig.layers == 1 and dec.sig.layers == 2


def test_draft_model_greedy_equals_plain(graphs, tmp_path):
    base, out = graphs
    dec = open_decoder(base)
    small = tmp_path / "draft.onnx"  # a one-layer decoder of the same vocabulary: the layer-skip draft, as a file
    spec = layer_skip.spec_of(dict(open_decoder(out).session.get_modelmeta().custom_metadata_map))
    io.save(layer_skip.draft_graph(ir.load(out), spec["layers"], spec["hidden"]), small)
    gpt2 = load_models_module("tiny").build("gpt2", "causal-lm-with-past")  # another architecture, same vocabulary
    for draft_path, full in ((small, False), (gpt2, False), (base, True)):
        accepted = 0
        for prompt in PROMPTS:
            plain = generate(dec, prompt, max_new_tokens=20)
            got = speculative_generate(dec, prompt, max_new_tokens=20, draft="off", draft_model=draft_path)
            assert got.token_ids == plain.token_ids and got.draft == "draft-model"
            accepted += got.accepted
            # the default mode, lookup: prompt lookup where the context repeats, the draft model elsewhere
            both = speculative_generate(dec, prompt, max_new_tokens=20, draft_model=draft_path)
            assert both.token_ids == plain.token_ids and both.draft == "lookup+draft-model"
        if full:  # the model drafting for itself: every checked draft is kept
            assert accepted > 0


def test_model_draft_catches_up_after_a_rejection(graphs):
    base, _ = graphs
    dec = open_decoder(base)
    draft = ModelDraft(open_decoder(base))
    from graphopt.generate.cache import KVCache

    draft.attach(KVCache(dec.sig, 1, 64))
    first = draft.propose([5, 17, 99], 3)
    assert len(first) == 3 and draft.cache.length == 5
    # the model kept one draft and chose another token: the draft rolls back to the kept prefix
    again = draft.propose([5, 17, 99, first[0], (first[1] + 1) % 1000], 2)
    ref = ModelDraft(open_decoder(base))
    ref.attach(KVCache(dec.sig, 1, 64))
    assert again == ref.propose([5, 17, 99, first[0], (first[1] + 1) % 1000], 2)


def test_declines_with_its_table(graphs):
    base, _ = graphs
    model = io.load(base)
    result = builtin().create("layer-skip-draft", {**FAST, "min_gain": 100.0})(model)
    assert not result.modified
    text = "\n".join(result.notes)
    assert "declined" in text and "L=1" in text and "P(first j kept)" in text
    assert layer_skip.SPECULATIVE_KEY not in model.metadata_props


def test_finds_the_residual_stream_and_cuts_the_draft(graphs):
    base, _ = graphs
    model = ir.load(base)
    h = find_hidden(model.graph, 1, hidden_width(model.graph))
    assert not isinstance(h, str)
    assert h.producer().op_type in ("Add", "SkipSimplifiedLayerNormalization")
    assert isinstance(find_hidden(model.graph, 1, 7), str)
    sub = layer_skip.draft_graph(model, 1, h.name, np.eye(64, dtype=np.float32), np.zeros(64, np.float32))
    assert {v.name for v in sub.graph.inputs if v.name.startswith("past")} == {"past_key_values.0.key",
                                                                                "past_key_values.0.value"}
    with pytest.raises(UsageError, match="no value 'nope'"):
        layer_skip.draft_graph(ir.load(base), 1, "nope")


def test_refusals(graphs, tmp_path):
    base, _ = graphs
    dec = open_decoder(base)
    with pytest.raises(UsageError, match="carries no layer-skip draft"):
        speculative_generate(dec, PROMPTS[0], max_new_tokens=4, draft="layer-skip")
    other = load_models_module("tiny").build("llama", "causal-lm")  # no past
    with pytest.raises(UsageError, match="not a decoder with past"):
        open_draft(other, dec)
    other_vocab = open_decoder(base)
    other_vocab.sig = dataclasses.replace(other_vocab.sig, vocab=999)
    with pytest.raises(UsageError, match="the draft's vocabulary is 999 tokens, the model's 1000"):
        open_draft(other_vocab, dec)
    with pytest.raises(UsageError, match="layers must be"):
        builtin().create("layer-skip-draft", {"layers": "a,b"})


def test_policy_charges_draft_forwards():
    p = DraftPolicy(8, prior={"m": 0.6})
    p.observe("m", [], [1], 1, 0.010)  # a plain step timed: 10 ms
    assert p.length("m", 4) > 0
    assert p.length("m", 4, draft_seconds=0.001) > 0
    assert p.length("m", 4, draft_seconds=0.009) == 0  # drafting costs almost a step per token: no drafts pay


def test_model_draft_times_its_drafting_forwards_not_a_catch_up_chunk(graphs):
    """A drafted token costs a one- or two-token forward; the chunk a draft feeds after steps that drafted nothing
    is no measure of it (it made a probing draft look as costly as the whole chunk, and drafting stopped)."""
    base, _ = graphs
    from graphopt.generate.cache import KVCache

    draft = ModelDraft(open_decoder(base))
    draft.attach(KVCache(open_decoder(base).sig, 1, 64))
    context = [5, 17, 99, 3, 250, 7, 8, 9]
    assert len(draft.propose(context, 1)) == 1 and draft.seconds_per_token is None  # one forward of 8 tokens
    out = draft.propose(context, 3)  # the context is fed already: one-token forwards
    assert len(out) == 3 and draft.seconds_per_token is not None and draft.seconds_per_token > 0


def test_a_model_draft_carries_its_acceptance_to_the_next_generation(graphs):
    base, _ = graphs
    dec = open_decoder(base)
    draft = ModelDraft(open_decoder(base))  # the model drafting for itself: every checked draft is kept
    assert draft.priors[draft.name] == 0.5
    first = speculative_generate(dec, PROMPTS[0], max_new_tokens=24, draft=draft)
    assert first.token_ids == generate(dec, PROMPTS[0], max_new_tokens=24).token_ids and first.accepted > 0
    assert draft.priors[draft.name] > 0.75  # from 0.5: every draft it checked was kept
    prior = draft.priors[draft.name]
    again = speculative_generate(dec, PROMPTS[0], max_new_tokens=24, draft=draft)  # starts from what it learnt
    assert again.token_ids == first.token_ids and draft.priors[draft.name] >= min(prior, 0.75)



def test_a_draft_of_the_targets_shape_runs_on_its_cache(graphs, tmp_path):
    """The model's own int4 build as its draft: on a shared-buffer graph the draft binds the target's cache
    buffers (reads the exact K/V, never prefills the prompt, feeds one token a forward); on a plain export it
    keeps its own cache and prefills it. Greedy tokens equal plain decoding's either way."""
    from graphopt.generate.cache import KVCache, SharedLayers

    base, _ = graphs
    model = io.load(base)
    assert builtin().create("quantize-int4", {"block_sizes": "32", "accuracy_levels": "4"})(model).modified
    int4 = tmp_path / "int4.onnx"
    io.save(model, int4)
    dec = open_decoder(base)
    draft = open_draft(int4, dec)
    widths = []
    step = draft.decoder.step

    def record(cache, ids, *a, **k):
        widths.append(ids.shape[1])
        return step(cache, ids, *a, **k)

    draft.decoder.step = record
    for prompt in PROMPTS:
        got = speculative_generate(dec, prompt, max_new_tokens=16, draft=draft)
        assert got.token_ids == generate(dec, prompt, max_new_tokens=16).token_ids
    assert widths, "the draft never ran"
    if dec.sig.shared_buffer:
        assert isinstance(draft.cache, SharedLayers) and max(widths) == 1
    else:
        assert isinstance(draft.cache, KVCache) and max(widths) >= len(PROMPTS[1])


def test_auto_takes_the_draft_saved_beside_the_model(graphs, tmp_path):
    """``--speculative auto``: NAME.draft.onnx beside NAME.onnx is the draft (prompt lookup first); without one
    the graph's own drafts or prompt lookup as before; a draft file does not look for a draft of its own."""
    import shutil

    from graphopt.generate.speculative import sibling_draft

    base, _ = graphs
    target = tmp_path / "model.onnx"
    shutil.copy(base, target)
    dec = open_decoder(target)
    assert sibling_draft(dec) is None
    plain = [generate(dec, p, max_new_tokens=16).token_ids for p in PROMPTS]
    assert speculative_generate(dec, PROMPTS[0], max_new_tokens=16, draft="auto").draft == "lookup"
    model = io.load(base)
    assert builtin().create("quantize-int4", {"block_sizes": "32", "accuracy_levels": "4"})(model).modified
    io.save(model, tmp_path / "model.draft.onnx")
    assert sibling_draft(dec) == tmp_path / "model.draft.onnx"
    for prompt, want in zip(PROMPTS, plain):
        got = speculative_generate(dec, prompt, max_new_tokens=16, draft="auto")
        assert got.draft == "lookup+draft-model" and got.token_ids == want
    assert sibling_draft(open_decoder(tmp_path / "model.draft.onnx")) is None
    # another mode named explicitly is not replaced by the file
    assert speculative_generate(dec, PROMPTS[0], max_new_tokens=8, draft="lookup").draft == "lookup"

"""Tests of ``early-exit`` on a tiny hand-built post-LN encoder (exactness, pooling, thresholds, branch
weights); the real MiniLM cases (slow) are in ``early_exit_minilm_test.py``."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest

from graphopt.data import metrics
from graphopt.engine.registry import PassContext
from graphopt.rewrites.common.bounds import agreement_lower_bound
from graphopt.rewrites.early_exit import EarlyExitPass
from graphopt.rewrites.early_exit.heads import pool_features
from graphopt.rewrites.early_exit.layers import find_layers
from graphopt.runtime import session as runtime

LAYERS, HIDDEN, CLASSES, VOCAB = 3, 16, 3, 40


def _tiny_encoder(*, seed: int = 0, classifier: bool = True, pooling: str = "cls") -> ir.Model:
    """ids, mask [batch, seq] -> embeddings + LN -> 3 post-LN layers (1-head attention, ReLU FFN) ->
    first-token (``pooling="mean"``: masked mean, as sentence-transformers export it) Gemm -> logits
    [batch, 3] (or the last hidden state [batch, seq, 16])."""
    rng = np.random.default_rng(seed)
    batch, seq = ir.SymbolicDim("batch"), ir.SymbolicDim("sequence")
    ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([batch, seq]))
    mask = ir.Value(name="attention_mask", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([batch, seq]))
    tape = ir.tape.Tape()

    count = iter(range(1000))

    def w(*shape, scale=0.5):
        return tape.initializer(ir.tensor(rng.normal(0, scale, shape).astype(np.float32), name=f"w{next(count)}"))

    def ln(x):
        if pooling == "mean":  # unit-scale norms: the pooled tokens, not the biases, decide the class
            gamma = tape.initializer(ir.tensor(np.ones(HIDDEN, np.float32), name=f"w{next(count)}"))
            return tape.op("LayerNormalization", [x, gamma, w(HIDDEN, scale=0.01)], {"axis": -1})
        return tape.op("LayerNormalization", [x, w(HIDDEN, scale=0.1), w(HIDDEN, scale=0.1)], {"axis": -1})

    h = ln(tape.op("Gather", [w(VOCAB, HIDDEN, scale=1.0), ids]))
    neg = tape.initializer(ir.tensor(np.array(-1e4, np.float32), name="neg"))
    one = tape.initializer(ir.tensor(np.array(1.0, np.float32), name="one"))
    axes = tape.initializer(ir.tensor(np.array([1], np.int64), name="axes1"))
    bias = tape.op("Unsqueeze", [tape.op("Mul", [tape.op("Sub", [one, tape.op("Cast", [mask], {"to": ir.DataType.FLOAT})]),
                                               neg]), axes])
    for _ in range(LAYERS):
        q, k, v = (tape.op("MatMul", [h, w(HIDDEN, HIDDEN)]) for _ in range(3))
        s = tape.op("Add", [tape.op("MatMul", [q, tape.op("Transpose", [k], {"perm": [0, 2, 1]})]), bias])
        ctx = tape.op("MatMul", [tape.op("Softmax", [s], {"axis": -1}), v])
        h1 = ln(tape.op("Add", [tape.op("MatMul", [ctx, w(HIDDEN, HIDDEN)]), h]))
        f = tape.op("MatMul", [tape.op("Relu", [tape.op("MatMul", [h1, w(HIDDEN, 32)])]), w(32, HIDDEN)])
        h = ln(tape.op("Add", [f, h1]))
    if classifier and pooling == "mean":
        m = tape.op("Cast", [tape.op("Unsqueeze", [mask, tape.initializer(ir.tensor(np.array([-1], np.int64),
                                                                               name="axes_last"))])],
                    {"to": ir.DataType.FLOAT})
        num = tape.op("ReduceSum", [tape.op("Mul", [h, m]), axes], {"keepdims": 0})
        eps = tape.initializer(ir.tensor(np.array(1e-9, np.float32), name="eps"))
        den = tape.op("Clip", [tape.op("ReduceSum", [m, axes], {"keepdims": 0}), eps])
        out = tape.op("Gemm", [tape.op("Div", [num, den]), w(HIDDEN, CLASSES, scale=2.0), w(CLASSES, scale=0.01)])
        out.name = "logits"
    elif classifier:
        zero = tape.initializer(ir.tensor(np.array(0, np.int64), name="zero"))
        out = tape.op("Gemm", [tape.op("Gather", [h, zero], {"axis": 1}), w(HIDDEN, CLASSES), w(CLASSES)])
        out.name = "logits"
    else:
        out = tape.op("Identity", [h])
        out.name = "last_hidden_state"
    graph = ir.Graph([ids, mask], [out], nodes=tape.nodes, initializers=tape.initializers, opset_imports={"": 20})
    model = ir.Model(graph, ir_version=10)
    common_passes.ShapeInferencePass()(model)
    common_passes.NameFixPass()(model)
    return model


def _feeds(n: int, batch: int = 8, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = int(rng.integers(4, 9))
        ids = rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)
        mask = np.ones((batch, seq), np.int64)
        for r in range(batch):
            mask[r, int(rng.integers(2, seq + 1)) :] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _topic_feeds(n: int, batch: int = 16, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """Rows of one of 4 topics each: most tokens from the topic's 8 words, a few from the whole vocabulary."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = int(rng.integers(6, 12))
        topic = rng.integers(0, 4, batch)
        ids = (topic[:, None] * 8 + rng.integers(0, 8, (batch, seq))).astype(np.int64)
        noise = rng.random((batch, seq)) < 0.05
        ids[noise] = rng.integers(0, VOCAB, int(noise.sum()))
        mask = np.ones((batch, seq), np.int64)
        for r in range(batch):
            mask[r, int(rng.integers(4, seq + 1)) :] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _run(model: ir.Model, feeds, outputs=None):
    sess = runtime.make_session(model, optimize=False)
    return runtime.run(sess, feeds, outputs)


def _hidden(model: ir.Model, layer: int, feeds) -> list[np.ndarray]:
    """The original model's layer output ``layer`` (1-based) on each feed."""
    clone = ir.from_proto(ir.to_proto(model))
    h = find_layers(clone.graph)[0][layer - 1]
    clone.graph.outputs.append(h)
    return [r[h.name] for r in _run(clone, feeds, [h.name])]


def _head_logits(rewritten: ir.Model, layer: int, h: np.ndarray, mask: np.ndarray, pool: str) -> np.ndarray:
    inits = rewritten.graph.initializers
    x = pool_features(h, mask, pool)
    i = 0
    while f"early_exit/L{layer}/head_w{i}" in inits:
        w = inits[f"early_exit/L{layer}/head_w{i}"].const_value.numpy()
        b = inits[f"early_exit/L{layer}/head_b{i}"].const_value.numpy()
        x = x @ w + b
        if f"early_exit/L{layer}/head_w{i + 1}" in inits:
            x = np.tanh(x)
        i += 1
    assert i >= 1, "no exit head initializers"
    return x


def _apply(model: ir.Model, calib, **options):
    return EarlyExitPass(**options)(model, PassContext(calib_feeds=calib))


def test_finds_one_boundary_per_layer():
    layers, why = find_layers(_tiny_encoder().graph)
    assert why == "" and len(layers) == LAYERS
    assert all(v.producer().op_type == "LayerNormalization" for v in layers)


@pytest.mark.parametrize("mode", ["batch", "row"])
@pytest.mark.parametrize("criterion", ["maxprob", "entropy"])
def test_never_exit_equals_original_exactly(mode, criterion):
    model, calib, feeds = _tiny_encoder(), _feeds(6), _feeds(3, seed=7)
    ref = _run(model, feeds)
    result = _apply(model, calib, mode=mode, criterion=criterion, threshold=1.5, layers="1,2", exit_output="exit_layer")
    assert result.modified and result.rule_counts == {"exit": 2, "If": 2}
    assert sum(n.op_type == "If" for n in model.graph) == 1  # nested: the second If is inside the first
    got = _run(model, feeds)
    for g, r in zip(got, ref):
        assert np.array_equal(g["logits"], r["logits"])
        assert (g["exit_layer"] == LAYERS).all()


@pytest.mark.parametrize("mode", ["batch", "row"])
@pytest.mark.parametrize("k,pool", [(1, "cls+mean"), (2, "cls+mean"), (1, "max"), (2, "last")])
def test_always_exit_at_layer_k_equals_its_head(mode, k, pool):
    base = _tiny_encoder()
    model, calib, feeds = _tiny_encoder(), _feeds(6), _feeds(3, seed=7)
    result = _apply(model, calib, mode=mode, threshold=0.0, layers=str(k), head="mlp", pool=pool,
                    exit_output="exit_layer")
    assert result.modified
    got = _run(model, feeds)
    for g, h, f in zip(got, _hidden(base, k, feeds), feeds):
        want = _head_logits(model, k, h, f["attention_mask"], pool)
        np.testing.assert_allclose(g["logits"], want, rtol=1e-4, atol=1e-4)
        assert (g["exit_layer"] == k).all()


def test_row_mode_returns_rows_in_their_original_order():
    base, model = _tiny_encoder(), _tiny_encoder()
    calib, feeds = _feeds(6), _feeds(4, batch=16, seed=9)
    probe = _tiny_encoder()
    _apply(probe, calib, layers="1", threshold=0.0, head="linear", pool="cls")
    h1 = np.concatenate(_hidden(base, 1, feeds)[:1])
    inv_t = probe.graph.initializers["early_exit/L1/inv_temperature"].const_value.numpy()
    scores = metrics_softmax_max(inv_t * _head_logits(probe, 1, h1, feeds[0]["attention_mask"], "cls"))
    threshold = float(np.median(scores))  # about half the rows of the first feed leave at layer 1
    result = _apply(model, calib, mode="row", layers="1", threshold=threshold, head="linear", pool="cls",
                    criterion="maxprob", exit_output="exit_layer")
    assert result.modified
    ref = _run(base, feeds)
    got = _run(model, feeds)
    mixed = 0
    for g, r, h, f in zip(got, ref, _hidden(base, 1, feeds), feeds):
        exited = g["exit_layer"] == 1
        assert set(np.unique(g["exit_layer"])) <= {1, LAYERS}
        mixed += int(exited.any() and not exited.all())
        head = _head_logits(model, 1, h, f["attention_mask"], "cls")
        np.testing.assert_allclose(g["logits"][exited], head[exited], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g["logits"][~exited], r["logits"][~exited], rtol=1e-5, atol=1e-5)
    assert mixed >= 2, "the test needs feeds where some rows exit and others go deeper"


def metrics_softmax_max(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return (z / z.sum(-1, keepdims=True)).max(-1)


def test_patience_never_and_always():
    model, calib, feeds = _tiny_encoder(), _feeds(6), _feeds(2, seed=7)
    ref = _run(model, feeds)
    result = _apply(model, calib, criterion="patience", threshold=5, layers="1,2", exit_output="exit_layer")
    assert result.modified
    for g, r in zip(_run(model, feeds), ref):
        assert np.array_equal(g["logits"], r["logits"])
    model = _tiny_encoder()
    _apply(model, calib, criterion="patience", threshold=1, layers="2", exit_output="exit_layer", mode="row")
    assert all((g["exit_layer"] == 2).all() for g in _run(model, feeds))


def test_refuses_without_layers():
    tape = ir.tape.Tape()
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([ir.SymbolicDim("batch"), 4]))
    y = tape.op("MatMul", [x, tape.initializer(ir.tensor(np.ones((4, 2), np.float32), name="w"))])
    y.name = "y"
    model = ir.Model(ir.Graph([x], [y], nodes=tape.nodes, initializers=tape.initializers, opset_imports={"": 20}),
                     ir_version=10)
    result = _apply(model, [{"x": np.ones((4, 4), np.float32)}])
    assert not result.modified and "no layer boundaries" in result.notes[0]
    assert [n.op_type for n in model.graph] == ["MatMul"]


def test_refuses_embedding_output_with_fidelity_table():
    model = _tiny_encoder(classifier=False)
    before = [n.op_type for n in model.graph]
    result = EarlyExitPass()(model, PassContext(calib_feeds=_feeds(6), budget=metrics.parse_budget("cosine>=0.99,max_abs<=0")))
    assert not result.modified and result.budget_met is False
    assert "not class logits" in result.notes[0]
    assert "layer 1: cosine" in result.notes[0] and "layer 2: cosine" in result.notes[0]
    assert [n.op_type for n in model.graph] == before


def test_after_quantize_the_quantized_layers_move_into_the_branches():
    from graphopt.engine import registry

    model = _tiny_encoder()
    q = registry.builtin().create("quantize", {"mode": "dynamic"})(
        model, PassContext(calib_feeds=_feeds(4), feeds=_feeds(2, seed=3), budget=metrics.parse_budget("top1>=0.5")))
    assert q.modified, q.notes
    feeds = _feeds(2, seed=7)
    ref = _run(model, feeds)
    result = _apply(model, _feeds(6), threshold=1.5, mode="row", layers="1")
    assert result.modified
    [branch] = [n for n in model.graph if n.op_type == "If"]
    inside = [n.op_type for n in branch.attributes["else_branch"].as_graph()]
    assert inside.count("DynamicQuantizeMatMul") >= 2 * 6  # layers 2 and 3
    for g, r in zip(_run(model, feeds), ref):
        assert np.array_equal(g["logits"], r["logits"])


def test_remove_padding_either_way():
    """Packed tokens have no batch axis to gate: early-exit refuses them; remove-padding refuses If graphs."""
    from graphopt.engine import registry

    packed = _tiny_encoder(classifier=False)  # remove-padding refuses the classifier's first-token Gather
    rp = registry.builtin().create("remove-padding")(packed, PassContext(calib_feeds=_feeds(2)))
    assert rp.modified, rp.notes
    result = _apply(packed, _feeds(6))
    assert not result.modified and "packed by remove-padding" in result.notes[0]
    model = _tiny_encoder()
    assert _apply(model, _feeds(6), threshold=0.5).modified
    rp = registry.builtin().create("remove-padding")(model, PassContext(calib_feeds=_feeds(2)))
    assert not rp.modified and "subgraphs" in " ".join(rp.notes)


def test_options_are_checked():
    from graphopt.errors import UsageError

    for bad in ({"mode": "rows"}, {"criterion": "margin"}, {"layers": "a"}, {"layers": "0"}, {"head": "tree"},
                {"confidence": 1.0}, {"confidence": -0.1}):
        with pytest.raises(UsageError):
            EarlyExitPass(**bad)
    model = _tiny_encoder()
    result = _apply(model, _feeds(6), layers=str(LAYERS), threshold=0.5)
    assert not result.modified and "exits must be after layers" in result.notes[0]


def test_agreement_lower_bound_is_clopper_pearson():
    # 0 disagreements of n: the exact one-sided bound is (1 - confidence) ** (1 / n)
    for n in (50, 200, 1000):
        assert agreement_lower_bound(n, n, 0.95) == pytest.approx(0.05 ** (1 / n), rel=1e-9)
    assert agreement_lower_bound(197, 200, 0.0) == pytest.approx(0.985)  # confidence 0: the plain rate
    # 99% agreement on 200 rows does not show 99% at 95% confidence; on 5000 rows it shows 98.7%
    assert agreement_lower_bound(198, 200, 0.95) < 0.98
    assert 0.985 < agreement_lower_bound(4950, 5000, 0.95) < 0.99
    assert agreement_lower_bound(0, 10, 0.95) == 0.0 and agreement_lower_bound(0, 0, 0.95) == 0.0
    # a higher confidence asks for more: the bound falls
    assert agreement_lower_bound(590, 600, 0.99) < agreement_lower_bound(590, 600, 0.9) < 590 / 600


def test_margin_picks_a_stricter_threshold():
    """The threshold is the cheapest whose tune lower bound meets the budget: with a margin, rows that a
    plain tune agreement would let exit stay on; confidence 0 reproduces the plain choice."""
    from graphopt.rewrites.early_exit.thresholds import calibrate

    rng = np.random.default_rng(0)
    rows, n_layers = 400, 3
    labels = rng.integers(0, 3, rows)
    scores = rng.uniform(0, 1, (1, rows))
    # the exit is wrong on 1% of rows, all of them with confidence in [0.5, 0.6)
    preds = labels[None].copy()
    wrong = np.flatnonzero((scores[0] >= 0.5) & (scores[0] < 0.6))[: rows // 100]
    preds[0, wrong] = (labels[wrong] + 1) % 3
    idx = np.arange(rows)
    layer_of = np.array([1, n_layers])

    def pick(confidence):
        return calibrate(preds, scores, labels, layer_of, 0.99, idx, idx, n_layers, criterion="maxprob",
                         confidence=confidence, note=lambda msg: None)

    plain, margin = pick(0.0), pick(0.95)
    assert plain is not None and margin is not None
    assert plain < 0.5 and margin > scores[0, wrong].max()  # plain lets the erring rows exit; the bound does not
    ex = scores[0] >= margin
    assert np.all(preds[0, ex] == labels[ex])


def test_reads_the_pooling_of_the_models_head():
    from graphopt.rewrites.early_exit.pooling import read_pooling

    for pooling in ("cls", "mean"):
        model = _tiny_encoder(pooling=pooling, seed=1)
        last = find_layers(model.graph)[0][-1]
        assert read_pooling(model.graph, last, model.graph.outputs[0])[0] == pooling
        result = _apply(model, _feeds(4), layers="1", threshold=0.0, head="linear")
        assert f"pooling: {pooling} (read from the graph" in "\n".join(result.notes)
    embed = _tiny_encoder(classifier=False)
    assert read_pooling(embed.graph, find_layers(embed.graph)[0][-1], embed.graph.outputs[0])[0] is None


def test_mean_pooled_classifier_exits_certified_on_held_back_rows():
    """Masked-mean pooling read from the graph, mean-pooled exit heads, 308 confirm rows: the pass certifies
    top1>=0.99 and holds it on unseen rows, with rows leaving early."""
    model = _tiny_encoder(pooling="mean", seed=1)
    held = _topic_feeds(30, seed=7)
    ref = _run(model, held)
    result = _apply(model, _topic_feeds(48), mode="row", exit_output="exit_layer")
    notes = "\n".join(result.notes)
    assert result.modified and result.budget_met, notes
    assert "pooling: mean (read from the graph: ReduceSum" in notes and "confirm rows" not in result.notes[0]
    inits = result.model.graph.initializers
    exits = [k for k in (1, 2) if f"early_exit/L{k}/head_w0" in inits]
    assert exits and all(f"early_exit/L{k}/one" in inits and f"early_exit/L{k}/cls_index" not in inits for k in exits)
    got = _run(result.model, held)
    assert metrics.compare([{"logits": g["logits"]} for g in got], ref, held).worst("top1") >= 0.99
    assert np.concatenate([g["exit_layer"] for g in got]).mean() < LAYERS
    # the exit heads read the masked mean: an always-exit model equals the mean-pooled head on the hidden state
    fresh = _tiny_encoder(pooling="mean", seed=1)
    h, mask = _hidden(fresh, 1, held[:1])[0], held[0]["attention_mask"]
    always = _apply(fresh, _topic_feeds(8), layers="1", threshold=0.0, head="linear").model
    want = _head_logits(always, 1, h, mask, "mean")
    np.testing.assert_allclose(_run(always, held[:1])[0]["logits"], want, rtol=1e-4, atol=1e-4)


def test_too_few_confirm_rows_refused_with_the_rows_needed():
    from graphopt.rewrites.early_exit.thresholds import rows_needed

    assert rows_needed(0.99, 0.95) == 299 and agreement_lower_bound(298, 298, 0.95) < 0.99
    assert rows_needed(0.99, 0.0) == 1
    model = _tiny_encoder(pooling="mean", seed=1)
    result = _apply(model, _topic_feeds(10))  # 160 rows: 64 to confirm
    assert not result.modified and result.budget_met is False
    best = agreement_lower_bound(64, 64, 0.95)
    assert result.notes[0] == (
        f"not applied: top1>=0.99 needs >= 299 confirm rows at 0.95 confidence; the calibration data gives 64 "
        f"confirm rows (160 rows, 2/5 of them to confirm), which can certify at most top1>={best:.4f} (about 748 "
        "calibration rows needed, or a lower top1 budget / confidence)")
    assert "fidelity per exit" not in "\n".join(result.notes)  # no search


def test_maxprob_ranks_rows_whose_probability_rounds_to_one():
    """The max probability of every row here rounds to 1.0 (margins 40-90 logits); its log-odds still
    ranks them, so the threshold walk lets the sure rows exit and keeps the one wrong row (the least sure)."""
    from graphopt.rewrites.early_exit.thresholds import calibrate, confidence, probability, score_threshold

    rows = 400
    margins = np.linspace(40.0, 90.0, rows)
    logits = np.zeros((rows, 3))
    logits[:, 1] = margins
    scores = confidence(logits, 1.0, "maxprob")
    assert np.all(np.diff(scores) > 0) and np.allclose(scores, margins - np.log(2.0))
    assert np.all(metrics_softmax_max(logits) == 1.0)  # what the probability shows: a tie
    labels = np.ones(rows, np.int64)
    preds = labels[None].copy()
    preds[0, 0] = 2  # the least sure row disagrees
    idx = np.arange(rows)
    t = calibrate(preds, scores[None], labels, np.array([1, 3]), 0.99, idx, idx, 3, criterion="maxprob",
                  confidence=0.95, note=lambda msg: None)
    assert t is not None and scores[0] < t <= scores[1:].min() + 1e-6
    assert score_threshold(0.5, "maxprob") == 0.0 and probability(score_threshold(0.9, "maxprob"), "maxprob") == \
        pytest.approx(0.9)


def test_branch_weights_live_in_their_branch():
    """Weights only a branch reads are that branch's initializers (ONNX Runtime prepacks a kernel's own
    graph's constants only); the result stays exact and the main graph keeps what it reads itself."""
    model, calib, feeds = _tiny_encoder(), _feeds(6), _feeds(3, seed=7)
    ref = _run(model, feeds)
    before = set(model.graph.initializers)
    assert _apply(model, calib, threshold=1.5, layers="1,2").modified
    subs = list(ir.traversal.RecursiveGraphIterator(model.graph))
    branch_inits = {}
    for n in subs:
        for attr in n.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                branch_inits.update({k: attr.value for k in attr.value.initializers})
    moved = before & set(branch_inits)
    assert moved and not moved & set(model.graph.initializers)
    main_reads = {v.name for n in model.graph for v in n.inputs if v is not None}
    assert not moved & main_reads
    for name, g in branch_inits.items():  # each one is read inside the branch that holds it
        inner = {v.name for n in ir.traversal.RecursiveGraphIterator(g) for v in n.inputs if v is not None}
        assert name in inner
    for g, r in zip(_run(model, feeds), ref):
        assert np.array_equal(g["logits"], r["logits"])


def test_too_few_rows_through_a_split_says_what_the_folder_needs():
    """Beside held-back feeds (optimize --calib's second half) the refusal says the folder needs twice the rows."""
    model = _tiny_encoder(pooling="mean", seed=1)
    result = EarlyExitPass()(model, PassContext(calib_feeds=_topic_feeds(10), feeds=_topic_feeds(10, seed=3)))
    assert not result.modified and result.budget_met is False
    assert result.notes[0].endswith("; optimize --calib calibrates on the first half of the feeds (the other 160 "
                                    "rows check the budget): a folder of about 1495 rows")

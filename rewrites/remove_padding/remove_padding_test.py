"""Tests of remove-padding: a hand-built one-layer encoder (no torch) and the real MiniLM exports."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from testmodels import embed_layernorm_prologue

from graphopt.data.metrics import compare
from graphopt.engine import registry
from graphopt.errors import UsageError
from graphopt.runtime.session import make_session, run

H, NH, VOCAB, MAXPOS = 16, 2, 50, 64


def _encoder(*, mask: bool = True, pool: bool | str = False, mask_in_softmax: bool = True,
             position_ids: bool = False, opset: int = 17, mha: str = "") -> ir.Model:
    """A one-layer BERT-like encoder in standard ops (embeddings, attention, FFN, LayerNorms)."""
    rng = np.random.default_rng(0)
    inits = []

    def w(name, *shape, scale=0.3):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def c(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    nodes = [
        helper.make_node("Gather", [w("word", VOCAB, H), "input_ids"], ["we"]),
        helper.make_node("Gather", [w("ttab", 2, H), "token_type_ids"], ["te"]),
        helper.make_node("Add", ["we", "te"], ["e1"]),
    ]
    if position_ids:
        nodes.append(helper.make_node("Gather", [w("ptab", MAXPOS, H), "position_ids"], ["pe"]))
    else:  # positions 0..S-1 from the shape: a [S, H] operand
        nodes += [
            helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
            helper.make_node("Gather", ["ids_shape", c("one", np.array(1, np.int64))], ["seq"], axis=0),
            helper.make_node("Range", [c("zero", np.array(0, np.int64)), "seq", "one"], ["pos"]),
            helper.make_node("Gather", [w("ptab", MAXPOS, H), "pos"], ["pe"]),
        ]
    nodes += [
        helper.make_node("Add", ["e1", "pe"], ["e2"]),
        helper.make_node("LayerNormalization", ["e2", w("g0", H), w("b0", H)], ["x0"], axis=-1, epsilon=1e-5),
    ]
    for t in "qkv":
        nodes += [
            helper.make_node("MatMul", ["x0", w(f"W{t}", H, H)], [f"{t}m"]),
            helper.make_node("Add", [f"{t}m", w(f"b{t}", H)], [f"{t}a"]),
            helper.make_node("Shape", ["x0"], [f"{t}shape"], start=0, end=2),
            helper.make_node("Concat", [f"{t}shape", c(f"{t}heads", np.array([NH, H // NH], np.int64))], [f"{t}tgt"], axis=0),
            helper.make_node("Reshape", [f"{t}a", f"{t}tgt"], [f"{t}r"]),
            helper.make_node("Transpose", [f"{t}r"], [f"{t}t"], perm=[0, 2, 3, 1] if t == "k" else [0, 2, 1, 3]),
        ]
    if mha:  # the fused form: com.microsoft MultiHeadAttention on [B, S, H] q/k/v
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
            helper.make_node("Sub", [c("onef", np.array(1.0, np.float32)), "maskf"], ["inv"]),
            helper.make_node("Mul", ["inv", c("neg", np.array(np.finfo(np.float32).min, np.float32))], ["bias2"]),
            helper.make_node("Unsqueeze", ["bias2", c("ax12", np.array([1, 2], np.int64))], ["bias4"]),
            helper.make_node("Shape", ["input_ids"], ["bs"]),
            helper.make_node("Slice", ["bs", c("s1", np.array([1], np.int64)), c("s2", np.array([2], np.int64))], ["sdim"]),
            helper.make_node("Slice", ["bs", c("s0", np.array([0], np.int64)), "s1"], ["bdim"]),
            helper.make_node("Concat", ["bdim", "s1", "sdim", "sdim"], ["bshape"], axis=0),
            helper.make_node("Expand", ["bias4", "bshape"], ["bias_full"]),
            helper.make_node("Cast", ["attention_mask"], ["mask32"], to=TensorProto.INT32),
        ]
        if mha == "kpm_derived":  # the same key padding mask, computed (not a Cast of the input)
            nodes[-1:] = [
                helper.make_node("Greater", ["attention_mask", c("zero_i", np.array(0, np.int64))], ["maskb"]),
                helper.make_node("Cast", ["maskb"], ["mask32"], to=TensorProto.INT32),
            ]
        if mha == "relbias":  # key padding bias plus a relative-position term: not a key padding mask
            nodes += [
                helper.make_node("Squeeze", ["sdim", c("ax0", np.array([0], np.int64))], ["sscalar"]),
                helper.make_node("Range", [c("r0", np.array(0, np.int64)), "sscalar", c("r1", np.array(1, np.int64))],
                                 ["rpos"]),
                helper.make_node("Unsqueeze", ["rpos", "ax0"], ["rrow"]),
                helper.make_node("Unsqueeze", ["rpos", c("ax1", np.array([1], np.int64))], ["rcol"]),
                helper.make_node("Sub", ["rcol", "rrow"], ["rdiff"]),
                helper.make_node("Cast", ["rdiff"], ["rdiff_f"], to=TensorProto.FLOAT),
                helper.make_node("Mul", ["rdiff_f", c("rscale", np.array(0.1, np.float32))], ["rel"]),
                helper.make_node("Add", ["bias_full", "rel"], ["bias_rel"]),
            ]
        extra = (["", "mask32"] if mha in ("kpm", "kpm_derived") else
                 ["", "", "bias_rel"] if mha == "relbias" else ["", "", "bias_full"])
        nodes.append(helper.make_node("MultiHeadAttention", ["qa", "ka", "va", *extra], ["ctxr"],
                                      domain="com.microsoft", num_heads=NH))
        nodes = [n for n in nodes if n.output[0] not in ("qr", "kr", "vr", "qt", "kt", "vt")]
    nodes += [] if mha else [
        helper.make_node("MatMul", ["qt", "kt"], ["scores"]),
        helper.make_node("Div", ["scores", c("sqrt_d", np.array(np.sqrt(H // NH), np.float32))], ["scaled"]),
    ]
    if mask and mask_in_softmax and not mha:
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
            helper.make_node("Sub", [c("onef", np.array(1.0, np.float32)), "maskf"], ["inv"]),
            helper.make_node("Mul", ["inv", c("neg", np.array(np.finfo(np.float32).min, np.float32))], ["bias2"]),
            helper.make_node("Unsqueeze", ["bias2", c("ax12", np.array([1, 2], np.int64))], ["bias4"]),
            helper.make_node("Add", ["scaled", "bias4"], ["masked"]),
        ]
    elif not mha:
        nodes.append(helper.make_node("Identity", ["scaled"], ["masked"]))
    nodes += [] if mha else [
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "vt"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctxt"], perm=[0, 2, 1, 3]),
        helper.make_node("Shape", ["x0"], ["x0shape"]),
        helper.make_node("Reshape", ["ctxt", "x0shape"], ["ctxr"]),
    ]
    nodes += [
        helper.make_node("MatMul", ["ctxr", w("Wo", H, H)], ["om"]),
        helper.make_node("Add", ["om", w("bo", H)], ["oa"]),
        helper.make_node("Add", ["oa", "x0"], ["res1"]),
        helper.make_node("LayerNormalization", ["res1", w("g1", H), w("b1", H)], ["x1"], axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["x1", w("W1", H, 4 * H)], ["f1"]),
        helper.make_node("Gelu", ["f1"], ["f1g"]) if opset >= 20 else helper.make_node("Erf", ["f1"], ["f1g"]),
        helper.make_node("MatMul", ["f1g", w("W2", 4 * H, H)], ["f2"]),
        helper.make_node("Add", ["f2", "x1"], ["res2"]),
        helper.make_node("LayerNormalization", ["res2", w("g2", H), w("b2", H)], ["hidden"], axis=-1, epsilon=1e-5),
    ]
    out_name = "last_hidden_state"
    if pool == "cls":  # the first position of every row (a pad token under left padding)
        nodes.append(helper.make_node("Gather", ["hidden", c("zero_idx", np.array(0, np.int64))], [out_name], axis=1))
        out = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", H])
    elif pool:
        nodes.append(helper.make_node("ReduceMean", ["hidden"], [out_name], axes=[1], keepdims=0))
        out = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", H])
    else:
        nodes.append(helper.make_node("Identity", ["hidden"], [out_name]))
        out = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", "seq", H])
    names = ["input_ids", "token_type_ids"] + (["attention_mask"] if mask else []) + (["position_ids"] if position_ids else [])
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in names]
    graph = helper.make_graph(nodes, "encoder", inputs, [out], initializer=inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if mha else [])
    proto = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _fused_encoder(mask_layout: str) -> ir.Model:
    """EmbedLayerNormalization + Attention + SkipLayerNormalization + BiasGelu (what ``fuse`` emits).

    ``mask_layout``: "eln" (Attention takes the 1-D mask_index of EmbedLayerNormalization) or "raw"
    (Attention takes the [B, S] int32 mask).
    """
    rng = np.random.default_rng(1)
    inits = []

    def w(name, *shape, scale=0.3):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    ms = "com.microsoft"
    nodes = embed_layernorm_prologue(w, vocab=VOCAB, max_pos=MAXPOS, hidden=H) + [
        helper.make_node("Attention", ["x0", w("Wqkv", H, 3 * H), w("bqkv", 3 * H),
                                       "mask_index" if mask_layout == "eln" else "mask32"],
                         ["ctx"], domain=ms, num_heads=NH),
        helper.make_node("MatMul", ["ctx", w("Wo", H, H)], ["om"]),
        helper.make_node("SkipLayerNormalization", ["om", "x0", w("g1", H), w("b1", H), w("bo", H)], ["x1"],
                         domain=ms, epsilon=1e-5),
        helper.make_node("MatMul", ["x1", w("W1", H, 4 * H)], ["f1"]),
        helper.make_node("BiasGelu", ["f1", w("bf1", 4 * H)], ["f1g"], domain=ms),
        helper.make_node("MatMul", ["f1g", w("W2", 4 * H, H)], ["f2"]),
        helper.make_node("SkipLayerNormalization", ["f2", "x1", w("g2", H), w("b2", H)], ["last_hidden_state"],
                         domain=ms, epsilon=1e-5),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", H])
    graph = helper.make_graph(nodes, "fused", inputs, [out], initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)],
                              ir_version=9)
    return ir.serde.deserialize_model(proto)


def _feed(lengths, seq=None, *, left=False, position_ids=False, mask=True, seed=0):
    rng = np.random.default_rng(seed)
    b, s = len(lengths), seq or max(max(lengths), 1)
    m = np.zeros((b, s), np.int64)
    for i, n in enumerate(lengths):
        if n and left:
            m[i, s - n:] = 1
        elif n:
            m[i, :n] = 1
    feed = {"input_ids": rng.integers(1, VOCAB, (b, s)).astype(np.int64) * m,
            "token_type_ids": (rng.random((b, s)) < 0.3).astype(np.int64)}
    if mask:
        feed["attention_mask"] = m
    if position_ids:
        feed["position_ids"] = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
    return feed


def _apply(model: ir.Model, **options) -> registry.PassResult:
    return registry.create("remove-padding", options)(model)


def _check_exact(model_factory, feeds, atol=1e-5, **options):
    ref_model = model_factory()
    ref = run(make_session(ref_model, optimize=False), feeds)
    model = model_factory()
    result = _apply(model, **options)
    assert result.modified, result.notes
    got = run(make_session(result.model, optimize=False), feeds)
    return got, ref, compare(got, ref, feeds, atol=atol, rtol=atol), result.model


FEEDS = {
    "right": _feed([5, 3, 1, 7]),
    "left": _feed([5, 3, 1, 7], left=True, seed=1),
    "no_padding": _feed([6, 6, 6]),
    "batch1": _feed([4], seq=9),
    "all_padding_row": _feed([4, 0, 2]),
    "holes": None,  # a mask with interior zeros, filled below
}
FEEDS["holes"] = _feed([6, 6], seed=2)
FEEDS["holes"]["attention_mask"][0, 2] = 0
FEEDS["all_padding_batch"] = _feed([0, 0], seq=4)


@pytest.mark.parametrize("case", list(FEEDS))
def test_exact_on_real_tokens(case):
    feeds = [FEEDS[case]]
    got, ref, cmp, model = _check_exact(_encoder, feeds)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    out = got[0]["last_hidden_state"]
    m = feeds[0]["attention_mask"].astype(bool)
    assert not np.isnan(out).any()
    assert np.all(out[~m] == 0), "padded positions of the output are zero"
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["NonZero"] == 1 and ops["Softmax"] == 1


@pytest.mark.parametrize("mha", ["bias", "kpm"])
@pytest.mark.parametrize("groups", [0, 1, 3])
@pytest.mark.parametrize("attention_op", ["mha", "onnx"])
def test_fused_attention_groups(mha, groups, attention_op):
    feeds = [FEEDS[k] for k in ("right", "left", "no_padding", "batch1", "all_padding_row", "holes")]

    def factory():
        return _encoder(mha=mha)

    got, _, cmp, model = _check_exact(factory, feeds, attention_groups=groups, attention_op=attention_op)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    for f, g in zip(feeds, got):
        out = g["last_hidden_state"]
        assert not np.isnan(out).any() and np.all(out[~f["attention_mask"].astype(bool)] == 0)
    ops = collections.Counter((n.domain, n.op_type) for n in model.graph)
    # attention_op=onnx: ONNX Attention (opset 23) for the groups of a key-padding-mask attention only
    onnx_groups = attention_op == "onnx" and mha == "kpm" and groups > 0
    assert ops[("com.microsoft", "MultiHeadAttention")] == (0 if onnx_groups else max(groups, 1))
    assert ops[("", "Attention")] == (groups if onnx_groups else 0)
    assert model.opset_imports[""] == (23 if onnx_groups else 17)
    assert ops[("", "TopK")] == (1 if groups else 0)


def test_attention_op_is_checked():
    with pytest.raises(UsageError, match="attention_op"):
        registry.create("remove-padding", {"attention_op": "flash"})


def test_attention_op_auto_follows_the_onnx_runtime_version():
    from rewrites.remove_padding import resolve_attention_op

    assert [resolve_attention_op("auto", v) for v in ("1.20.1", "1.22.2", "1.23.0", "1.32.0", "1.23.0+cu130")] == [
        "mha", "mha", "onnx", "onnx", "onnx"]
    assert resolve_attention_op("mha", "1.32.0") == "mha" and resolve_attention_op("onnx", "1.20.0") == "onnx"


def test_attention_op_auto_runs_onnx_attention_on_this_onnx_runtime():
    """``auto`` on the installed ORT (>= 1.23 in the test set-up) emits ONNX Attention for the groups, exactly."""
    import onnxruntime

    from graphopt.runtime.ort_compat import version_key

    assert version_key(onnxruntime.__version__) >= (1, 23), "the test set-up installs ORT >= 1.23"
    got, _, cmp, model = _check_exact(lambda: _encoder(mha="kpm"), [FEEDS["right"], FEEDS["holes"]],
                                      attention_groups=3, attention_op="auto")
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    ops = collections.Counter((n.domain, n.op_type) for n in model.graph)
    assert ops[("", "Attention")] == 3 and ops[("com.microsoft", "MultiHeadAttention")] == 0


@pytest.mark.parametrize("mask_layout", ["eln", "raw"])
def test_fused_embed_and_attention(mask_layout):
    """EmbedLayerNormalization runs as packed Gathers + LayerNorm; Attention becomes grouped MHA.

    With the 1-D mask_index (right padding by definition) the attention is not grouped: it is split
    into packed projections + MultiHeadAttention on the unpacked batch.
    """
    right = [FEEDS[k] for k in ("right", "no_padding", "batch1", "all_padding_row")]
    feeds = right if mask_layout == "eln" else right + [FEEDS["left"], FEEDS["holes"]]

    def factory():
        return _fused_encoder(mask_layout)

    got, _, cmp, model = _check_exact(factory, feeds)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["EmbedLayerNormalization"] == 0 and ops["Attention"] == 0, ops
    assert ops["MultiHeadAttention"] == (1 if mask_layout == "eln" else 8), ops
    # the layer's two; the packed embeddings' norm (EmbedLayerNormalization split) is Sum + LayerNormalization
    # on CPU, where that is the faster form (SkipLayerNormalization with --provider cuda)
    assert ops["SkipLayerNormalization"] == 2 and ops["BiasGelu"] == 1
    assert ops["LayerNormalization"] == 1 and ops["Sum"] == 1, ops


def test_token_wise_ops_run_packed():
    model = _encoder()
    result = _apply(model)
    packed = collections.Counter(n.op_type for n in result.model.graph if n.outputs[0].name.endswith("_packed"))
    assert {"Gather", "Add", "LayerNormalization", "MatMul", "Erf"} <= set(packed)
    assert packed["MatMul"] == 6, packed  # Q, K, V, output projection (after attention), FFN x2
    assert packed["LayerNormalization"] == 3, packed
    # the attention core is untouched: still Reshape/Transpose on the padded layout
    assert not any(n.op_type in ("Softmax", "Reshape") and n.outputs[0].name.endswith("_packed")
                   for n in result.model.graph)


def test_position_ids_input_and_opset20_gelu():
    feeds = [_feed([5, 2, 7], position_ids=True), _feed([3, 6], left=True, position_ids=True, seed=4)]

    def factory():
        return _encoder(position_ids=True, opset=20)

    _, _, cmp, _ = _check_exact(factory, feeds)
    assert cmp.worst("max_abs") <= 1e-5, cmp.summary()


def test_packed_output():
    feed = _feed([5, 0, 2, 7], left=True)
    ref = run(make_session(_encoder(), optimize=False), [feed])[0]["last_hidden_state"]
    result = _apply(_encoder(), packed_output=True)
    assert result.modified, result.notes
    out = run(make_session(result.model, optimize=False), [feed])[0]["last_hidden_state"]
    m = feed["attention_mask"].astype(bool)
    assert out.shape == (int(m.sum()), H)
    np.testing.assert_allclose(out, ref[m], atol=1e-5)


@pytest.mark.parametrize("kind,reason", [
    ("no_mask", "no rank-2 attention mask"),
    ("pool", "mixes positions outside attention"),
    ("unmasked_softmax", "does not depend on the attention mask"),
    ("cls", "selects or shifts positions"),
])
def test_refusals(kind, reason):
    model = {"no_mask": lambda: _encoder(mask=False), "pool": lambda: _encoder(pool=True),
             "cls": lambda: _encoder(pool="cls"),
             "unmasked_softmax": lambda: _encoder(mask_in_softmax=False)}[kind]()
    before = ir.serde.serialize_model(model).SerializeToString()
    result = _apply(model)
    assert not result.modified
    assert any(reason in n for n in result.notes), result.notes
    assert ir.serde.serialize_model(result.model).SerializeToString() == before, "refusal leaves the graph as it was"


def test_second_run_refuses():
    model = _encoder()
    assert _apply(model).modified
    result = _apply(model)
    assert not result.modified and any("packed already" in n for n in result.notes), result.notes


def test_registered_with_options():
    cls = registry.get("remove-padding")
    assert cls.exact and cls.options() == {"packed_output": False, "attention_groups": 8, "packed_attention": True,
                                           "attention_op": "mha"}


# ------------------------------------------------------------------ CUDA variant (PackedMultiHeadAttention)
#
# ONNX Runtime runs PackedMultiHeadAttention on CUDA only. Here its CPU stand-in (graphopt.runtime.standins, an
# exact standard-op reference of the op's semantics) checks everything the pass builds around it; the
# CUDA kernel itself runs in test_cuda_kernel_on_gpu (skipped without CUDA) and tools/cuda_checks.py.

ALL_FEEDS = ["right", "left", "no_padding", "batch1", "all_padding_row", "holes", "all_padding_batch"]


def _apply_cuda(model: ir.Model, **options) -> registry.PassResult:
    return registry.create("remove-padding", options)(model, registry.PassContext(provider="cuda"))


def _ms_ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph if n.domain == "com.microsoft")


@pytest.mark.parametrize("groups", [8, 0])
@pytest.mark.parametrize("kind", ["mha_kpm", "fused_raw"])
def test_cuda_packed_attention_exact_via_standin(kind, groups):
    """On fused attention with a plain key padding mask, provider cuda gives one PackedMultiHeadAttention
    per attention op (no MultiHeadAttention, no length groups), exact on real tokens for every padding
    pattern (through the CPU stand-in); attention_groups=0 does not turn it off."""
    from graphopt.runtime.standins import cpu_runnable

    factory = {"mha_kpm": lambda: _encoder(mha="kpm"), "fused_raw": lambda: _fused_encoder("raw")}[kind]
    feeds = [FEEDS[k] for k in ALL_FEEDS]
    ref = run(make_session(factory(), optimize=False), feeds)
    result = _apply_cuda(factory(), attention_groups=groups)
    assert result.modified, result.notes
    ops = _ms_ops(result.model)
    assert ops["PackedMultiHeadAttention"] == 1 and ops["MultiHeadAttention"] == 0 and ops["Attention"] == 0, ops
    assert not any(n.op_type == "TopK" for n in result.model.graph), "no length groups are built"
    assert result.rule_counts["packed_attention"] == 1 and "grouped_attention" not in result.rule_counts
    assert any("CUDA only" in n for n in result.notes), result.notes
    runnable, replaced = cpu_runnable(result.model)
    assert replaced == ["PackedMultiHeadAttention"] and _ms_ops(runnable)["PackedMultiHeadAttention"] == 0
    assert _ms_ops(result.model)["PackedMultiHeadAttention"] == 1, "the stand-in works on a copy"
    got = run(make_session(runnable, optimize=False), feeds)
    for name, f, g, r in zip(ALL_FEEDS, feeds, got, ref):
        cmp = compare([g], [r], [f], atol=1e-5, rtol=1e-5)
        assert cmp.worst("max_abs") <= 1e-5, (name, cmp.summary())
        out = g["last_hidden_state"]
        assert not np.isnan(out).any() and np.all(out[~f["attention_mask"].astype(bool)] == 0), name


def test_cuda_packing_index_values():
    """token_offset / cumulative_sequence_length for a left-padded batch with a hole: each row's real
    tokens are one right-aligned sequence of the [B+1, L] layout; the scratch row is sequence B (length 1)."""
    from graphopt.runtime.standins import cpu_runnable

    result = _apply_cuda(_encoder(mha="kpm"))
    runnable, _ = cpu_runnable(result.model)
    values = {v.name: v for node in runnable.graph for v in node.outputs}
    runnable.graph.outputs.extend([values["packing_token_offset"], values["packing_cumulative_sequence_length"]])
    feed = _feed([5, 3, 1, 7], left=True, seed=1)
    feed["attention_mask"][3, 2] = 0  # a hole: row 3 has 6 real tokens
    out = run(make_session(runnable, optimize=False), [feed])[0]
    lengths = [5, 3, 1, 6, 1]
    longest = max(lengths)
    real = [b * longest + j for b, n in enumerate(lengths) for j in range(n)]
    pad = [b * longest + j for b, n in enumerate(lengths) for j in range(n, longest)]
    np.testing.assert_array_equal(out["packing_cumulative_sequence_length"], np.cumsum([0, *lengths]))
    assert out["packing_cumulative_sequence_length"].dtype == np.int32
    np.testing.assert_array_equal(out["packing_token_offset"], np.reshape(real + pad, (len(lengths), longest)))
    assert out["packing_token_offset"].dtype == np.int32


@pytest.mark.parametrize("mha,reason", [
    ("relbias", "has an attention bias"),
    ("bias", "has an attention bias"),
    ("kpm_derived", "is not the attention mask"),
])
def test_cuda_falls_back_to_groups(mha, reason):
    """An attention op whose mask is not provably the plain key padding mask keeps the CPU formulation
    (MultiHeadAttention per length group) on CUDA too, says why, and stays exact."""
    feeds = [FEEDS[k] for k in ALL_FEEDS]
    ref = run(make_session(_encoder(mha=mha), optimize=False), feeds)
    result = _apply_cuda(_encoder(mha=mha))
    assert result.modified, result.notes
    ops = _ms_ops(result.model)
    assert ops["PackedMultiHeadAttention"] == 0 and ops["MultiHeadAttention"] == 8, ops
    assert any("not PackedMultiHeadAttention" in n and reason in n for n in result.notes), result.notes
    got = run(make_session(result.model, optimize=False), feeds)  # runs on CPU as it is
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-5


def test_cuda_packed_attention_off():
    result = _apply_cuda(_encoder(mha="kpm"), packed_attention=False)
    ops = _ms_ops(result.model)
    assert ops["PackedMultiHeadAttention"] == 0 and ops["MultiHeadAttention"] == 8, ops


def test_cpu_provider_never_emits_packed_attention():
    result = _apply(_encoder(mha="kpm"))
    assert _ms_ops(result.model)["PackedMultiHeadAttention"] == 0
    assert not any("PackedMultiHeadAttention" in n for n in result.notes), result.notes


def test_cuda_pipeline_verifies_through_standin():
    """--provider cuda through the pipeline: verified on CPU with the stand-in, and the report says so."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    feeds = [FEEDS[k] for k in ("right", "left", "holes", "batch1")]
    res = pipeline.optimize(_fused_encoder("raw"), OptimizeOptions(passes="remove-padding", provider="cuda",
                                                                   feeds=feeds))
    assert res.ok, [r.error for r in res.report.failed()]
    rec = res.report.passes[0]
    assert rec.modified and rec.verification["cpu_stand_ins"] == ["PackedMultiHeadAttention"]
    assert rec.verification["max_abs"] <= 1e-5, rec.verification
    assert any("stand-in for PackedMultiHeadAttention" in n and "tools/cuda_checks.py" in n for n in rec.notes), rec.notes
    assert _ms_ops(res.model)["PackedMultiHeadAttention"] == 1, "the saved model keeps the CUDA op"


def _standin_model(token_offset: np.ndarray | None = None) -> ir.Model:
    """One PackedMultiHeadAttention node: query/key/value [T, H], bias, token_offset, cumulative lengths."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", H]) for n in "qkv"]
    ins += [helper.make_tensor_value_info("bias", TensorProto.FLOAT, [3 * H]),
            helper.make_tensor_value_info("token_offset", TensorProto.INT32, ["B", "S"]),
            helper.make_tensor_value_info("cu", TensorProto.INT32, ["B1"])]
    node = helper.make_node("PackedMultiHeadAttention", ["q", "k", "v", "bias", "token_offset", "cu"], ["y"],
                            domain="com.microsoft", num_heads=NH)
    graph = helper.make_graph([node], "pmha", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=9)
    return ir.serde.deserialize_model(proto)


def _standin_case(lengths, seq, seed=0):
    rng = np.random.default_rng(seed)
    t = sum(lengths)
    q, k, v = (rng.standard_normal((t, H)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal(3 * H).astype(np.float32)
    real = [b * seq + j for b, n in enumerate(lengths) for j in range(n)]
    pad = [b * seq + j for b, n in enumerate(lengths) for j in range(n, seq)]
    feed = {"q": q, "k": k, "v": v, "bias": bias, "token_offset": np.reshape(real + pad, (len(lengths), seq)).astype(np.int32),
            "cu": np.cumsum([0, *lengths]).astype(np.int32)}
    # the op's semantics, sequence by sequence and head by head
    want = np.zeros_like(v)
    qb, kb, vb = q + bias[:H], k + bias[H:2 * H], v + bias[2 * H:]
    hs, start = H // NH, 0
    for n in lengths:
        for h in range(NH):
            cols, rows = slice(h * hs, (h + 1) * hs), slice(start, start + n)
            if n:
                sc = qb[rows, cols] @ kb[rows, cols].T / np.sqrt(hs)
                pr = np.exp(sc - sc.max(-1, keepdims=True))
                want[rows, cols] = (pr / pr.sum(-1, keepdims=True)) @ vb[rows, cols]
        start += n
    return feed, want


def test_standin_matches_the_op_semantics():
    from graphopt.runtime.standins import cpu_runnable

    sess = make_session(cpu_runnable(_standin_model())[0], optimize=False)
    for lengths, seq in (([3, 1, 4], 5), ([2, 0, 3], 3), ([1], 1), ([4, 4], 4)):
        feed, want = _standin_case(lengths, seq)
        np.testing.assert_allclose(sess.run(None, feed)[0], want, atol=1e-5, err_msg=str(lengths))


@pytest.mark.parametrize("bad", ["left_aligned_offsets", "duplicate_offset", "short_cumulative", "sequence_longer_than_s"])
def test_standin_poisons_inconsistent_plumbing(bad):
    """token_offset / cumulative_sequence_length that disagree with each other or the op's layout give NaN."""
    from graphopt.runtime.standins import cpu_runnable

    sess = make_session(cpu_runnable(_standin_model())[0], optimize=False)
    feed, _ = _standin_case([3, 1, 4], 5)
    if bad == "left_aligned_offsets":  # each row's tokens at the end of its row (what RemovePadding never does)
        feed["token_offset"] = np.asarray([2, 3, 4, 9, 11, 12, 13, 14, 0, 1, 5, 6, 7, 8, 10], np.int32).reshape(3, 5)
    elif bad == "duplicate_offset":
        feed["token_offset"].reshape(-1)[-1] = 0
    elif bad == "short_cumulative":
        feed["cu"] = np.asarray([0, 3, 4, 7], np.int32)
    else:
        feed["token_offset"] = feed["token_offset"][:, :3].copy()
    assert np.isnan(sess.run(None, feed)[0]).all()


def test_standin_keeps_the_output_name():
    """The stand-in's output has the op's output name, also as a graph output (verification and
    calibration read values by name; it used to come back as '<name>_replaced')."""
    from graphopt.runtime.standins import cpu_runnable

    runnable, _ = cpu_runnable(_standin_model())
    assert [o.name for o in runnable.graph.outputs] == ["y"]
    feed, want = _standin_case([3, 1, 4], 5)
    got = make_session(runnable, optimize=False).run(["y"], feed)[0]
    np.testing.assert_allclose(got, want, atol=1e-5)


def _unfused_kernel(q, k, v, bias, token_offset, cu, heads):
    """numpy model of ORT's unfused CUDA PackedMultiHeadAttention (packed_multihead_attention_impl.cu):
    TransposeQKV_TNH_3BNSH puts packed row p at slot token_offset[p] (bias only for p >= T),
    ComputeSoftmaxWithCumSeqLength keeps keys < cu[b+1] - cu[b], TransposeRemovePadding reads
    row i back from slot token_offset[i]. It reads the layout from token_offset, not from cu."""
    (b, s), (t, d), dv = token_offset.shape, q.shape, v.shape[1]
    assert cu.shape == (b + 1,) and t <= b * s  # CheckInputs
    slots = token_offset.reshape(-1)
    lay = [np.zeros((b * s, w)) + bias[lo:lo + w] for lo, w in ((0, d), (d, d), (2 * d, dv))]
    for x, src in zip(lay, (q, k, v)):
        x[slots[:t]] = src + x[slots[:t]]
    qh, kh, vh = (x.reshape(b, s, heads, -1).transpose(0, 2, 1, 3) for x in lay)
    scores = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(d // heads)
    ctx = np.zeros((b, heads, s, dv // heads))
    for i in range(b):
        n = cu[i + 1] - cu[i]
        if n > 0:
            e = np.exp(scores[i, :, :, :n] - scores[i, :, :, :n].max(-1, keepdims=True))
            ctx[i] = (e / e.sum(-1, keepdims=True)) @ vh[i, :, :n]
    return ctx.transpose(0, 2, 1, 3).reshape(b * s, dv)[slots[:t]]


def test_cuda_index_drives_the_unfused_kernel():
    """token_offset / cumulative_sequence_length as built for MiniLM-like fused attention, on random
    masks (holes, empty rows, all padding, no padding): ORT's unfused CUDA kernel (fp32 below
    sequence length 256 always runs it) would compute what the CPU stand-in computes."""
    from graphopt.runtime.standins import cpu_runnable

    result = _apply_cuda(_fused_encoder("raw"))
    model = result.model
    node = next(n for n in model.graph if n.op_type == "PackedMultiHeadAttention")
    for i, x in enumerate(node.inputs):
        if x is not None and not x.name:
            x.name = f"pmha_input_{i}"
    names = [x.name for x in node.inputs]
    runnable, _ = cpu_runnable(model)
    values = {v.name: v for n in runnable.graph for v in n.outputs}
    wanted = [n for n in [*names, node.outputs[0].name] if n not in runnable.graph.initializers]
    runnable.graph.outputs.extend(values[n] for n in wanted)
    sess = make_session(runnable, optimize=False)
    rng = np.random.default_rng(0)
    for trial in range(24):
        b, s = int(rng.integers(1, 6)), int(rng.integers(1, 10))
        mask = (rng.random((b, s)) < rng.random()).astype(np.int64)
        mask[:] = 0 if trial == 0 else 1 if trial == 1 else mask
        feed = {"input_ids": rng.integers(1, VOCAB, (b, s)).astype(np.int64) * mask,
                "token_type_ids": np.zeros((b, s), np.int64), "attention_mask": mask}
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
        q, k, v, bias, offset, cu = (out[n] if n in out else model.graph.initializers[n].const_value.numpy()
                                     for n in names)
        assert offset.dtype == cu.dtype == np.int32
        want = _unfused_kernel(q, k, v, bias, offset, cu, NH)
        np.testing.assert_allclose(out[node.outputs[0].name], want, atol=1e-5, err_msg=str(mask))


@pytest.mark.cuda
def test_cuda_kernel_on_gpu():
    """The real PackedMultiHeadAttention CUDA kernel against the CPU stand-in (needs CUDA)."""
    from graphopt.runtime.session import cuda_available
    from graphopt.runtime.standins import cpu_runnable

    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"no CUDA here ({why}); the CPU stand-in is checked by the tests above, the kernel by "
                    "tools/cuda_checks.py on a GPU")
    feeds = [FEEDS[k] for k in ("right", "left", "no_padding", "batch1", "holes")]
    result = _apply_cuda(_fused_encoder("raw"))
    sess = make_session(result.model, provider="cuda", optimize=True)
    if "CUDAExecutionProvider" not in sess.get_providers():
        pytest.skip("the CUDA provider did not initialise")
    want = run(make_session(cpu_runnable(result.model)[0], optimize=False), feeds)
    # loose: ORT's CUDA provider runs fp32 MatMuls in TF32 by default; an index error is O(1)
    assert compare(run(sess, feeds), want, feeds).worst("max_abs") <= 1e-2


# ------------------------------------------------------------------ MiniLM

def _minilm_feeds():
    rng = np.random.default_rng(0)
    feeds = []
    for left in (False, True):
        lengths = [23, 5, 1, 17, 9]
        f = _feed(lengths, left=left, seed=int(left))
        f["input_ids"] = np.where(f["attention_mask"] == 1, rng.integers(1000, 20000, f["input_ids"].shape), 0)
        feeds.append(f)
    return feeds


MINILM_EXPORTS = [("torchscript", "eager"), ("torchscript", "sdpa"), ("dynamo", "eager"), ("dynamo", "sdpa")]


def _minilm_exact(path, model: ir.Model, **options) -> ir.Model:
    """remove-padding on ``model`` (from the export at ``path``) is exact on real tokens; the result."""
    feeds = _minilm_feeds()
    ref = run(make_session(path, optimize=False), feeds)
    result = _apply(model, **options)
    assert result.modified, result.notes
    got = run(make_session(result.model), feeds)
    cmp = compare(got, ref, feeds)
    assert cmp.worst("max_abs") <= 1e-4, cmp.summary()
    return result.model


@pytest.mark.slow
@pytest.mark.parametrize("exporter,attn", MINILM_EXPORTS)
def test_minilm_unfused(minilm, exporter, attn):
    path = minilm(exporter, attn)
    _minilm_exact(path, ir.load(path))


@pytest.mark.slow
@pytest.mark.parametrize("exporter,attn", MINILM_EXPORTS)
def test_minilm_fused(minilm, exporter, attn):
    path = minilm(exporter, attn)
    model = ir.load(path)
    registry.create("fuse")(model)
    ops = collections.Counter(n.op_type for n in _minilm_exact(path, model).graph)
    assert ops["EmbedLayerNormalization"] == 0 and ops["Attention"] == 0, ops
    assert ops["MultiHeadAttention"] == 6 * 8, ops  # 6 layers x 8 length groups


@pytest.mark.slow
def test_minilm_fused_onnx_attention(minilm):
    """attention_op=onnx on MiniLM: 48 ONNX Attention (6 layers x 8 groups), opset 23, exact."""
    path = minilm("dynamo", "sdpa")
    model = ir.load(path)
    registry.create("fuse")(model)
    out = _minilm_exact(path, model, attention_op="onnx")
    ops = collections.Counter((n.domain, n.op_type) for n in out.graph)
    assert ops[("", "Attention")] == 48 and ops[("com.microsoft", "MultiHeadAttention")] == 0, ops
    assert out.opset_imports[""] == 23


@pytest.mark.slow
def test_packed_output_verified_by_pipeline(minilm):
    """With packed_output the pipeline compares the [tokens, hidden] output with the real tokens."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    res = pipeline.optimize(minilm("dynamo", "sdpa"), OptimizeOptions(
        passes="remove-padding", overrides=["remove-padding.packed_output=true"]))
    assert res.ok, [p.error for p in res.report.failed()]
    out = res.model.graph.outputs[0]
    assert out.shape is not None and len(out.shape) == 2
    assert res.report.passes[0].verification["max_abs"] <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("exporter,attn", [("dynamo", "sdpa"), ("torchscript", "eager")])
def test_minilm_fused_cuda_variant(minilm, exporter, attn):
    """fuse + remove-padding for CUDA on MiniLM: 6 PackedMultiHeadAttention, no MultiHeadAttention; real
    tokens match the unpacked export within 1e-4 through the CPU stand-in, for right/left padding,
    batch 1 and no padding."""
    from graphopt.runtime.standins import cpu_runnable

    path = minilm(exporter, attn)
    feeds = _minilm_feeds()
    rng = np.random.default_rng(2)
    for lengths in ([11], [9, 9, 9]):  # batch 1, no padding
        f = _feed(lengths)
        f["input_ids"] = rng.integers(1000, 20000, f["input_ids"].shape).astype(np.int64)
        feeds.append(f)
    ref = run(make_session(path, optimize=False), feeds)
    model = ir.load(path)
    registry.create("fuse")(model, registry.PassContext(provider="cuda"))  # what `optimize --provider cuda` runs
    result = _apply_cuda(model)
    assert result.modified, result.notes
    ops = collections.Counter(n.op_type for n in result.model.graph)
    assert ops["PackedMultiHeadAttention"] == 6 and ops["MultiHeadAttention"] == 0, ops
    assert ops["Attention"] == 0 and ops["EmbedLayerNormalization"] == 0, ops
    got = run(make_session(cpu_runnable(result.model)[0]), feeds)
    for f, g, r in zip(feeds, got, ref):
        cmp = compare([g], [r], [f])
        assert cmp.worst("max_abs") <= 1e-4, cmp.summary()

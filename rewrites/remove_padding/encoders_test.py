"""Hand-built encoders and feeds shared by the remove-padding tests (no tests here).

``encoder``: a one-layer BERT-like encoder in standard ops, with variants (fused attention, pooling
heads, GPT-2-style flattened Gemm rows); ``fused_encoder``: what ``fuse`` makes of it; ``padded_feed`` /
``FEEDS``: batches with right/left padding, holes, empty rows; ``apply`` / ``check_exact``: run the
pass and compare with the model before on real tokens.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper
from testmodels import embed_layernorm_prologue

from graphopt.data.metrics import compare
from graphopt.engine import registry
from graphopt.runtime.session import make_session, run

H, NH, VOCAB, MAXPOS = 16, 2, 50, 64


def encoder(*, mask: bool = True, pool: bool | str = False, mask_in_softmax: bool = True,
            position_ids: bool = False, opset: int = 17, mha: str = "", flat: str = "") -> ir.Model:
    """A one-layer BERT-like encoder in standard ops (embeddings, attention, FFN, LayerNorms).

    ``pool``: True (mean over the sequence), "cls" (``Gather`` of position 0: ``[B, H]``), "classifier"
    (that, then pooler Gemm + Tanh and a 3-label Gemm: ``logits``), "slice" (the classifier with a
    ``Slice`` of ``[0:1]`` + Squeeze), "second" (``Gather`` of position 1, a token shift).
    ``flat``: "gemm" runs the first FFN projection as GPT-2's Conv1D does (``Reshape [B, S, H] -> [B*S, H]``,
    ``Gemm`` with bias, ``Reshape`` back); "mixing" also centres its rows over all tokens of the batch
    (``ReduceMean`` over the flattened rows: mixes positions, padding included).
    """
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
    ]
    if flat:
        nodes += [
            helper.make_node("Reshape", ["x1", c("rows_h", np.array([-1, H], np.int64))], ["x1_rows"]),
            helper.make_node("Gemm", ["x1_rows", w("W1", H, 4 * H), w("bf1", 4 * H)], ["f1_rows"]),
            helper.make_node("Shape", ["x1"], ["x1_lead"], start=0, end=2),
            helper.make_node("Concat", ["x1_lead", c("ffn_w", np.array([4 * H], np.int64))], ["f1_shape"], axis=0),
        ]
        if flat == "mixing":
            nodes += [helper.make_node("ReduceMean", ["f1_rows"], ["f1_mean"], axes=[0], keepdims=1),
                      helper.make_node("Sub", ["f1_rows", "f1_mean"], ["f1_centred"])]
        nodes.append(helper.make_node("Reshape", ["f1_centred" if flat == "mixing" else "f1_rows", "f1_shape"], ["f1"]))
    else:
        nodes.append(helper.make_node("MatMul", ["x1", w("W1", H, 4 * H)], ["f1"]))
    nodes += [
        helper.make_node("Gelu", ["f1"], ["f1g"]) if opset >= 20 else helper.make_node("Erf", ["f1"], ["f1g"]),
        helper.make_node("MatMul", ["f1g", w("W2", 4 * H, H)], ["f2"]),
        helper.make_node("Add", ["f2", "x1"], ["res2"]),
        helper.make_node("LayerNormalization", ["res2", w("g2", H), w("b2", H)], ["hidden"], axis=-1, epsilon=1e-5),
    ]
    out_name = "last_hidden_state"
    if pool == "cls":  # the first position of every row (a pad token under left padding)
        nodes.append(helper.make_node("Gather", ["hidden", c("zero_idx", np.array(0, np.int64))], [out_name], axis=1))
        out = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", H])
    elif pool in ("classifier", "slice", "second"):
        if pool == "slice":
            nodes += [helper.make_node("Slice", ["hidden", c("p0", np.array([0], np.int64)), c("p1", np.array([1], np.int64)),
                                                 c("pax", np.array([1], np.int64))], ["first"]),
                      helper.make_node("Squeeze", ["first", "pax"], ["pooled"])]
        else:
            at = np.array(1 if pool == "second" else 0, np.int64)
            nodes.append(helper.make_node("Gather", ["hidden", c("pool_idx", at)], ["pooled"], axis=1))
        out_name = "logits"
        nodes += [helper.make_node("Gemm", ["pooled", w("Wp", H, H), w("bp", H)], ["pooler"]),
                  helper.make_node("Tanh", ["pooler"], ["pooler_act"]),
                  helper.make_node("Gemm", ["pooler_act", w("Wc", H, 3), w("bc", 3)], [out_name])]
        out = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", 3])
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


def fused_encoder(mask_layout: str) -> ir.Model:
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


def padded_feed(lengths, seq=None, *, left=False, position_ids=False, mask=True, seed=0):
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


def apply(model: ir.Model, **options) -> registry.PassResult:
    return registry.create("remove-padding", options)(model)


def apply_cuda(model: ir.Model, **options) -> registry.PassResult:
    """The pass as ``--provider cuda`` runs it."""
    return registry.create("remove-padding", options)(model, registry.PassContext(provider="cuda"))


def check_exact(model_factory, feeds, atol=1e-5, **options):
    ref_model = model_factory()
    ref = run(make_session(ref_model, optimize=False), feeds)
    model = model_factory()
    result = apply(model, **options)
    assert result.modified, result.notes
    got = run(make_session(result.model, optimize=False), feeds)
    return got, ref, compare(got, ref, feeds, atol=atol, rtol=atol), result.model


FEEDS = {
    "right": padded_feed([5, 3, 1, 7]),
    "left": padded_feed([5, 3, 1, 7], left=True, seed=1),
    "no_padding": padded_feed([6, 6, 6]),
    "batch1": padded_feed([4], seq=9),
    "all_padding_row": padded_feed([4, 0, 2]),
    "holes": None,  # a mask with interior zeros, filled below
}
FEEDS["holes"] = padded_feed([6, 6], seed=2)
FEEDS["holes"]["attention_mask"][0, 2] = 0
FEEDS["all_padding_batch"] = padded_feed([0, 0], seq=4)


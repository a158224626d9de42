"""remove-padding for CUDA: com.microsoft PackedMultiHeadAttention, checked through its CPU stand-in.

ONNX Runtime runs PackedMultiHeadAttention on CUDA only. Here its CPU stand-in (graphopt.runtime.standins, an exact standard-op reference of the op's semantics) checks everything the pass builds around it; the CUDA kernel itself runs in test_cuda_kernel_on_gpu (skipped without CUDA) and tools/cuda_checks.py.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from graphopt.data.metrics import compare
from graphopt.rewrites.remove_padding.encoders_test import (
    FEEDS,
    NH,
    VOCAB,
    H,
    apply,
    apply_cuda,
    encoder,
    fused_encoder,
    padded_feed,
)
from graphopt.runtime.session import make_session, run

ALL_FEEDS = ["right", "left", "no_padding", "batch1", "all_padding_row", "holes", "all_padding_batch"]


def _ms_ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph if n.domain == "com.microsoft")


@pytest.mark.parametrize("groups", [8, 0])
@pytest.mark.parametrize("kind", ["mha_kpm", "fused_raw"])
def test_cuda_packed_attention_exact_via_standin(kind, groups):
    """On fused attention with a plain key padding mask, provider cuda gives one PackedMultiHeadAttention
    per attention op (no MultiHeadAttention, no length groups), exact on real tokens for every padding
    pattern (through the CPU stand-in); attention_groups=0 does not turn it off."""
    from graphopt.runtime.standins import cpu_runnable

    factory = {"mha_kpm": lambda: encoder(mha="kpm"), "fused_raw": lambda: fused_encoder("raw")}[kind]
    feeds = [FEEDS[k] for k in ALL_FEEDS]
    ref = run(make_session(factory(), optimize=False), feeds)
    result = apply_cuda(factory(), attention_groups=groups)
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

    result = apply_cuda(encoder(mha="kpm"))
    runnable, _ = cpu_runnable(result.model)
    values = {v.name: v for node in runnable.graph for v in node.outputs}
    runnable.graph.outputs.extend([values["packing_token_offset"], values["packing_cumulative_sequence_length"]])
    feed = padded_feed([5, 3, 1, 7], left=True, seed=1)
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
    ref = run(make_session(encoder(mha=mha), optimize=False), feeds)
    result = apply_cuda(encoder(mha=mha))
    assert result.modified, result.notes
    ops = _ms_ops(result.model)
    assert ops["PackedMultiHeadAttention"] == 0 and ops["MultiHeadAttention"] == 8, ops
    assert any("not PackedMultiHeadAttention" in n and reason in n for n in result.notes), result.notes
    got = run(make_session(result.model, optimize=False), feeds)  # runs on CPU as it is
    assert compare(got, ref, feeds).worst("max_abs") <= 1e-5


def test_cuda_packed_attention_off():
    result = apply_cuda(encoder(mha="kpm"), packed_attention=False)
    ops = _ms_ops(result.model)
    assert ops["PackedMultiHeadAttention"] == 0 and ops["MultiHeadAttention"] == 8, ops


def test_cpu_provider_never_emits_packed_attention():
    result = apply(encoder(mha="kpm"))
    assert _ms_ops(result.model)["PackedMultiHeadAttention"] == 0
    assert not any("PackedMultiHeadAttention" in n for n in result.notes), result.notes


def test_cuda_pipeline_verifies_through_standin():
    """--provider cuda through the pipeline: verified on CPU with the stand-in, and the report says so."""
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions

    feeds = [FEEDS[k] for k in ("right", "left", "holes", "batch1")]
    res = pipeline.optimize(fused_encoder("raw"), OptimizeOptions(passes="remove-padding", provider="cuda",
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

    result = apply_cuda(fused_encoder("raw"))
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
    result = apply_cuda(fused_encoder("raw"))
    sess = make_session(result.model, provider="cuda", optimize=True)
    if "CUDAExecutionProvider" not in sess.get_providers():
        pytest.skip("the CUDA provider did not initialise")
    want = run(make_session(cpu_runnable(result.model)[0], optimize=False), feeds)
    # loose: ORT's CUDA provider runs fp32 MatMuls in TF32 by default; an index error is O(1)
    assert compare(run(sess, feeds), want, feeds).worst("max_abs") <= 1e-2

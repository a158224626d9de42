"""Tests of _quant_smooth: SmoothQuant factors, alpha choice, and dividing the activation (fold or Mul)."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest
from testmodels import make_shared_matmuls

from graphopt.rewrites.common import activations as calib
from graphopt.rewrites.quantize import smooth
from graphopt.rewrites.quantize import targets as targets_mod
from graphopt.runtime.session import make_session, run

RNG = np.random.default_rng(4)
X = RNG.standard_normal((2, 5, 8)).astype(np.float32)


def _stats(model: ir.Model) -> calib.Stats:
    return calib.collect(model, [{"x": X}], ["a"])["a"]


def _outputs(model: ir.Model) -> dict[str, np.ndarray]:
    return run(make_session(model, optimize=False), [{"x": X}])[0]


def test_smooth_factors_formula_and_clip():
    stats = calib.Stats(chan_min=np.array([-4.0, -1.0, 0.0]), chan_max=np.array([1.0, 9.0, 1e-9]))
    w1 = np.array([[1.0, -2.0], [0.5, 0.5], [1.0, 1.0]], np.float32)
    w2 = np.array([[0.25], [-3.0], [1.0]], np.float32)
    s = smooth.smooth_factors(stats, [w1, w2], alpha=0.5)
    amax, wmax = np.array([4.0, 9.0, 1e-5]), np.array([2.0, 3.0, 1.0])
    np.testing.assert_allclose(s, np.clip(np.sqrt(amax) / np.sqrt(wmax), 1e-3, 1e3), rtol=1e-6)
    assert s[2] == pytest.approx(np.sqrt(1e-5))
    big = calib.Stats(chan_min=np.array([-1e9]), chan_max=np.array([1e9]))
    assert smooth.smooth_factors(big, [np.ones((1, 1), np.float32)], alpha=1.0)[0] == pytest.approx(1e3)


def test_smoothing_lowers_the_error_of_an_outlier_channel():
    model = ir.serde.deserialize_model(make_shared_matmuls())
    stats = _stats(model)
    group = [t for t in targets_mod.find_targets(model) if t.act.name == "a"]
    w = group[0].weight_array
    s, alpha = smooth.choose(stats, group, "auto", static=False)
    assert alpha in smooth.ALPHAS
    plain = smooth.local_error(stats.rows, w, None, None)
    assert smooth.local_error(stats.rows, w, s, None) < plain
    # auto picks the alpha with the least summed error over the layers reading the activation
    weights = [t.weight_array for t in group]

    def total(a: float) -> float:
        return sum(smooth.local_error(stats.rows, wi, smooth.smooth_factors(stats, weights, a), None) for wi in weights)

    assert total(alpha) == min(total(a) for a in smooth.ALPHAS)
    s_fixed, a_fixed = smooth.choose(stats, group, "0.5", static=False)
    assert a_fixed == 0.5 and np.array_equal(s_fixed, smooth.smooth_factors(stats, weights, 0.5))


def _smooth(layernorm: bool, ln_is_output: bool = False):
    model = ir.serde.deserialize_model(make_shared_matmuls(layernorm=layernorm))
    if ln_is_output:
        model.graph.outputs.append(model.graph.node("ln").outputs[0])
    want = _outputs(model)
    targets = targets_mod.find_targets(model)
    s = np.linspace(0.5, 4.0, 8).astype(np.float32)
    counts = smooth.apply_smoothing(model, targets, {"a": s})
    for t in targets:  # what qdq.apply does with QConfig.smooth
        t.weight.const_value = ir.tensor(t.weight_array * s.reshape(-1, 1), name=t.weight.name)
    return model, targets, counts, want, s


def test_mul_when_the_producer_cannot_absorb_it():
    model, targets, counts, want, s = _smooth(layernorm=False)
    assert counts == {"smooth-mul": 1}
    mul = model.graph.node("a_smooth")
    assert mul.op_type == "Mul" and all(t.act is mul.outputs[0] for t in targets)
    np.testing.assert_allclose(mul.inputs[1].const_value.numpy(), 1 / s, rtol=1e-6)
    got = _outputs(model)
    for k in want:  # x / s then diag(s) W: the same in float
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_folded_into_layernorm():
    model, targets, counts, want, s = _smooth(layernorm=True)
    assert counts == {"smooth-fold-layernorm": 1}
    assert collections.Counter(n.op_type for n in model.graph)["Mul"] == 1  # only the model's own outlier Mul
    assert all(t.act.name == "a" for t in targets)
    got = _outputs(model)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_not_folded_when_the_layernorm_output_is_read_elsewhere():
    model, targets, counts, want, _ = _smooth(layernorm=True, ln_is_output=True)
    assert counts == {"smooth-mul": 1}
    got = _outputs(model)
    for k in want:  # the LayerNorm output itself is unchanged
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4)


def _grouped_attention(shared_bias_reader: bool = False, onnx_attention: bool = False):
    """remove-padding's CPU form in small: V = MatMul(xp, Wv) -> Squeeze -> Gather per group ->
    MultiHeadAttention per group -> Reshape [-1, H] -> Concat -> Gather(inverse) -> MatMul(Wo).
    ``onnx_attention``: ``attention_op=onnx``'s form, V = Add(MatMul(xp, Wv), bv) and ONNX Attention."""
    from onnx import TensorProto, helper, numpy_helper

    h, rng = 8, np.random.default_rng(7)
    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["xp", "wv"], ["vp0" if onnx_attention else "vp"], name="mm_v"),
             helper.make_node("Squeeze", ["vp", "zero"], ["vr"], name="sq")]
    if onnx_attention:
        nodes.insert(1, helper.make_node("Add", ["vp0", "bv"], ["vp"], name="add_v"))
    parts = []
    for g in range(2):
        if onnx_attention:
            attn = helper.make_node("Attention", [f"q{g}", f"k{g}", f"v{g}"], [f"o{g}"], q_num_heads=2,
                                    kv_num_heads=2, name=f"mha{g}")
        else:
            attn = helper.make_node("MultiHeadAttention", [f"q{g}", f"k{g}", f"v{g}", "bias"], [f"o{g}"],
                                    domain="com.microsoft", num_heads=2, name=f"mha{g}")
        nodes += [helper.make_node("Gather", ["vr", f"map{g}"], [f"v{g}"], axis=0, name=f"gv{g}"), attn,
                  helper.make_node("Reshape", [f"o{g}", "rows"], [f"r{g}"], name=f"rs{g}")]
        parts.append(f"r{g}")
    nodes += [helper.make_node("Concat", parts, ["cat"], axis=0, name="cat"),
              helper.make_node("Gather", ["cat", "inverse"], ["a"], axis=0, name="unpack"),
              helper.make_node("MatMul", ["a", "wo"], ["z"], name="mm_o")]
    outputs = [helper.make_tensor_value_info("z", f, None)]
    if shared_bias_reader:  # the bias read by something else too: no fold
        nodes.append(helper.make_node("Identity", ["bias"], ["bias_out"], name="id"))
        outputs.append(helper.make_tensor_value_info("bias_out", f, None))
    inputs = [helper.make_tensor_value_info("xp", f, [1, 7, h])]
    for g, (b, s) in enumerate(((2, 3), (1, 1))):
        inputs += [helper.make_tensor_value_info(f"q{g}", f, [b, s, h]), helper.make_tensor_value_info(f"k{g}", f, [b, s, h]),
                   helper.make_tensor_value_info(f"map{g}", TensorProto.INT64, [b, s])]
    inputs.append(helper.make_tensor_value_info("inverse", TensorProto.INT64, [7]))
    inits = [numpy_helper.from_array(rng.standard_normal((h, h)).astype(np.float32), "wv"),
             numpy_helper.from_array(rng.standard_normal((h, 4)).astype(np.float32), "wo"),
             numpy_helper.from_array(rng.standard_normal(3 * h).astype(np.float32), "bias"),
             numpy_helper.from_array(rng.standard_normal(h).astype(np.float32), "bv"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([-1, h], np.int64), "rows")]
    inits = [i for i in inits if i.name != ("bias" if onnx_attention else "bv")]  # the one the form does not read
    m = helper.make_model(helper.make_graph(nodes, "grouped", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 23 if onnx_attention else 17),
                                         helper.make_opsetid("com.microsoft", 1)])
    feed = {"xp": rng.standard_normal((1, 7, h)).astype(np.float32), "inverse": np.array([0, 1, 2, 3, 4, 5, 6]),
            "map0": np.array([[0, 1, 2], [3, 4, 5]]), "map1": np.array([[6]])}
    for g, (b, s) in enumerate(((2, 3), (1, 1))):
        feed[f"q{g}"], feed[f"k{g}"] = (rng.standard_normal((b, s, h)).astype(np.float32) for _ in range(2))
    return ir.serde.deserialize_model(m), feed


@pytest.mark.parametrize(("shared", "onnx_attention"), [(False, False), (True, False), (False, True)],
                         ids=["folded", "bias-read-elsewhere", "onnx-attention"])
def test_folded_into_grouped_attention_values(shared, onnx_attention):
    model, feed = _grouped_attention(shared_bias_reader=shared, onnx_attention=onnx_attention)
    want = run(make_session(model, optimize=False), [feed])[0]
    targets = [t for t in targets_mod.find_targets(model) if t.key == "mm_o"]
    s = np.linspace(0.5, 4.0, 8).astype(np.float32)
    counts = smooth.apply_smoothing(model, targets, {"a": s})
    targets[0].weight.const_value = ir.tensor(targets[0].weight_array * s.reshape(-1, 1), name="wo")
    assert counts == ({"smooth-mul": 1} if shared else {"smooth-fold-mha-v": 1})
    assert ("Mul" in {n.op_type for n in model.graph}) == shared
    got = run(make_session(model, optimize=False), [feed])[0]
    np.testing.assert_allclose(got["z"], want["z"], rtol=1e-4, atol=1e-4)

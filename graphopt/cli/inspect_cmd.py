"""``graphopt inspect``: what is in a model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Json


def command(
    model: Annotated[Path, typer.Argument(help="ONNX model.", show_default=False)],
    json_: Json = False,
    batch: Annotated[int, typer.Option("--batch", help="Batch size for the FLOPs estimate.")] = 1,
    seq: Annotated[int, typer.Option("--seq", help="Sequence length for the FLOPs estimate.")] = 128,
) -> None:
    """Show opsets, IO signature, op histogram, parameters, FLOPs at --batch×--seq, custom domains,
    subgraphs and (for transformers) whether the model is fully fused.

    Example: graphopt inspect model.onnx --batch 32 --seq 64 --json
    """
    import json

    from rich.markup import escape

    from graphopt.analysis.inspect import inspect_model
    from graphopt.cli.console import make_console, table

    info = inspect_model(model, batch=batch, seq=seq)
    if json_:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    c = make_console()
    c.print(f"[bold]{escape(str(model))}[/]  IR {info['ir_version']}  producer: {escape(info['producer'] or '-')}")
    c.print("opsets: " + ", ".join(f"{k} {v}" for k, v in info["opsets"].items()), markup=False)
    for kind in ("inputs", "outputs"):
        for v in info[kind]:
            c.print(f"{kind[:-1]:>6} {v['name']}: {v['dtype']} {v['shape']}", markup=False)
    if info["overridable_initializers"]:
        c.print(f"{len(info['overridable_initializers'])} initializers are also graph inputs (overridable)")
    c.print(f"nodes: {info['nodes']}   parameters: {info['parameters']:,} ({info['parameter_bytes'] / 2**20:.1f} MiB)")
    fl = info.get("flops", {})
    if fl.get("total") is not None:
        c.print(f"FLOPs at batch {batch} × seq {seq}: {fl['total'] / 1e9:.3f} G"
                + (f" ({fl['unknown']} ops with unknown shapes)" if fl.get("unknown") else ""))
    if info["custom_domains"]:
        c.print("custom domains: " + ", ".join(info["custom_domains"]), markup=False)
    if info["subgraphs"]:
        c.print(f"subgraphs: {len(info['subgraphs'])} (" + ", ".join(s["owner"] for s in info["subgraphs"][:5]) + ")",
                markup=False)
    _print_fusion(c, info.get("fusion"), table)
    t = table("ops", [("op", {"no_wrap": True}), ("count", {"justify": "right"})])
    for k, v in info["ops"].items():
        t.add_row(k, str(v))
    c.print(t)


def _print_fusion(c, fu, table) -> None:
    """The fusion status as a small table: fused/unfused counts per kind and what they are."""
    from graphopt.analysis.fusion_status import describe

    if not isinstance(fu, dict):
        return
    if "error" in fu:
        c.print(f"fusion status unavailable: {fu['error']}", markup=False)
        return
    title = "fusion: " + ("fully fused" if fu["fully_fused"] else "not fully fused")
    t = table(title, [("kind", {"no_wrap": True}), ("fused", {"justify": "right"}),
                      ("unfused", {"justify": "right"}), "what"])
    for row in describe(fu):
        t.add_row(row["kind"], str(row["fused"]), str(row["unfused"]), row["detail"])
    c.print(t)

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

    from rich.console import Console
    from rich.table import Table

    from graphopt.inspect import inspect_model

    info = inspect_model(model, batch=batch, seq=seq)
    if json_:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    c = Console()
    c.print(f"[bold]{model}[/]  IR {info['ir_version']}  producer: {info['producer'] or '-'}")
    c.print("opsets: " + ", ".join(f"{k} {v}" for k, v in info["opsets"].items()), highlight=False)
    for kind in ("inputs", "outputs"):
        for v in info[kind]:
            c.print(f"{kind[:-1]:>6} {v['name']}: {v['dtype']} {v['shape']}", highlight=False)
    if info["overridable_initializers"]:
        c.print(f"{len(info['overridable_initializers'])} initializers are also graph inputs (overridable)")
    c.print(f"nodes: {info['nodes']}   parameters: {info['parameters']:,} ({info['parameter_bytes'] / 2**20:.1f} MiB)")
    fl = info.get("flops", {})
    if fl.get("total") is not None:
        c.print(f"FLOPs at batch {batch} × seq {seq}: {fl['total'] / 1e9:.3f} G"
                + (f" ({fl['unknown']} ops with unknown shapes)" if fl.get("unknown") else ""))
    if info["custom_domains"]:
        c.print("custom domains: " + ", ".join(info["custom_domains"]))
    if info["subgraphs"]:
        c.print(f"subgraphs: {len(info['subgraphs'])} (" + ", ".join(s["owner"] for s in info["subgraphs"][:5]) + ")")
    fu = info.get("fusion")
    if isinstance(fu, dict) and "fully_fused" in fu:
        c.print(f"fully fused: {'yes' if fu['fully_fused'] else 'no'}  {fu}", highlight=False)
    t = Table(title="ops", title_justify="left")
    t.add_column("op")
    t.add_column("count", justify="right")
    for k, v in info["ops"].items():
        t.add_row(k, str(v))
    c.print(t)

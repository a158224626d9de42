"""`graphopt export`: PyTorch / Hugging Face model -> ONNX, gated on parity with PyTorch.

A thin wrapper over ``graphopt.exporters.export``; torch and transformers load only when it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Json


def command(
    src: Annotated[str, typer.Argument(help="Hugging Face model folder (config + weights), module:function, or a .gguf decoder.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="ONNX file to write (a folder for .gguf).")],
    task: Annotated[
        str | None,
        typer.Option(
            "--task",
            help="feature-extraction, sequence-classification, token-classification, masked-lm, "
            "causal-lm, causal-lm-with-past (default: feature-extraction; causal-lm-with-past for .gguf).",
        ),
    ] = None,
    exporter: Annotated[
        str | None,
        typer.Option("--exporter", help="dynamo or torchscript (default: dynamo, falling back to torchscript)."),
    ] = None,
    attn: Annotated[
        str | None, typer.Option("--attn", help="Attention implementation: eager or sdpa (default: the model's).")
    ] = None,
    opset: Annotated[int | None, typer.Option("--opset", help="ONNX opset (default 20 dynamo, 17 torchscript).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32 or fp16 weights.")] = "fp32",
    atol: Annotated[
        float | None,
        typer.Option("--atol", help="Parity tolerance, max |onnx - torch| on real tokens (default 1e-4; fp16 1e-2)."),
    ] = None,
    json_out: Json = False,
) -> None:
    """Export a model to ONNX and check it against PyTorch (exit 3 when it does not match)."""
    from graphopt.cli.console import make_console
    from graphopt.exporters import export

    with make_console(stderr=True).status(f"exporting {src} ({task or 'default task'}) and checking parity with PyTorch ..."):
        result = export(src, output, task=task, exporter=exporter, attn=attn, opset=opset, dtype=dtype, atol=atol)
    if json_out:
        import json

        typer.echo(json.dumps(result.as_dict(), indent=2))
        return
    _print(result)


def _print(result) -> None:
    from graphopt.cli.console import make_console
    from graphopt.cli.console import table as make_table

    console = make_console()
    p = result.parity
    right = {"justify": "right"}
    table = make_table(f"parity vs PyTorch (atol {p.atol:g}; feeds: {', '.join(p.feeds)})",
                       [("output", {"no_wrap": True}), ("max_abs", right), ("cosine", right), ("positions", right),
                        "ok"])
    for o in p.outputs:
        table.add_row(o.name, f"{o.max_abs:.3g}", f"{o.cosine:.8f}", str(o.samples), "yes" if o.passed else "NO")
    console.print(table)
    if result.fallback:
        console.print(f"[yellow]dynamo export failed ({result.fallback}); used the TorchScript exporter[/]")
    console.print(
        f"wrote {result.path}: {result.exporter} exporter, {result.attn or 'unknown'} attention, "
        f"opset {result.opset}, {result.nodes} nodes, {result.dtype}, {result.seconds:.1f}s"
    )
    for note in getattr(result, "notes", None) or []:
        console.print(f"  {note}", markup=False, highlight=False)

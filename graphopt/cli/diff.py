"""`graphopt diff A B`: what changed between two models (structure, optionally numerics).

Exit codes: 0 ok (also when the models differ), 1 error (unreadable model, runtime failure),
2 usage, 3 only with ``--fail-on-drift`` when ``--numeric`` finds a graph output beyond tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import (
    Atol,
    Calib,
    InputShape,
    InputValue,
    Json,
    Quiet,
    Report,
    Rtol,
    feed_overrides,
)
from graphopt.errors import EXIT_VERIFY


def command(
    a: Annotated[Path, typer.Argument(help="Model A (before), an .onnx file.", metavar="A")],
    b: Annotated[Path, typer.Argument(help="Model B (after), an .onnx file.", metavar="B")],
    numeric: Annotated[bool, typer.Option("--numeric", help="Run both models and compare shared tensors.")] = False,
    calib: Calib = None,
    input_shape: InputShape = None,
    input_value: InputValue = None,
    json_: Json = False,
    report: Report = None,
    html_file: Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML report to FILE.",
                                                      metavar="FILE")] = None,
    mapping_file: Annotated[Path | None, typer.Option("--mapping", metavar="FILE",
                                                         help="Write a Model Explorer node-mapping JSON.")] = None,
    atol: Atol = 1e-4,
    rtol: Rtol = 1e-4,
    fail_on_drift: Annotated[bool, typer.Option("--fail-on-drift",
                                                help="Exit 3 when --numeric finds an output beyond tolerance.")] = False,
    quiet: Quiet = False,
) -> None:
    """Diff two ONNX models: rewritten regions and the passes that made them, op/initializer/IO/FLOP
    deltas, and with --numeric the first tensor that drifts beyond tolerance (--atol, --rtol).

    --json prints the JSON diff (docs/diff-json-schema.md) to stdout; --report writes it to FILE.
    """
    from graphopt import io
    from graphopt.diff import diff_models
    from graphopt.errors import UsageError

    if calib is not None and not numeric:
        raise UsageError("--calib needs --numeric", hint="add --numeric to compare tensors on those feeds")
    if fail_on_drift and not numeric:
        raise UsageError("--fail-on-drift needs --numeric")
    shapes, values = feed_overrides(input_shape, input_value, calib)
    if (shapes or values) and not numeric:
        raise UsageError("--input-shape/--input-value need --numeric")
    result = diff_models(a, b, numeric=numeric, calib=calib, input_shapes=shapes, input_values=values,
                         atol=atol, rtol=rtol)
    if report is not None:
        io.write_atomic(report, result.to_json() + "\n")
    if html_file is not None:
        from graphopt.diff import html

        io.write_atomic(html_file, html.render_html(result))
    if mapping_file is not None:
        from graphopt.diff import mapping

        io.write_atomic(mapping_file, mapping.to_json(result))
    if json_:
        typer.echo(result.to_json())
    elif not quiet:
        from graphopt.cli.console import make_console
        from graphopt.diff import terminal

        terminal.render(result, make_console())
        for what, f in (("JSON", report), ("HTML", html_file), ("mapping", mapping_file)):
            if f is not None:
                typer.echo(f"{what} written to {f}")
    if fail_on_drift and result.drift:
        raise typer.Exit(EXIT_VERIFY)

"""``graphopt verify``: compare two models numerically, optionally against a budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Budget, Calib, InputShape, InputValue, Json, Provider, feed_overrides


def command(
    reference: Annotated[Path, typer.Argument(help="Reference model A.", show_default=False)],
    candidate: Annotated[Path, typer.Argument(help="Candidate model B.", show_default=False)],
    calib: Calib = None,
    input_shape: InputShape = None,
    input_value: InputValue = None,
    budget: Budget = None,
    atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance when no --budget is given.")] = 1e-4,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance when no --budget is given.")] = 1e-4,
    provider: Provider = "cpu",
    json_: Json = False,
) -> None:
    """Run A and B on the same feeds (--calib, or generated to make A run; --input-shape and
    --input-value fix an input's shape or value) and compare their
    outputs mask-aware. Exit 3 when the budget (or, without one, atol + rtol*|ref|) is not met.

    Example: graphopt verify model.onnx model.opt.onnx --calib feeds/ --budget 'cosine>=0.99'
    """
    import json

    from rich.console import Console
    from rich.table import Table

    from graphopt import feeds as feeds_mod
    from graphopt import io
    from graphopt.errors import EXIT_VERIFY
    from graphopt.metrics import compare, parse_budget
    from graphopt.verify import run_model

    parsed = parse_budget(budget)
    shapes, values = feed_overrides(input_shape, input_value, calib)
    a = io.load(reference)
    b = io.load(candidate)
    out_a = None
    if calib is not None:
        feeds = feeds_mod.load_dir(calib)
        feeds_mod.check_against(a, feeds)
    else:  # generated feeds that make A run (A's outputs on them come along on CPU)
        feeds, out_a = feeds_mod.runnable(a, shapes=shapes, values=values)
    if out_a is None or provider != "cpu":
        out_a = run_model(a, feeds, provider=provider)
    out_b = run_model(b, feeds, provider=provider)
    shared = [n for n in out_a[0] if n in out_b[0]] if out_a else []
    cmp = compare(out_b, out_a, feeds, atol=atol, rtol=rtol, outputs=shared)
    missing = [n for n in (out_a[0] if out_a else {}) if n not in shared]
    fails = parsed.failures(cmp) if parsed else ([] if cmp.within(atol, rtol) else [f"outputs differ beyond atol {atol:g} + rtol {rtol:g}*|ref|"])
    if missing:
        fails.append("outputs missing from B: " + ", ".join(missing))
    if json_:
        typer.echo(json.dumps({"ok": not fails, "failures": fails, "budget": str(parsed), "feeds": feeds_mod.describe(feeds),
                               **cmp.as_dict()}, indent=2, default=str))
    else:
        t = Table(title=f"{reference} vs {candidate} ({feeds_mod.describe(feeds)})", title_justify="left")
        for c in ("output", "max_abs", "max_rel", "cosine", "cosine_min", "top1", "mismatch"):
            t.add_column(c, justify="right" if c != "output" else "left")
        for d in cmp.outputs.values():
            t.add_row(d.name, f"{d.max_abs:.3g}", f"{d.max_rel:.3g}", f"{d.cosine:.6f}", f"{d.cosine_min:.6f}",
                      f"{d.top1:.4f}", f"{100 * d.mismatch:.2f}%")
        c = Console()
        c.print(t)
        c.print("[green]ok[/]" if not fails else "[red]FAILED:[/] " + "; ".join(fails), highlight=False)
    if fails:
        raise typer.Exit(EXIT_VERIFY)

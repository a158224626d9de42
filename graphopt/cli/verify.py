"""``graphopt verify``: compare two models numerically, optionally against a budget.

A thin wrapper over ``graphopt.engine.verify.compare_models``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import (
    Atol,
    Budget,
    Calib,
    InputShape,
    InputValue,
    Json,
    Provider,
    Rtol,
    calib_or_text,
    feed_overrides,
)


def command(
    reference: Annotated[Path, typer.Argument(help="Reference model A.", show_default=False)],
    candidate: Annotated[Path, typer.Argument(help="Candidate model B.", show_default=False)],
    calib: Calib = None,
    text_window: Annotated[int, typer.Option("--text-window", help="Decoder budgets: tokens per window of the --calib text (the context the budget is measured at).")] = 64,
    input_shape: InputShape = None,
    input_value: InputValue = None,
    budget: Budget = None,
    atol: Atol = 1e-4,
    rtol: Rtol = 1e-4,
    provider: Provider = "cpu",
    json_: Json = False,
) -> None:
    """Run A and B on the same feeds (--calib, or generated to make A run; --input-shape and
    --input-value fix an input's shape or value) and compare their
    outputs mask-aware. Exit 3 when the budget (or, without one, atol + rtol*|ref|) is not met.

    Example: graphopt verify model.onnx model.opt.onnx --calib feeds/ --budget 'cosine>=0.99'
    """
    import json

    from graphopt.cli.console import make_console, table
    from graphopt.data import feeds as feeds_mod
    from graphopt.data.metrics import REL_FLOOR
    from graphopt.engine.verify import compare_models
    from graphopt.errors import EXIT_VERIFY

    shapes, values = feed_overrides(input_shape, input_value, calib)
    calib, text = calib_or_text(calib)
    res = compare_models(reference, candidate, calib=calib, budget=budget, atol=atol, rtol=rtol, provider=provider,
                         shapes=shapes, values=values, text=text, text_window=text_window)
    if json_:
        typer.echo(json.dumps(res.as_dict(), indent=2, default=str))
    else:
        right = {"justify": "right", "no_wrap": True}
        t = table(f"{reference} vs {candidate} ({feeds_mod.describe(res.feeds)})",
                  [("output", {"no_wrap": True})]
                  + [(c, right) for c in ("max_abs", "max_rel", "|ref| floor", "cosine", "cosine_min", "top1",
                                          "mismatch")])
        for d in res.comparison.outputs.values():
            t.add_row(d.name, f"{d.max_abs:.3g}", f"{d.max_rel:.3g}", f"{d.rel_floor:.3g}", f"{d.cosine:.6f}",
                      f"{d.cosine_min:.6f}", f"{d.top1:.4f}", f"{100 * d.mismatch:.2f}%")
        c = make_console()
        c.print(t)
        c.print(f"max_rel = max |B-A| / |A| over the elements with |A| >= the floor ({REL_FLOOR:.0%} of the "
                "output's largest |A| in a feed)", style="dim")
        if res.comparison.decoder:
            d = res.comparison.decoder
            c.print(f"decoder on {res.text}: ppl_ratio {d['ppl_ratio']:.4f} (ppl {d['ppl']:.3f} vs "
                    f"{d['ppl_reference']:.3f}), greedy_match {d['greedy_match']:.4f}", highlight=False)
        c.print("[green]ok[/]" if res.ok else "[red]FAILED:[/] " + "; ".join(res.failures), highlight=False)
    if not res.ok:
        raise typer.Exit(EXIT_VERIFY)

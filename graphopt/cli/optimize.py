"""``graphopt optimize``: run a recipe on a model, verified pass by pass."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import (
    Budget,
    Calib,
    InputShape,
    InputValue,
    Json,
    Provider,
    Quiet,
    Report,
    calib_or_text,
    feed_overrides,
)

EPILOG = """\
Examples:

  graphopt optimize model.onnx -o model.opt.onnx

  graphopt optimize model.onnx -o out.onnx --passes cleanup --report report.json

  graphopt optimize model.onnx -o out.onnx --set cleanup.cse=false --calib feeds/

  graphopt optimize model.onnx -o out.onnx --recipe my_recipe.toml --verify structure

  graphopt optimize vad.onnx -o out.onnx --input-shape input:1,512 --input-value sr=16000

  graphopt optimize model.onnx -o fast.onnx --calib feeds/ --budget 'cosine>=0.99' --search --time-limit 10m
"""


def command(
    model: Annotated[Path, typer.Argument(help="Input ONNX model.", show_default=False)],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output ONNX file.")] = None,
    passes: Annotated[str | None, typer.Option("--passes", help="Comma-separated pass names (instead of the default recipe).")] = None,
    recipe: Annotated[str | None, typer.Option("--recipe", help="Recipe TOML file or builtin recipe name.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Pass option PASS.KEY=VALUE (repeatable).")] = None,
    calib: Calib = None,
    text_window: Annotated[int, typer.Option("--text-window", help="Decoder budgets (ppl_ratio, greedy_match): tokens per calibration and held-back window of the text, i.e. the context the budget is measured at.")] = 64,
    input_shape: InputShape = None,
    input_value: InputValue = None,
    budget: Budget = None,
    provider: Provider = "cpu",
    verify: Annotated[str, typer.Option("--verify", help="Verification after each pass: off, structure or numeric.")] = "numeric",
    report: Report = None,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="When a lossy pass fails or cannot meet the budget: keep the model as it was before it, continue, write it (exit 0).")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 3 (no output) when any pass is rolled back, lossless ones included.")] = False,
    require_budget: Annotated[bool, typer.Option("--require-budget", hidden=True, help="Kept for old scripts: an unmet budget always fails the run now.")] = False,
    debug_dir: Annotated[Path | None, typer.Option("--debug-dir", help="Save before/after models of a failing pass here.")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="Show why expected patterns did not match.")] = False,
    in_place: Annotated[bool, typer.Option("--in-place", help="Allow the output to replace the input file.")] = False,
    external_data: Annotated[bool | None, typer.Option("--external-data/--no-external-data", help="Force initializers into (or out of) a .data file; default: when the input had external data, or above 2 GB.")] = None,
    max_memory: Annotated[str | None, typer.Option("--max-memory", help="Memory the run may use (e.g. 12G); default: what the system reports available. Graphopt streams the weights when needed and stops with an error, before loading, when its estimate exceeds this.")] = None,
    search: Annotated[bool, typer.Option("--search", help="Search the lossy passes' settings for the fastest model within --budget; writes OUT, OUT's .search.toml (its recipe), .search.json and .pareto.png.")] = False,
    time_limit: Annotated[str, typer.Option("--time-limit", help="--search: time to spend, e.g. 10m, 90s.")] = "10m",
    workers: Annotated[int, typer.Option("--workers", help="--search: trials in parallel worker processes (0: in this process).")] = 1,
    ray: Annotated[str | None, typer.Option("--ray", metavar="ADDRESS", help="--search: run the trials on this Ray cluster ('auto', 'local', host:port; needs the ray extra of graphopt).")] = None,
    search_passes: Annotated[str | None, typer.Option("--search-passes", help="--search: the lossy passes to explore (default: all).")] = None,
    speed_check: Annotated[str, typer.Option("--speed-check", help="Time the output against the input and roll back lossless passes that made it slower: auto (when a timed round is cheap), on, off.")] = "auto",
    json_: Json = False,
    quiet: Quiet = False,
) -> None:
    """Optimize MODEL with the default recipe (every lossless pass) or the passes you name.

    Every pass is verified (ONNX checker, shape inference, an ONNX Runtime session, numeric parity
    with the model before it). A lossless pass that fails is rolled back and the recipe goes on
    without it (a warning; --strict: exit 3, no output). A lossy pass that fails or cannot meet
    --budget (or its default budget) stops the run: exit 3, no output, unless --keep-going.
    """
    from graphopt.cli.console import make_console
    from graphopt.data.metrics import parse_budget
    from graphopt.engine import pipeline
    from graphopt.engine.options import OptimizeOptions
    from graphopt.errors import UsageError, VerificationError

    if output is None and not in_place:
        raise UsageError("no output path", hint="give -o OUT.onnx (or --in-place to replace the input)")
    out = output if output is not None else model
    if passes and recipe:
        raise UsageError("--passes and --recipe are exclusive", hint="use one of them")
    if search:
        from graphopt.cli import search as search_cmd

        if passes or recipe or set_:
            raise UsageError("--search chooses the passes itself", hint="drop --passes/--recipe/--set, or --search")
        if parse_budget(budget).decoder:
            raise UsageError("--search measures budgets on feeds; ppl_ratio and greedy_match are not searched",
                             hint="drop --search and run --recipe int4 with that budget")
        search_cmd.run(model, out, calib=calib, budget=budget, provider=provider, time_limit=time_limit,
                       workers=workers, ray=ray, families=search_passes, report=report, json_=json_, quiet=quiet,
                       in_place=in_place)
        return
    if ray or search_passes or workers != 1:
        raise UsageError("--workers, --ray and --search-passes go with --search", hint="add --search")
    parsed_budget = parse_budget(budget)
    shapes, values = feed_overrides(input_shape, input_value, calib)
    calib, text = calib_or_text(calib)
    options = OptimizeOptions(
        recipe=recipe, passes=passes, overrides=set_ or [], calib=calib, text=text, text_window=text_window,
        input_shapes=shapes,
        input_values=values,
        budget=parsed_budget, provider=provider, verify_level=verify, keep_going=keep_going, strict=strict,
        max_memory=max_memory, debug_dir=debug_dir, explain=explain, speed_check=speed_check,
    )

    console = make_console(stderr=True)
    with console.status("optimizing…") as status:
        result = pipeline.optimize_file(model, out, options, external_data=external_data, in_place=in_place,
                                        on_step=lambda name, i, n: status.update(f"pass {i + 1}/{n}: {name}"))
    rep = result.report
    for failed in rep.failed():
        if result.ok:
            console.print(f"[bold yellow]warning:[/] pass {failed.name!r} {failed.status}: {failed.error}; "
                          "the output is written without it (--strict fails instead)", highlight=False)
    if report is not None:
        rep.save(report)
    if json_:
        typer.echo(rep.to_json())
    elif not quiet:
        render(rep, make_console())
    if not result.ok:
        failed = rep.failed()[-1]
        lossy = not failed.exact and not keep_going
        raise VerificationError(
            f"pass {failed.name!r} {failed.status}: {failed.error}",
            hint="no output written; " + ("--keep-going writes the model without that pass" if lossy
                                          else "without --strict the model is written without that pass")
            + ", --debug-dir saves the before/after pair",
        )


def render(report, console=None) -> None:
    """Print the optimization report (``graphopt.engine.report.Report``): the per-pass table with rich (headers
    and pass names never split, see ``graphopt.cli.console``), then notes, rule counts, errors and the summary."""
    from graphopt.cli.console import make_console, table
    from graphopt.engine import speed_guard

    console = console or make_console()
    t = table(f"graphopt optimize: {report.input}",
              [("pass", {"no_wrap": True}), ("status", {"no_wrap": True}), "modified", ("s", {"justify": "right"}), "nodes",
               "op delta", "verification"])
    for p in report.passes:
        # largest changes first; the domain is dropped for display (the JSON report keeps it)
        top = sorted(p.op_delta.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:4]
        delta = " ".join(f"{k.split('::')[-1]}{v:+d}" for k, v in top)
        if len(p.op_delta) > 4:
            delta += f" …+{len(p.op_delta) - 4}"
        style = {"ok": "green", "rolled-back": "red", "error": "red", "budget-not-met": "red",
                 "slower": "yellow"}.get(p.status, "")
        t.add_row(
            p.name,
            f"[{style}]{p.status}[/]",
            "yes" if p.modified else "no",
            f"{p.seconds:.2f}",
            f"{p.nodes_before} → {p.nodes_after}",
            delta or "-",
            ("held-back: " if not p.exact and "max_abs" in p.verification else "") + _fmt_verif(p.verification),
        )
    console.print(t)
    for p in report.passes:
        for note in p.notes:
            console.print(f"[dim]{p.name}: {note}[/]", highlight=False)
        if p.rule_counts:
            rc = ", ".join(f"{k}×{v}" for k, v in sorted(p.rule_counts.items()))
            console.print(f"[dim]{p.name} rules: {rc}[/]", highlight=False)
        if p.error:
            console.print(f"[red]{p.name}: {p.error}[/]", highlight=False)
    if report.edge_feeds:
        console.print(f"[dim]edge feeds: {len(report.edge_feeds)} ({', '.join(report.edge_feeds)}), "
                      "checked by every lossless pass[/]", highlight=False)
    if report.speed and (report.speed.get("checked") or report.speed.get("reason", "off") != "off"):
        console.print(f"[dim]{speed_guard.note(report.speed)}[/]", highlight=False)
    if report.companions:
        console.print(f"[dim]beside the output: {', '.join(report.companions)} (copied from the input's folder)[/]",
                      highlight=False)
    if report.numerics.startswith("unverified"):
        console.print(f"[yellow]numerics {report.numerics}[/]", highlight=False)
    summary = f"{report.nodes_before} → {report.nodes_after} nodes in {report.seconds:.2f} s"
    if report.final:
        n = report.feeds.split(" ", 1)[0] if report.feeds and report.feeds[0].isdigit() else ""
        summary += f" · output vs input on all {n} feeds: ".replace("all  feeds", "all feeds") + _fmt_verif(report.final)
    console.print(summary, highlight=False)


def _fmt_verif(v: dict) -> str:
    if not v:
        return "-"
    if v.get("level") == "off":
        return "off"
    parts = []
    if "max_abs" in v:
        parts.append(f"max_abs {v['max_abs']:.2e}")
    if "cosine_min" in v:
        parts.append(f"cos_min {v['cosine_min']:.6f}")
    for k in ("ppl_ratio", "greedy_match"):
        if k in v:
            parts.append(f"{k} {v[k]:.4f}")
    if not parts:
        parts.append(v.get("level", ""))
    if v.get("edge"):
        parts.append(f"+{v['edge']['feeds']} edge")
    if v.get("reason"):
        parts.append(v["reason"])
    return " ".join(parts)

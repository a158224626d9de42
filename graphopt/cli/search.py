"""``graphopt optimize --search``: progress and the candidates table around :func:`graphopt.search.search`."""

from __future__ import annotations

from pathlib import Path

import typer


def run(model: Path, out: Path, *, calib: Path | None, budget: list[str] | None, provider: str, time_limit: str,
        workers: int, ray: str | None, families: str | None, report: Path | None, json_: bool, quiet: bool,
        in_place: bool) -> None:
    """Search, show progress (rich), write the chosen model and its recipe, report and plot; exit 3 when
    no candidate meets the budget (nothing written)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from graphopt import io
    from graphopt import search as search_mod
    from graphopt.cli.console import make_console

    io.check_output_path(model, out, in_place=in_place)
    search_mod.check_plot_support()
    limit = search_mod.parse_duration(time_limit)
    fams = [f.strip() for f in families.split(",") if f.strip()] if families else None
    console = make_console(stderr=True)
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    task = progress.add_task("lossless recipe…", total=None)

    def on_event(kind: str, info: dict) -> None:
        if kind == "base":
            progress.console.print(f"lossless base {info['name']!r} in {info['seconds']:.1f} s", highlight=False)
        elif kind == "planned":
            progress.update(task, total=info["total"], description="searching")
        elif kind == "started":
            progress.update(task, description=f"trying {info['name']}")
        elif kind == "trial":
            t, best = info["trial"], info["best"]
            progress.advance(task)
            progress.console.print(f"  {t.name}: {_describe(t)}", highlight=False, markup=False)
            if best is not None:
                progress.update(task, description=f"best: {best.name} {best.speedup:.2f}x")
        elif kind == "duel":
            progress.update(task, description="final duel")

    with progress:
        result = search_mod.search(model, calib=calib, budget=budget, provider=provider, time_limit=limit,
                                   workers=workers, ray_address=ray, families=fams, on_event=on_event)
    if not quiet and not json_:
        render(result, make_console())
    paths = search_mod.write(result, out, report=report, calib=calib, src=model, in_place=in_place)
    if json_:
        typer.echo(paths["report"].read_text())
    elif not quiet:
        c = make_console()
        what = "best so far (interrupted)" if result.interrupted else "chosen"
        c.print(f"{what}: {result.chosen.name} ({search_mod.chosen_speedup(result.chosen):.2f}x the lossless recipe) → {paths['model']}",
                highlight=False)
        c.print(f"recipe {paths['recipe']} · report {paths['report']} · Pareto plot {paths['plot']}", highlight=False)
        c.print("rerun without searching: " + search_mod.rerun_command(result, out, paths["recipe"], calib),
                highlight=False)


def _describe(t) -> str:
    if t.status != "ok":
        return f"{t.status}: {t.reason}"
    q = ", ".join(f"{k} {v:.5f}" for k, v in t.held.items() if k in ("cosine", "cosine_min", "top1"))
    verdict = "meets the budget" if t.meets_budget else f"misses: {t.reason}"
    if t.same_as:
        verdict += f" (the same model as {t.same_as})"
    return f"{t.speedup:.2f}x, held-back {q}; {verdict} [{t.seconds:.0f} s, {t.worker}]"


def render(result, console) -> None:
    """The candidates table (Pareto members marked)."""
    from rich.markup import escape

    from graphopt.cli.console import table

    t = table(f"graphopt --search under {result.budget} ({result.workers}, {result.seconds:.0f} s)",
              [("candidate", {"no_wrap": True}), "status", ("× lossless", {"justify": "right"}),
               ("final duel", {"justify": "right"}),
               ("held-back " + result.metric, {"justify": "right"}), "budget", "pareto"])
    for tr in result.trials:
        t.add_row(tr.name + (" ★" if result.chosen is tr else ""), tr.status,
                  f"{tr.speedup:.2f}" if tr.speedup is not None else "-",
                  f"{tr.duel_speedup:.2f}" if tr.duel_speedup is not None else "",
                  f"{tr.held[result.metric]:.5f}" if result.metric in tr.held else "-",
                  "meets" if tr.meets_budget else escape((tr.reason or "-")[:70]), "yes" if tr.name in result.pareto else "")
    console.print(t)
    for n in result.notes:
        console.print(f"[dim]{escape(n)}[/]", highlight=False)

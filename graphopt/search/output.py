"""The files a search writes: the chosen model, its recipe (TOML, with the command that reruns it), the JSON
report and the Pareto plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import tomli_w

from graphopt import io
from graphopt.data.metrics import METRICS, parse_budget
from graphopt.errors import VerificationError
from graphopt.search.plot import plot
from graphopt.search.results import SearchResult, _recipe_dict, chosen_speedup
from graphopt.search.trials import _from_bytes


def paths_for(out: str | os.PathLike) -> dict[str, Path]:
    """Where :func:`write` puts the model, the chosen recipe, the report and the plot."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix == ".onnx" else out
    return {"model": out, "recipe": Path(f"{stem}.search.toml"), "report": Path(f"{stem}.search.json"),
            "plot": Path(f"{stem}.pareto.png")}


def rerun_command(result: SearchResult, out: str | os.PathLike, recipe_path: str | os.PathLike,
                  calib: str | os.PathLike | None) -> str:
    budget = " ".join(f"--budget '{t}'" for t in parse_budget(result.budget).terms)
    parts = [f"graphopt optimize {result.input} -o {out} --recipe {recipe_path}"]
    if calib is not None:
        parts.append(f"--calib {calib}")
    if result.provider != "cpu":
        parts.append(f"--provider {result.provider}")
    return " ".join(parts + [budget])


def write(result: SearchResult, out: str | os.PathLike, *, report: str | os.PathLike | None = None,
          calib: str | os.PathLike | None = None, src: str | os.PathLike | None = None,
          in_place: bool = False) -> dict[str, Path]:
    """Write the chosen model, its recipe (TOML), the JSON report and the Pareto plot.

    Nothing met the budget: only the report, when ``report`` names a file, and a VerificationError (exit 3).
    """
    paths = paths_for(out)
    if report is not None:
        paths["report"] = Path(report)
    if result.chosen is None or result.chosen.model is None:  # not even the lossless model met the budget
        if report is not None:
            io.write_atomic(paths["report"], json.dumps(result.to_dict(), indent=1))
        tried = [t for t in result.trials if t.status == "ok" and t.name != "lossless"]
        closest = max(tried, key=lambda t: t.held.get(result.metric, -math.inf) * (1 if METRICS[result.metric] else -1),
                      default=None)
        detail = f"; closest: {closest.name} ({closest.reason})" if closest is not None else ""
        raise VerificationError(
            f"no candidate meets the budget {result.budget}, not even the lossless recipe's model "
            f"({len(tried)} lossy candidates measured){detail}",
            hint="nothing written, the input is unchanged; loosen --budget")
    model = _from_bytes(result.chosen.model)
    io.save(model, out, src=src, in_place=in_place)
    header = (f"# chosen by graphopt optimize --search: {result.chosen.name}, "
              f"{chosen_speedup(result.chosen):.2f}x the lossless recipe, held-back "
              + ", ".join(f"{k} {result.chosen.held[k]:.5f}" for k in sorted({t.metric for t in
                                                                              parse_budget(result.budget).terms}))
              + f"\n# rerun without searching:\n#   {rerun_command(result, out, paths['recipe'], calib)}\n")
    io.write_atomic(paths["recipe"], header + tomli_w.dumps(_recipe_dict(result.recipe)))
    d = result.to_dict()
    d["output"] = {k: str(v) for k, v in paths.items()}
    io.write_atomic(paths["report"], json.dumps(d, indent=1))
    io.write_atomic(paths["plot"], plot(result))
    return paths

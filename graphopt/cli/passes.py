"""``graphopt passes``: list the registered passes with their options."""

from __future__ import annotations

import typer

from graphopt.cli.options import Json


def command(json_: Json = False) -> None:
    """List every pass: name, lossless or lossy, one-line summary, options with defaults; then the builtin recipes."""
    import json

    from graphopt.cli.console import make_console, table
    from graphopt.engine import recipe as recipe_mod
    from graphopt.engine import registry

    passes = registry.all_passes()
    default = set(recipe_mod.default().pass_names())
    rows = [
        {
            "name": name,
            "exact": cls.exact,
            "default": name in default,
            "summary": cls.summary(),
            "options": {k: v for k, v in cls.options().items()},
            "emits": list(cls.emits),
        }
        for name, cls in passes.items()
    ]
    if json_:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    t = table("graphopt passes", [("pass", {"no_wrap": True}), ("kind", {"no_wrap": True}), "default", "summary",
                                  "options"])
    for r in rows:
        t.add_row(
            r["name"],
            "lossless" if r["exact"] else "lossy",
            "yes" if r["default"] else "",
            r["summary"],
            ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "-",
        )
    recipes = table("builtin recipes (--recipe NAME)", ["recipe", "passes", "description"])
    for name in recipe_mod.builtin_names():
        r = recipe_mod.load(name)
        recipes.add_row(name, ",".join(r.pass_names()), r.description)
    console = make_console()
    console.print(t)
    console.print(recipes)

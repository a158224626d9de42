"""Options shared by several commands, defined once so a flag means the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.runtime import session as runtime

Calib = Annotated[
    Path | None,
    typer.Option("--calib", help="Folder of .npz feeds (input name -> array), e.g. from `graphopt feeds`."),
]
Budget = Annotated[
    list[str] | None,
    typer.Option("--budget", help="Accuracy budget such as 'cosine>=0.99' (repeatable)."),
]
Provider = Annotated[
    runtime.Provider,
    typer.Option("--provider", help="Execution provider to target.", case_sensitive=False),
]
#: ``--json`` is a flag everywhere: JSON on stdout; a file goes through ``--report FILE``
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
Threads = Annotated[int, typer.Option("--threads", help="ORT intra-op threads.")]
Report = Annotated[Path | None, typer.Option("--report", help="Write the JSON report to FILE.", metavar="FILE")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No report on stdout.")]
Atol = Annotated[float, typer.Option("--atol", help="Absolute tolerance: outputs may differ by atol + rtol*|reference|.")]
Rtol = Annotated[float, typer.Option("--rtol", help="Relative tolerance (see --atol).")]
InputShape = Annotated[
    list[str] | None,
    typer.Option("--input-shape", metavar="NAME:D1,D2,...",
                 help="Shape of an input in generated feeds, e.g. images:1,3,320,320 (repeatable)."),
]
InputValue = Annotated[
    list[str] | None,
    typer.Option("--input-value", metavar="NAME=V",
                 help="Value of an input in generated feeds, e.g. sr=16000 or shape=1,3,1 (repeatable)."),
]


def feed_overrides(input_shape: list[str] | None, input_value: list[str] | None, calib: Path | None):
    """Parsed ``--input-shape`` / ``--input-value`` ({name: dims}, {name: array}); usage errors name the problem."""
    from graphopt.data import feeds
    from graphopt.errors import UsageError

    shapes, values = feeds.parse_input_shapes(input_shape), feeds.parse_input_values(input_value)
    if calib is not None and (shapes or values):
        raise UsageError("--input-shape/--input-value shape generated feeds; --calib gives the feeds",
                         hint="use one or the other")
    return shapes, values

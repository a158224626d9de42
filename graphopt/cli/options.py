"""Options shared by several commands, defined once so a flag means the same everywhere."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from graphopt.runtime import session as runtime

if TYPE_CHECKING:
    import numpy as np

Calib = Annotated[
    Path | None,
    typer.Option("--calib", help="Folder of .npz feeds (input name -> array), e.g. from `graphopt feeds`; for a "
                 "decoder budget (ppl_ratio, greedy_match) a UTF-8 text file instead."),
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


def calib_or_text(calib: Path | None) -> tuple[Path | None, Path | None]:
    """``--calib``: (feeds folder, None), or (None, text file) when it names a file (decoder budgets)."""
    if calib is not None and calib.is_file():
        return None, calib
    return calib, None


def feed_overrides(input_shape: list[str] | None, input_value: list[str] | None, calib: Path | None):
    """Parsed ``--input-shape`` / ``--input-value`` ({name: dims}, {name: array}); usage errors name the problem."""
    from graphopt.errors import UsageError

    shapes, values = parse_input_shapes(input_shape), parse_input_values(input_value)
    if calib is not None and not calib.is_file() and (shapes or values):
        raise UsageError("--input-shape/--input-value shape generated feeds; --calib gives the feeds",
                         hint="use one or the other")
    return shapes, values


def parse_input_shapes(specs: Sequence[str] | None) -> dict[str, list[int]]:
    """``--input-shape NAME:1,3,320,320`` (repeatable; brackets allowed, ``NAME:`` for a scalar) -> {name: dims}."""
    from graphopt.errors import UsageError

    out: dict[str, list[int]] = {}
    for spec in specs or ():
        name, sep, dims = str(spec).rpartition(":")
        dims = dims.strip().strip("[]").strip()
        usage = "expected NAME:D1,D2,... such as images:1,3,320,320"
        if not sep or not name:
            raise UsageError(f"--input-shape {spec!r}: no input name", hint=usage)
        try:
            shape = [int(d) for d in dims.replace("x", ",").split(",")] if dims else []
        except ValueError:
            raise UsageError(f"--input-shape {spec!r}: dims must be integers", hint=usage) from None
        if any(d < 0 for d in shape):
            raise UsageError(f"--input-shape {spec!r}: dims must be non-negative", hint=usage)
        if name in out:
            raise UsageError(f"--input-shape {name!r} given twice")
        out[name] = shape
    return out


def parse_input_values(specs: Sequence[str] | None) -> dict[str, np.ndarray]:
    """``--input-value NAME=16000`` or ``NAME=1,2,3`` (repeatable) -> {name: array} (int unless a value has a point)."""
    import numpy as np

    from graphopt.errors import UsageError

    out: dict[str, np.ndarray] = {}
    for spec in specs or ():
        name, sep, text = str(spec).partition("=")
        usage = "expected NAME=VALUE or NAME=V1,V2,... such as sr=16000"
        name, text = name.strip(), text.strip().strip("[]").strip()
        if not sep or not name or not text:
            raise UsageError(f"--input-value {spec!r}: {'no input name' if not name else 'no value'}", hint=usage)
        items = [t.strip() for t in text.split(",")]
        try:
            nums = [int(t) for t in items]
        except ValueError:
            try:
                nums = [float(t) for t in items]
            except ValueError:
                raise UsageError(f"--input-value {spec!r}: values must be numbers", hint=usage) from None
        if name in out:
            raise UsageError(f"--input-value {name!r} given twice")
        out[name] = np.array(nums[0] if len(nums) == 1 else nums)
    return out

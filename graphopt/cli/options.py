"""Options shared by several commands, defined once so a flag means the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Calib = Annotated[
    Path | None,
    typer.Option("--calib", help="Folder of .npz feeds (input name -> array), e.g. from `graphopt feeds`."),
]
Budget = Annotated[
    list[str] | None,
    typer.Option("--budget", help="Accuracy budget such as 'cosine>=0.99' (repeatable)."),
]
Provider = Annotated[str, typer.Option("--provider", help="Execution provider to target: cpu or cuda.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
Threads = Annotated[int, typer.Option("--threads", help="ORT intra-op threads.")]

"""The one place the CLI makes its rich consoles and tables, so output reads the same in a terminal and in a log.

On a terminal, rich fits output to the window as usual. Without one (a pipe, a file, CI), rich would
fold everything at 80 columns and break table headers mid-word ("verificatio / n"); here lines keep
their natural length instead: the width is ``COLUMNS`` when set, else :data:`PIPE_WIDTH`, and plain
lines (errors, warnings, notes) never wrap. Tables made by :func:`table` never split a header word or
a name column, whatever the width.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: width without a terminal when ``COLUMNS`` is not set: in effect unlimited (tables are not expanded,
#: so a line is as long as its content)
PIPE_WIDTH = 10_000
#: ``--help`` without a terminal (its panels span the whole width, so not :data:`PIPE_WIDTH`)
HELP_PIPE_WIDTH = 120


def stream_is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or exotic stream
        return False


def terminal_columns() -> int | None:
    """``COLUMNS`` as a positive int, else None."""
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return None
    return width if width > 0 else None


def make_console(stderr: bool = False, **kwargs: Any):
    """A rich ``Console`` on stdout (or stderr) that does not wrap lines when it is not a terminal."""
    from rich.console import Console

    kwargs.setdefault("highlight", False)
    if not stream_is_tty(sys.stderr if stderr else sys.stdout):
        kwargs.setdefault("width", terminal_columns() or PIPE_WIDTH)
        kwargs.setdefault("soft_wrap", True)
    return Console(stderr=stderr, **kwargs)


def table(title: str | None, columns: list[str | tuple[str, dict[str, Any]]], **kwargs: Any):
    """A rich ``Table`` whose headers never break inside a word.

    ``columns`` are header strings or ``(header, column options)``; each column is at least as wide as
    its header's longest word, and a column marked ``no_wrap=True`` (a pass or tensor name) is never
    folded. Other cells wrap at spaces on a narrow terminal; a single word longer than its column is
    folded rather than cut off. Right-aligned columns: pass ``{"justify": "right"}``.
    """
    from rich.table import Table

    kwargs.setdefault("title_justify", "left")
    t = Table(title=title, **kwargs)
    for col in columns:
        header, opts = (col, {}) if isinstance(col, str) else col
        longest_word = max((len(w) for w in header.split()), default=0)
        opts = {"min_width": longest_word, "overflow": "fold", **opts}
        t.add_column(header, **opts)
    return t

"""Atomic text output for the diff reports: temp file in the target folder, then rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from graphopt.errors import ModelSaveError


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so a reader never sees a half-written file."""
    p = Path(path)
    if p.is_dir():
        raise ModelSaveError(f"{p}: is a folder; give a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file ordinary permissions
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise ModelSaveError(f"{p}: cannot write: {e.strerror or e}") from None
    return p

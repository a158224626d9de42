"""Feeds of a lossy pass: the calibration rows and the rows held back to confirm its budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.data.feeds.folder import Feed
from graphopt.data.feeds.generated import generate


def split_feeds(feeds: Sequence[Mapping[str, np.ndarray]]) -> tuple[list, list]:
    """(calibration, held back): the first half calibrates, the rest is held back for checks.

    Fewer than two feeds cannot be split: the same feeds serve both (the same list object twice).
    """
    feeds = list(feeds)
    if len(feeds) < 2:
        return feeds, feeds
    k = len(feeds) // 2
    return feeds[:k], feeds[k:]



def calibration_feeds(model: ir.Model, calib_feeds: Sequence[Feed], held_feeds: Sequence[Feed],
                      purpose: str = "calibrating") -> tuple[list[Feed], list[Feed], str | None]:
    """The feeds a lossy pass calibrates on and the ones it confirms on (a pass's ``ctx.calib_feeds``
    and ``ctx.feeds``), each falling back to the other; generated from ``model`` when none were
    given, with a note saying so (else None)."""
    calib = list(calib_feeds) or list(held_feeds)
    held = list(held_feeds) or calib
    if calib:
        return calib, held, None
    calib = held = generate(model)
    return calib, held, f"no feeds given: {purpose} on generated feeds (give --calib for real data)"

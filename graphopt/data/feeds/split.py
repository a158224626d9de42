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


#: below these, the half of the feeds that ``optimize --calib`` holds back to check a lossy pass's budget
#: (``graphopt.data.feeds.split_feeds``) is too small for the check to mean much
MIN_FEEDS = 4
MIN_HELD_BACK_ITEMS = 64


def thin_split_warning(items: int, batch: int) -> str | None:
    """A warning when ``items`` lines in feeds of ``batch`` make too thin a held-back split, else None."""
    sizes = [min(batch, items - start) for start in range(0, items, batch)]
    calibrate, held = split_feeds(sizes)
    if len(sizes) >= MIN_FEEDS and sum(held) >= MIN_HELD_BACK_ITEMS:
        return None
    lines = max(MIN_FEEDS * batch, 2 * MIN_HELD_BACK_ITEMS)
    if held is calibrate:
        split = f"with fewer than 2 feeds the same {items} items both calibrate and check"
    else:
        split = (f"--calib calibrates on {len(calibrate)} feed(s) ({sum(calibrate)} items) and checks budgets on "
                 f"the {len(held)} held back ({sum(held)} items)")
    return (f"{items} lines make {len(sizes)} feed(s), too few for a meaningful held-back check: {split}; "
            f"use at least {lines} lines at --batch {batch} ({MIN_FEEDS}+ feeds, {MIN_HELD_BACK_ITEMS}+ items held back)")

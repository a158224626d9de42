"""Feeds: which ones a model runs on (:func:`select`), and where they come from.

A calibration folder (``folder``: ``.npz`` files, one feed each), feeds a caller gives, or feeds
generated from the input signature (``generated``) and confirmed by running the model (``probe``:
a short ladder of candidates read from the graph by ``hints``). ``split`` divides feeds into the
rows a lossy pass calibrates on and the rows held back to confirm its budget.

``optimize``, ``verify``, ``bench`` and ``diff`` all choose their feeds with :func:`select`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.data.feeds import edge
from graphopt.data.feeds.folder import Feed, check_against, describe, load_dir, save_dir
from graphopt.data.feeds.generated import check_overrides, generate
from graphopt.data.feeds.probe import NoRunnableFeeds, runnable
from graphopt.data.feeds.split import calibration_feeds, split_feeds
from graphopt.data.outputs import OutputStore
from graphopt.runtime import session as runtime_session

logger = logging.getLogger(__name__)

__all__ = [
    "Feed", "NoRunnableFeeds", "Selection", "calibration_feeds", "check_against", "check_overrides", "describe",
    "for_model", "generate", "load_dir", "runnable", "save_dir", "select", "split_feeds",
]


@dataclasses.dataclass
class Selection:
    """The feeds :func:`select` chose, where they came from, and the model's outputs on them when it ran it."""

    feeds: list[Feed]
    #: "calib" (the folder), "given" (the caller's), "generated" (confirmed by running), "none"
    source: str
    #: the model's outputs on ``feeds`` (per feed), when select ran the model; else None
    outputs: Sequence[Mapping[str, np.ndarray]] | None = None
    #: why there are no feeds although some were wanted (no generated feed runs the model); else ""
    reason: str = ""
    #: with ``edge``: the edge feeds (``graphopt.data.feeds.edge``) the model runs, their labels, its outputs on them
    edge_feeds: list[Feed] = dataclasses.field(default_factory=list)
    edge_labels: list[str] = dataclasses.field(default_factory=list)
    edge_outputs: Sequence[Mapping[str, np.ndarray]] | None = None


def select(
    model: ir.Model,
    *,
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
    calib: str | os.PathLike | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
    run: Callable[[list[Feed]], Sequence[Mapping[str, np.ndarray]]] | None = None,
    generated: bool = True,
    required: bool = True,
    check_given: bool = False,
    edge: bool = False,
    **generate_options,
) -> Selection:
    """The feeds to run ``model`` on: the ``calib`` folder's (checked against its inputs), else the
    given ``feeds`` (checked too with ``check_given``), else (with ``generated``) generated from its
    signature and confirmed by running it (``shapes`` / ``values`` fix inputs; ``generate_options`` go to
    :func:`~graphopt.data.feeds.generated.generate`); without ``generated``, none.

    ``run`` maps a list of feeds to the model's outputs (default for generated feeds: an ORT CPU
    session, ``graphopt.runtime.session.runner``); given or folder feeds are run only when it is
    passed. When no generated feed runs the model, NoRunnableFeeds is raised, or with
    ``required=False`` a selection without feeds comes back whose ``reason`` says why.

    With ``edge`` (and generated feeds), edge feeds (``graphopt.data.feeds.edge``: zeros, tiny and huge
    magnitudes, extreme ids, one-token masks, shortest and longest lengths) derived from the first feed
    are run one by one; those the model runs come in ``edge_feeds``, with their labels and outputs.
    They are for verifying lossless rewrites, never for calibrating.
    """
    check_overrides(model, shapes, values)
    if calib is not None:
        chosen, source = load_dir(calib), "calib"
        check_against(model, chosen)
    elif feeds is not None:
        chosen, source = [dict(f) for f in feeds], "given"
        if check_given:
            check_against(model, chosen)
    elif not generated:
        return Selection([], "none")
    else:
        try:
            chosen, outputs = runnable(model, run=run, shapes=shapes, values=values, **generate_options)
        except NoRunnableFeeds as e:
            if required:
                raise
            return Selection([], "none", reason=e.reason)
        sel = Selection(chosen, "generated", outputs=outputs)
        if edge and chosen:
            _add_edge_feeds(sel, model, run or runtime_session.runner(model), shapes, values)
        return sel
    return Selection(chosen, source, outputs=run(chosen) if run is not None else None)


def for_model(model: ir.Model, calib: str | os.PathLike | None = None, **generate_options) -> list[Feed]:
    """Feeds for ``model`` without running it: the ``calib`` folder's, checked against its inputs, or
    (without one) generated from its signature (``generate_options`` go to :func:`generate`)."""
    if calib is None:
        return generate(model, **generate_options)
    feeds = load_dir(calib)
    check_against(model, feeds)
    return feeds


def _add_edge_feeds(sel: Selection, model: ir.Model, run, shapes, values) -> None:
    """Run each edge candidate on ``model``; keep those it runs, with their outputs."""
    outs = OutputStore()
    for label, feed in edge.candidates(model, sel.feeds[0], shapes=shapes, values=values):
        try:
            got = run([feed])
        except Exception as e:  # noqa: BLE001 - an input the model refuses is no edge case of it
            logger.info("edge feed %r does not run the model: %s", label, getattr(e, "message", None) or e)
            continue
        sel.edge_feeds.append(feed)
        sel.edge_labels.append(label)
        outs.append(got[0])
    sel.edge_outputs = outs

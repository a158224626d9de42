"""The pipeline: run a recipe's passes in order, verify after each, keep the last good model.

For every step: clone the last good model, run the pass on the clone with a read-only
:class:`~graphopt.engine.registry.PassContext`, read what it reports from its
:class:`~graphopt.engine.registry.PassResult`, record the provenance of the nodes it created
(:mod:`graphopt.engine.provenance`), verify (structure always unless ``verify='off'``; numerics against the previous model's outputs for lossless
passes, against the input model's outputs under the budget for lossy ones).

A failed pass is rolled back and recorded. After a lossless pass the recipe goes on without it (a
warning; ``strict`` stops the run and fails it instead); after a lossy pass the run stops and fails
unless ``keep_going``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx_ir as ir

from graphopt import io, memory
from graphopt.data import feeds as feeds_mod
from graphopt.data.metrics import compare
from graphopt.engine import provenance, registry, speed_guard
from graphopt.engine import recipe as recipe_mod
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.report import PassRecord, Report
from graphopt.engine.verify import Verdict, check_level, check_structure, run_model, run_session, verify
from graphopt.errors import GraphoptError, RuntimeSetupError, UsageError, VerificationError
from graphopt.generate import chat, quality
from graphopt.opsets import count_nodes, op_delta, op_histogram
from graphopt.runtime import session_hints, standins
from graphopt.runtime.session import PROVIDERS, cuda_available, make_session

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Result:
    """The optimized model (the last good one) and the report."""

    model: ir.Model
    report: Report

    @property
    def ok(self) -> bool:
        return self.report.ok


def _slice_outputs(outs, sliced: Mapping[str, tuple[str, int, int]]):
    """Reference outputs under a pass's explicit output-contract change (``PassResult.sliced_outputs``)."""
    if not sliced or outs is None:
        return outs
    res = []
    for o in outs:
        o = dict(o)
        for new, (old, axis, pos) in sliced.items():
            a = np.asarray(o.pop(old))
            o[new] = np.take(a, [pos], axis=axis)
        res.append(o)
    return res


def _node_ids(model: ir.Model) -> provenance.Snapshot:
    """The nodes before a pass (``id(node) in`` it), for :func:`_tag_new_nodes`."""
    return provenance.snapshot(model)


def _tag_new_nodes(model: ir.Model, before: provenance.Snapshot, pass_name: str) -> int:
    """Write the provenance (pass, chain, kept names) of the nodes the pass created; see graphopt.engine.provenance."""
    return provenance.record(model, before, pass_name)


class _EdgeState:
    """The edge feeds of a run and the last good model's outputs on them (None: no longer checked)."""

    def __init__(self, feeds, labels: list[str], outputs):
        self.feeds, self.labels = list(feeds), labels
        self.outputs = outputs if self.feeds else None

    def sliced(self, sliced: Mapping[str, tuple[str, int, int]]):
        """The reference on the edge feeds under a pass's output-contract change; None when there is none."""
        if self.outputs is None:
            return None
        try:
            return _slice_outputs(self.outputs, sliced)
        except (IndexError, KeyError, ValueError):  # a position an edge feed's length lacks
            self._drop(f"their outputs cannot be sliced as {sorted(sliced)}")
            return None

    def accept(self, model: ir.Model, verdict: Verdict, *, exact: bool) -> None:
        """``model`` passed: its outputs on the edge feeds are the next reference."""
        if self.outputs is None:
            return
        if exact and verdict.edge_outputs is not None:
            self.outputs = verdict.edge_outputs
            return
        try:  # a lossy pass was checked without them: its model's outputs on them, for the passes after it
            self.outputs = run_model(model, self.feeds)
        except GraphoptError as e:
            self._drop(f"the model after a lossy pass does not run them ({e.message})")

    def _drop(self, why: str) -> None:
        logger.warning("edge feeds are no longer checked: %s", why)
        self.outputs = None


def optimize(
    model: ir.Model | str | os.PathLike,
    options: OptimizeOptions | None = None,
    *,
    on_step: Callable[[str, int, int], None] | None = None,
) -> Result:
    """Run the recipe of ``options`` (default: the builtin default recipe, ``decoder`` for a causal LM with past; see
    :meth:`~graphopt.engine.options.OptimizeOptions.resolve_recipe`) on ``model``; ``on_step(name, i, n)``
    is called before each pass.

    Returns the last good model and the report; never raises for a pass that fails verification
    (the report says; ``Result.ok`` is False when a lossy pass failed, or any pass under ``strict``).
    Raises GraphoptError for bad usage or input. A lossy pass is verified against ``budget``, or its
    own ``default_budget`` when none is given; one that cannot meet it (and so kept the model as it
    was) fails the run too, unless ``keep_going`` (then the last good model is kept and the report
    says so).
    """
    o = options if options is not None else OptimizeOptions()
    t_start = time.perf_counter()
    verify_level, provider = check_level(o.verify_level), o.provider
    if provider not in PROVIDERS:
        raise UsageError(f"unknown provider {provider!r}", hint="use " + " or ".join(PROVIDERS))
    if provider == "cuda":
        ok, why = cuda_available()
        logger.warning("passes target CUDA; verification runs on CPU%s", "" if ok else f" (no CUDA here: {why})")
    budget = o.resolve_budget()
    src = ""
    if not isinstance(model, ir.Model):
        src = str(model)
        model = io.load(model, in_place=True)  # a large self-contained file: its weights stay in it
    recipe = o.resolve_recipe(model)  # the default recipe depends on the graph (decoder with past)
    # a decoder's logits (|logit| up to ~40) differ by a few 1e-4 under any reordering of its sums (ONNX Runtime's
    # own graph optimizer on the input does): its lossless tolerance scales with the logits' magnitude
    decoder_graph = recipe_mod.is_decoder_with_past(model)
    instances = recipe.build()
    if budget and all(p.exact for p in instances):
        raise UsageError(f"--budget applies to lossy passes; this run has only lossless ones "
                         f"({', '.join(p.name for p in instances)})",
                         hint="drop --budget, or run a lossy pass too (e.g. --recipe int8)")

    report = Report(input=src, recipe=recipe.name, verify=verify_level, provider=provider, budget=str(budget))
    report.nodes_before = count_nodes(model)
    report.ops_before = dict(op_histogram(model))
    report.numerics = "verified" if verify_level == "numeric" else f"not checked (--verify {verify_level})"
    chosen = dict(feeds=o.feeds, calib=o.calib, shapes=o.input_shapes, values=o.input_values)

    # feeds (graphopt.data.feeds.select): calibration folder, given feeds, or generated from the signature
    # (confirmed by running the input model); when no generated feed runs it, numerics go unverified and
    # structure is checked
    reference = None
    ref_timing: dict[str, float] = {}  # how long the reference session took to make and run (the speed guard)
    if verify_level != "numeric":
        selection = feeds_mod.select(model, **chosen, generated=False)
    if verify_level != "off":
        with io.materialize(model) as proto:
            # one serialization for the checker and the reference session
            data = proto.SerializeToString() if not isinstance(proto, str) else None
            check_structure(proto, where=f"input model {src or ''}".strip(), serialized=data)
            if verify_level == "numeric":
                given = o.feeds is not None or o.calib is not None
                try:
                    t_sess = time.perf_counter()
                    sess = make_session(data if data is not None else proto, provider="cpu", optimize=False,
                                        prepack=data is not None)
                    ref_timing["session"] = time.perf_counter() - t_sess

                    def run_ref(fs):
                        t_run = time.perf_counter()
                        outs = run_session(sess, fs)
                        ref_timing.setdefault("run", time.perf_counter() - t_run)  # the feeds, not edge feeds
                        return outs

                    try:
                        selection = feeds_mod.select(model, **chosen, run=run_ref, required=False, edge=o.edge_feeds)
                    finally:
                        # the reference outputs are kept (spilled past a memory budget), the session
                        # is not: the candidates' sessions are built one after the other without it
                        del sess
                except RuntimeSetupError as e:
                    raise VerificationError(
                        f"cannot verify numerically: {e.message}",
                        hint="the input model does not run in ONNX Runtime"
                             + (" on the given feeds" if given else "") + "; use --verify structure or off",
                    ) from None
                reference = selection.outputs
                if selection.reason:
                    logger.warning("numerics unverified: %s; verifying structure only", selection.reason)
                    report.numerics = f"unverified: {selection.reason}"
                    verify_level = report.verify = "structure"
    memory.trim()  # the reference session is gone: give its memory back before the passes run
    decoder_check = None
    if any((b := registry.resolve_budget(p, budget)) is not None and b.decoder for p in instances):
        # decoder budgets: the input model's perplexity and greedy tokens on the calibration and held-back
        # text windows, once (graphopt.generate.quality)
        decoder_check = quality.decoder_check(make_session(model, threads=1), model_path=src or None, text=o.text,
                                              tokenizer=o.tokenizer, window=o.text_window)
        report.text = decoder_check.rows.describe()
    all_feeds = selection.feeds
    calib_feeds, check_feeds = feeds_mod.split_feeds(all_feeds)
    held_from = len(calib_feeds) if check_feeds is not calib_feeds else 0  # all_feeds[held_from:] == check_feeds
    report.feeds = feeds_mod.describe(all_feeds) if all_feeds else "none"
    # edge feeds (graphopt.data.feeds.edge) check lossless passes only; lossy ones never see them
    edge = _EdgeState(selection.edge_feeds, list(selection.edge_labels), selection.edge_outputs)
    report.edge_feeds = list(edge.labels)

    good = model
    prev_out = reference
    # the "never slower" guard (graphopt.engine.speed_guard) times the models after each modifying step
    snapshots: list[speed_guard.Snapshot] | None = None
    if speed_guard.keeps_snapshots(o.speed_check, model):
        if provider == "cpu":
            snapshots = []
        else:
            report.speed = {"checked": False, "reason": "skipped: the passes target CUDA, timing is on CPU"}
    for i, (step, p) in enumerate(zip(recipe.steps, instances)):
        if on_step:
            on_step(step.pass_name, i, len(instances))
        rec = PassRecord(name=p.name, options=p.options_in_use(), exact=p.exact)
        rec.nodes_before = count_nodes(good)
        ops_before = op_histogram(good)
        step_budget = registry.resolve_budget(p, budget)
        ctx = registry.PassContext(
            provider=provider,
            feeds=check_feeds,
            calib_feeds=calib_feeds,
            budget=step_budget,
            explain=o.explain,
            decoder=decoder_check if step_budget is not None and step_budget.decoder else None,
        )
        work = good.clone()
        before_ids = _node_ids(work)
        t0 = time.perf_counter()
        result: registry.PassResult | None = None
        try:
            result = p(work, ctx)
            rec.modified = bool(result.modified)
        except GraphoptError as e:
            rec.status, rec.error = "error", e.message
        except Exception as e:  # a bug or an unexpected graph: report it, keep the last good model
            logger.debug("pass %s raised", p.name, exc_info=True)
            rec.status, rec.error = "error", f"{type(e).__name__}: {e}"
        candidate = result.model if result is not None else None
        rec.seconds = time.perf_counter() - t0
        if result is not None:
            rec.notes = list(result.notes)
            rec.rule_counts = dict(result.rule_counts)
        if candidate is not None and rec.modified:
            if candidate is work:
                _tag_new_nodes(candidate, before_ids, p.name)
            io.unmap(good), io.unmap(candidate)  # the weights the pass read: ORT maps them again, once
            tv = time.perf_counter()
            sliced = result.sliced_outputs if result is not None else {}
            step_prev = _slice_outputs(prev_out, sliced)
            where = f"after pass {p.name!r}"
            try:
                edge_ref = edge.sliced(sliced)
                if p.exact:
                    verdict = verify(candidate, level=verify_level, feeds=all_feeds, reference=step_prev,
                                     atol=p.atol, rtol=p.rtol, provider="cpu", where=where,
                                     edge_feeds=edge.feeds if edge_ref is not None else (),
                                     edge_reference=edge_ref, edge_labels=edge.labels, scale_atol=decoder_graph)
                else:
                    # the budget is confirmed on the feeds held back from calibration
                    verdict = verify(candidate, level=verify_level, feeds=check_feeds,
                                     reference=None if reference is None else _slice_outputs(reference, sliced)[held_from:],
                                     budget=step_budget, provider="cpu", where=where, decoder=ctx.decoder)
                    if verdict.ok and verdict.outputs is not None and held_from:
                        verdict.outputs = run_model(candidate, all_feeds)  # later passes compare on every feed
            except (GraphoptError, TypeError, AttributeError, ValueError) as e:
                # a model the pass left unserializable or mistyped (a value without an element type, ...) is
                # the pass failing, never a crash of the run
                logger.debug("verifying %s raised", p.name, exc_info=True)
                msg = e.message if isinstance(e, GraphoptError) else f"{type(e).__name__}: {e}"
                verdict = Verdict(verify_level, False, reason=f"{where}: {msg}")
            memory.trim()
            rec.verification = {"level": verify_level, "seconds": round(time.perf_counter() - tv, 3),
                                **verdict.numbers()}
            if verdict.stand_ins:  # CUDA-only ops ran as standard-op stand-ins on CPU
                rec.verification["cpu_stand_ins"] = list(verdict.stand_ins)
                rec.notes.append(standins.note(verdict.stand_ins))
            if verdict.edge:
                rec.verification["edge"] = verdict.edge
            if verdict.ok:
                good = candidate
                prev_out, reference = step_prev, _slice_outputs(reference, sliced)
                if verdict.outputs is not None:
                    prev_out = verdict.outputs
                edge.accept(candidate, verdict, exact=p.exact)
                if snapshots is not None:
                    snapshots.append(speed_guard.Snapshot(i, p.name, p.exact, good))
            else:
                rec.status = "rolled-back"
                rec.verification["reason"] = verdict.reason
                rec.error = f"verification failed: {verdict.reason}"
                if o.debug_dir is not None:
                    _dump_pair(Path(o.debug_dir), i, p.name, good, candidate)
        elif candidate is not None:
            rec.verification = {"level": "skipped (unchanged)"}
        if result is not None and not p.exact and result.budget_met is False and rec.status == "ok":
            rec.status = "budget-not-met"
            rec.error = f"budget {step_budget} not met by any model {p.name!r} could make"
        if not p.exact:
            rec.verification["budget"] = str(step_budget)
        elif o.debug_dir is not None:
            _dump_pair(Path(o.debug_dir), i, p.name, good, None)
        rec.nodes_after = count_nodes(good) if rec.status == "ok" else rec.nodes_before
        if rec.status == "ok":
            rec.op_delta = op_delta(ops_before, op_histogram(good))
        report.passes.append(rec)
        if rec.status != "ok":
            blocking = o.strict or not (p.exact or o.keep_going)
            if p.exact and not o.strict:
                rec.notes.append(f"rolled back: the recipe went on without {p.name!r} (--strict fails the run instead)")
            elif o.keep_going and not o.strict:
                rec.notes.append(f"--keep-going: the model is kept as it was before {p.name!r}")
            logger.warning("pass %s %s: %s", p.name, rec.status, rec.error)
            if blocking:
                report.ok = False
                break

    if snapshots is not None and report.ok:
        estimate = (speed_guard.estimate_check(ref_timing["session"], ref_timing["run"])
                    if {"session", "run"} <= set(ref_timing) else None)
        good = _speed_check(o, recipe, model, good, snapshots, all_feeds, report, estimate)
        if report.speed.get("rolled_back") and reference is not None:
            prev_out = run_model(good, all_feeds)
    # what the model needs from its ORT session to run fast (graphopt.runtime.session_hints), in its metadata
    session_hints.record(good)
    report.nodes_after = count_nodes(good)
    report.ops_after = dict(op_histogram(good))
    if reference is not None and prev_out is not None and prev_out is not reference:

        report.final = compare(prev_out, reference, all_feeds).summary()
    report.seconds = time.perf_counter() - t_start
    return Result(good, report)


def _speed_check(o: OptimizeOptions, recipe, model: ir.Model, good: ir.Model, snapshots, feeds, report: Report,
                 estimate: float | None):
    """Run the speed guard; roll back the lossless steps it finds slower by re-running the recipe without them."""

    def rerun(start: ir.Model, first: int, skip: set[int]):
        keep = [i for i in range(first + 1, len(recipe.steps)) if i not in skip]
        if not keep:
            return start, {}
        sub = dataclasses.replace(recipe, steps=[recipe.steps[i] for i in keep])
        opts = dataclasses.replace(o, recipe=sub, passes=None, overrides=(), feeds=list(feeds), calib=None,
                                   input_shapes=None, input_values=None, speed_check="off", debug_dir=None)
        res = optimize(start, opts)
        return res.model, dict(zip(keep, res.report.passes))

    outcome = speed_guard.guard(o.speed_check, model, good, snapshots, feeds, rerun, estimate=estimate)
    report.speed = outcome.info
    for i, timing in outcome.rolled_back.items():
        rec = report.passes[i]
        rec.status = "slower"
        rec.nodes_after, rec.op_delta = rec.nodes_before, {}
        rec.notes.append(f"rolled back: {timing.speedup:.2f}x the model before it (median of {len(timing.ratios)} "
                         "interleaved rounds); the recipe was re-run without it")
    for i, rec in (outcome.rerun or {}).items():
        rec.notes.append("re-run after a slower pass was rolled back")
        report.passes[i] = rec
    return outcome.model


def optimize_file(
    model: str | os.PathLike,
    output: str | os.PathLike,
    options: OptimizeOptions | None = None,
    *,
    external_data: bool | None = None,
    in_place: bool = False,
    on_step: Callable[[str, int, int], None] | None = None,
) -> Result:
    """``graphopt optimize MODEL -o OUTPUT``: :func:`optimize` the file ``model`` and, when the run is ok,
    save the result to ``output`` (``graphopt.io.save``; ``external_data`` forces initializers into or out
    of a .data file, ``in_place`` allows ``output`` to replace ``model``).

    Before anything is loaded, the output path is checked and the run's memory is planned against
    ``options.max_memory`` (``graphopt.memory.plan``: stream the weights, or stop with UsageError).
    """
    o = options if options is not None else OptimizeOptions()
    io.check_output_path(model, output, in_place=in_place)
    if Path(model).is_file():
        memory.plan(model, o.verify_level, o.memory_limit())
    result = optimize(model, o, on_step=on_step)
    if result.ok:
        io.save(result.model, output, external_data=external_data, src=model, in_place=in_place)
        result.report.output = str(output)
        if recipe_mod.is_decoder_with_past(result.model):  # generate and serve read them beside the model
            result.report.companions = chat.copy_companions(Path(model).parent, Path(output).parent)
    return result


def _dump_pair(folder: Path, index: int, name: str, before: ir.Model, after: ir.Model | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / f"{index:02d}-{name}"
    try:
        io.save(before, f"{base}.before.onnx")
        if after is not None:
            io.save(after, f"{base}.after.onnx")
        logger.warning("wrote %s.before.onnx / .after.onnx", base)
    except GraphoptError as e:
        logger.warning("could not write the debug pair for %s: %s", name, e.message)

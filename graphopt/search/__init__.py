"""Budgeted optimization: search the lossy passes' settings for the fastest model within a budget.

``graphopt optimize IN -o OUT --calib DIR --budget 'cosine>=0.99' --search`` runs this module::

    input ──lossless recipe (once)──▶ base ──┬─ candidate: quantize (the int8 recipe) ──────────┐
                                             ├─ candidate: quantize mode=dynamic               │ each one: quality on the
                                             ├─ candidate: prune-heads ─▶ quantize             ├ calibration and held-back
                                             ├─ candidate: sparsify neurons ─▶ quantize         │ feeds, speed interleaved
                                             └─ ... (early-exit on classifiers, fp16 on CUDA)  ┘ with the base and the best

1. The lossless recipe (``default`` for the provider) runs once, through the pipeline, verified; it is
   the base every candidate starts from and the speed reference (1.0x).
2. Candidates are chains of lossy steps (``recipe.Step``: a pass and its options) on top of a base.
   Stage 1 tries each lossy pass alone; stage 2 tries combinations whose first pass fitted the budget
   alone (prune-heads or sparsify, then quantize). Each step runs through ``pipeline.optimize`` with
   the same feeds and budget a rerun of the written recipe gives it, so the recipe reproduces the model.
   Every step's result is cached on disk keyed by its base and settings (a chain reuses its prefix).
3. A trial measures the candidate's outputs against the *input* model's reference outputs on the
   calibration feeds and on the held-back feeds (``feeds.split_feeds``, as the pipeline splits them),
   and its speed with ``graphopt.bench.bench_sessions``: the base, the current best and the candidate
   in one process, round-robin, on the calibration feeds (the workload's real lengths), one thread,
   spinning off. Speed ratios are only ever taken between models timed in that one process.
4. The fastest candidates that meet the budget on the held-back feeds (at most :data:`FINAL_DUEL`) are
   timed against each other and the lossless model once more, interleaved in one process; the fastest
   is chosen. The lossless model is a candidate too: it wins where no lossy one within budget is faster
   (or none meets the budget).

Trials run in ``workers`` spawned processes (``concurrent.futures``; default one, so that a trial past the
time limit can be stopped; 0: in this process), or as tasks on a Ray cluster (``ray_address``; the
``graphopt[ray]`` extra).
The search stops submitting trials when ``time_limit`` is spent (running ones are stopped); Ctrl-C keeps
the best so far (``SearchResult.interrupted``). A budget nothing meets, not even the lossless model, is a
``VerificationError`` from :func:`write` (exit 3): nothing is written.

This module holds the search loop (:func:`search`) and the final duel; the rest of the package, one concept
each: ``candidates`` (the plan), ``trials`` (one trial: cached build, quality, speed), ``runner`` (in this
process, worker processes or Ray), ``results`` (:class:`SearchResult`, the Pareto front, the JSON form),
``output`` (the files :func:`write` writes) and ``plot`` (the Pareto plot).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from graphopt import io
from graphopt.bench import bench_sessions
from graphopt.data import feeds as feeds_mod
from graphopt.data.metrics import DEFAULT_BUDGET, Budget, compare, parse_budget
from graphopt.engine import pipeline
from graphopt.engine import recipe as recipe_mod
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model
from graphopt.errors import UsageError, VerificationError
from graphopt.runtime import session as runtime
from graphopt.search.candidates import FAMILIES, Candidate, _is_classifier, plan
from graphopt.search.output import paths_for, rerun_command, write
from graphopt.search.plot import check_plot_support
from graphopt.search.results import SearchResult, chosen_speedup, pareto_front
from graphopt.search.runner import _ray_module, _Runner
from graphopt.search.trials import Trial, _bench, _cache_dir, _Shared, _to_bytes, run_trial

__all__ = [
    "DEFAULT_BUDGET", "FAMILIES", "FINAL_DUEL", "RESERVE", "Candidate", "SearchResult", "Trial", "check_plot_support",
    "chosen_speedup", "pareto_front", "parse_duration", "paths_for", "plan", "rerun_command", "run_trial", "search",
    "write",
]

#: how many of the fastest candidates within budget are timed against each other at the end
FINAL_DUEL = 3
#: share of the time limit kept for the final duel and writing
RESERVE = 0.1


def parse_duration(text: str | float | int | None) -> float:
    """``'10m'``, ``'90s'``, ``'1h'``, ``'1h30m'`` or a number of seconds -> seconds."""
    if text is None:
        return 600.0
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lower()
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", s)
    if not s or parts is None or not any(parts.groups()):
        raise UsageError(f"malformed --time-limit {text!r}", hint="e.g. 10m, 90s, 1h30m or a number of seconds")
    h, m, sec = (float(g) if g else 0.0 for g in parts.groups())
    return h * 3600 + m * 60 + sec


def search(
    model: str | os.PathLike,
    *,
    calib: str | os.PathLike | None = None,
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
    budget: Budget | str | Sequence[str] | None = None,
    provider: str = "cpu",
    time_limit: float | str = 600.0,
    workers: int = 1,
    ray_address: str | None = None,
    families: Sequence[str] | None = None,
    rounds: int = 5,
    on_event: Callable[[str, dict], None] | None = None,
) -> SearchResult:
    """Search the lossy passes' settings for the fastest model of ``model`` that meets ``budget``.

    ``on_event(kind, info)`` is called with ``("base", {...})``, ``("planned", {"total": n})``,
    ``("started", {"name"})``, ``("trial", {"trial", "best"})`` and ``("duel", {...})`` for progress.
    Returns a :class:`SearchResult` (``chosen`` None when no candidate met the budget); raises
    GraphoptError for bad usage or input. Ctrl-C during the trials ends them and returns the best so far.
    """
    t_start = time.perf_counter()
    limit = parse_duration(time_limit)
    emit = on_event or (lambda kind, info: None)
    families = list(families or FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UsageError(f"--search-passes: {unknown[0]!r} is not a lossy pass the search knows",
                         hint="choose from " + ", ".join(FAMILIES))
    if workers < 0:
        raise UsageError(f"--workers must be >= 0 (0: trials in this process), got {workers}")
    if ray_address:
        _ray_module()
    budget = budget if isinstance(budget, Budget) else parse_budget(budget)
    notes: list[str] = []
    if not budget:
        budget = parse_budget(DEFAULT_BUDGET)
        notes.append(f"no budget given: searching under {DEFAULT_BUDGET}")
    metric = budget.terms[0].metric
    src = str(model)
    original = io.load(model)
    all_feeds = [dict(f) for f in feeds] if feeds is not None else feeds_mod.for_model(original, calib)
    if len(all_feeds) < 2:
        raise UsageError(f"--search needs at least 2 feeds (got {len(all_feeds)}): half calibrate, half are held back",
                         hint="give --calib a folder with more .npz feeds")
    refs = [dict(o) for o in run_model(original, all_feeds)]

    # the lossless bases, once
    bases: dict[str, bytes] = {}
    base_recipes: dict[str, recipe_mod.Recipe] = {}
    lossless = recipe_mod.default(provider)
    wanted = {"default": lossless}
    classifier = _is_classifier(original)
    if "early-exit" in families and classifier:
        wanted["no-padding-removal"] = recipe_mod.Recipe(
            "default-no-padding-removal", [s for s in lossless.steps if s.pass_name != "remove-padding"])
    base_trial = Trial("lossless", "default", [], status="reference", speedup=1.0)
    for name, rec in wanted.items():
        t0 = time.perf_counter()
        res = pipeline.optimize(original.clone(), OptimizeOptions(
            recipe=dataclasses.replace(rec, steps=list(rec.steps)), feeds=all_feeds, provider=provider))
        if not res.ok:
            failed = res.report.failed()[-1]
            raise VerificationError(f"the lossless recipe failed on {src}: pass {failed.name!r}: {failed.error}")
        bases[name], base_recipes[name] = _to_bytes(res.model), rec
        emit("base", {"name": name, "seconds": time.perf_counter() - t0})
        if name == "default":
            calib_part, held = feeds_mod.split_feeds(all_feeds)
            k = len(calib_part) if held is not calib_part else 0
            outs = list(run_model(res.model, all_feeds))
            c_cal = compare(outs[: len(calib_part)], refs[: len(calib_part)], calib_part)
            c_held = compare(outs[k:], refs[k:], held)
            base_trial.calib, base_trial.held = c_cal.summary(), c_held.summary()
            base_trial.meets_calib = not budget.failures(c_cal)
            base_trial.meets_budget = base_trial.meets_calib and not budget.failures(c_held)
            base_trial.seconds = round(time.perf_counter() - t0, 2)

    cands, plan_notes = plan(families, provider, classifier)
    notes += plan_notes
    emit("planned", {"total": len(cands), "bases": list(bases)})
    shared = _Shared(session=f"{os.getpid()}-{int(time.time() * 1000)}", bases=bases, feeds=all_feeds, refs=refs, budget=str(budget), provider=provider, rounds=rounds)
    runner = _Runner(shared, workers, ray_address)
    trials: dict[str, Trial] = {}
    best: Trial | None = None
    deadline = t_start + limit * (1 - RESERVE)
    pending = collections.deque(c for c in cands if c.stage == 1)
    later = collections.deque(c for c in cands if c.stage == 2)
    in_flight: dict[concurrent.futures.Future, Candidate] = {}
    interrupted = timed_out = False

    built: dict[str, str] = {}  # model digest -> first candidate that built it

    def take(trial: Trial) -> None:
        nonlocal best
        if trial.digest:
            trial.same_as = built.setdefault(trial.digest, trial.name)
            trial.same_as = "" if trial.same_as == trial.name else trial.same_as
        trial.model = trial.model if trial.meets_budget and not trial.same_as else None
        trials[trial.name] = trial
        if trial.status == "ok" and trial.meets_budget and not trial.same_as:
            if best is None:
                best = trial
            elif trial.best_at_submit == best.name and trial.vs_best is not None:
                if trial.vs_best > 1.0:  # timed against the best itself, in one process
                    best = trial
            elif (trial.speedup or 0) > (best.speedup or 0):  # the best changed meanwhile: ratios to the base
                best = trial
        emit("trial", {"trial": trial, "best": best})

    try:
        while pending or later or in_flight:
            if not pending and not in_flight and later:
                pending.extend(later)
                later.clear()
            while pending and len(in_flight) < runner.capacity and time.perf_counter() < deadline:
                cand = pending.popleft()
                need = trials.get(cand.needs) if cand.needs else None
                if cand.needs and (need is None or not need.meets_budget):
                    why = need.reason if need is not None else "not tried"
                    take(Trial(cand.name, cand.base, cand.settings(), status="skipped",
                               reason=f"{cand.needs!r} alone did not meet the budget ({why})"))
                    continue
                emit("started", {"name": cand.name})
                inc = (best.name, best.model) if best is not None and best.model is not None else None
                in_flight[runner.submit(cand, inc)] = cand
            if not in_flight:
                if time.perf_counter() >= deadline:
                    timed_out = bool(pending or later)
                    break
                continue
            done, _ = concurrent.futures.wait(list(in_flight), timeout=max(0.0, deadline - time.perf_counter()),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:
                timed_out = True
                break
            for fut in done:
                cand = in_flight.pop(fut)
                try:
                    take(fut.result())
                except Exception as e:  # a worker died
                    take(Trial(cand.name, cand.base, cand.settings(), status="error",
                               reason=f"worker failed: {type(e).__name__}: {e}"))
            if time.perf_counter() >= deadline and (pending or later or in_flight):
                timed_out = True
                break
    except KeyboardInterrupt:
        interrupted = True
        notes.append("interrupted (Ctrl-C): kept the best candidate so far")
    finally:
        runner.stop()
        shutil.rmtree(_cache_dir(shared), ignore_errors=True)
    for c in list(in_flight.values()) + list(pending) + list(later):
        if c.name not in trials:
            why = "interrupted" if interrupted else "time limit"
            trials[c.name] = Trial(c.name, c.base, c.settings(), status="stopped", reason=why)
    if timed_out:
        notes.append(f"time limit {limit:g}s reached: {sum(t.status == 'stopped' for t in trials.values())} "
                     "candidates not measured")

    ordered = [base_trial] + [trials[c.name] for c in cands if c.name in trials]
    feasible = sorted((t for t in ordered if t.status == "ok" and t.meets_budget and t.model is not None
                       and not t.same_as),  # a model built twice is timed once
                      key=lambda t: -(t.speedup or 0))
    # the lossless model is a candidate too: it meets any budget its verification meets, at 1.0x
    if base_trial.meets_budget:
        base_trial.model = bases["default"]
    duel: list[dict] = []
    if feasible and not interrupted:
        chosen, duel = _duel(feasible[:FINAL_DUEL], base_trial, shared, emit)
    else:  # interrupted: no more timing, the trials' own ratios to the lossless model decide
        pool = feasible + ([base_trial] if base_trial.model is not None else [])
        chosen = max(pool, key=lambda t: t.speedup or 0.0, default=None)
    if chosen is base_trial:
        notes.append("no lossy candidate within the budget was faster than the lossless recipe: chose the lossless model"
                     if feasible else "no lossy candidate met the budget: chose the lossless recipe's model")
    recipe = None
    if chosen is not None:
        rec = base_recipes[chosen.base]
        recipe = recipe_mod.Recipe(f"search-{chosen.name}", [*rec.steps, *(recipe_mod.Step(s["pass"], s["options"])
                                                                            for s in chosen.steps)],
                                   f"chosen by graphopt optimize --search under {budget}: {chosen.name}")
    return SearchResult(
        input=src, budget=str(budget), provider=provider, trials=ordered, chosen=chosen, recipe=recipe,
        pareto=pareto_front(ordered, metric), metric=metric, seconds=time.perf_counter() - t_start,
        time_limit=limit, workers=runner.kind, interrupted=interrupted, timed_out=timed_out, duel=duel, notes=notes)


def _duel(trials: list[Trial], lossless: Trial, shared: _Shared, emit) -> tuple[Trial, list[dict]]:
    """Time the fastest candidates within budget and the lossless model against each other, interleaved in
    this one process; the fastest wins (the lossless model only when it meets the budget)."""

    calib, _ = feeds_mod.split_feeds(shared.feeds)
    models = {lossless.name: shared.bases["default"], **{t.name: t.model for t in trials}}
    res = _bench(models, calib, shared.provider, max(shared.rounds, 2 * shared.rounds), runtime, bench_sessions)
    base = next(r for r in res if r.name == lossless.name)
    rows = [{"name": r.name, "p50_ms": 1e3 * r.p50, "speedup": base.p50 / r.p50} for r in res]
    entrants = trials + ([lossless] if lossless.model is not None else [])
    for t in entrants:
        t.duel_speedup = next(row["speedup"] for row in rows if row["name"] == t.name)
    emit("duel", {"rows": rows})
    return max(entrants, key=lambda t: t.duel_speedup), rows

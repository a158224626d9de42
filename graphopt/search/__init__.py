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
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import io as _io
import json
import logging
import math
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from graphopt import io
from graphopt.data import feeds as feeds_mod
from graphopt.data.metrics import DEFAULT_BUDGET, METRICS, Budget, compare, parse_budget
from graphopt.engine import recipe as recipe_mod
from graphopt.errors import GraphoptError, UsageError, VerificationError

logger = logging.getLogger(__name__)

#: lossy pass families the search knows
FAMILIES = ("quantize", "prune-heads", "sparsify", "early-exit", "convert-precision")
#: how many of the fastest candidates within budget are timed against each other at the end
FINAL_DUEL = 3
#: share of the time limit kept for the final duel and writing
RESERVE = 0.1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Lossy steps on top of a base (a lossless recipe's output)."""

    name: str
    base: str
    steps: tuple[recipe_mod.Step, ...]
    stage: int = 1
    #: stage 2: only tried when this stage-1 candidate met the budget
    needs: str = ""

    def settings(self) -> list[dict]:
        return [{"pass": s.pass_name, "options": dict(s.options)} for s in self.steps]


@dataclasses.dataclass
class Trial:
    """What one candidate measured (everything the report says about it)."""

    name: str
    base: str
    steps: list[dict]
    #: ok (built and measured), declined (a pass could not meet the budget or changed nothing), error,
    #: stopped (time limit / interrupted), skipped (its stage-1 prerequisite did not fit), reference
    status: str = "ok"
    reason: str = ""
    calib: dict[str, float] = dataclasses.field(default_factory=dict)
    held: dict[str, float] = dataclasses.field(default_factory=dict)
    meets_calib: bool = False
    meets_budget: bool = False
    #: base p50 / candidate p50, both timed in the trial's process (> 1: faster than the lossless model)
    speedup: float | None = None
    #: the best candidate at submission time, timed in the same process (None: there was none)
    vs_best: float | None = None
    #: the final duel's speed vs the lossless recipe (the fastest candidates within budget, one process)
    duel_speedup: float | None = None
    #: an earlier candidate that built the very same model (its bytes), if any
    same_as: str = ""
    best_at_submit: str = ""
    worker: str = ""
    seconds: float = 0.0
    cached_steps: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    #: sha256 of the serialized model
    digest: str = ""
    #: the serialized model (feasible candidates only; not in the report)
    model: bytes | None = dataclasses.field(default=None, repr=False)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("model")
        return d


@dataclasses.dataclass
class _Shared:
    """What every trial needs, sent once per worker process (or put once in Ray's object store)."""

    session: str
    bases: dict[str, bytes]
    feeds: list[dict[str, np.ndarray]]
    refs: list[dict[str, np.ndarray]]
    budget: str
    provider: str
    rounds: int


@dataclasses.dataclass
class SearchResult:
    """The chosen candidate (None: nothing met the budget), every trial, the Pareto front."""

    input: str
    budget: str
    provider: str
    trials: list[Trial]
    chosen: Trial | None
    recipe: recipe_mod.Recipe | None
    pareto: list[str]
    metric: str
    seconds: float
    time_limit: float
    workers: str
    interrupted: bool = False
    timed_out: bool = False
    duel: list[dict] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        from graphopt.engine.report import json_safe

        return json_safe({
            "input": self.input, "budget": self.budget, "provider": self.provider, "metric": self.metric,
            "seconds": round(self.seconds, 1), "time_limit": self.time_limit, "workers": self.workers,
            "interrupted": self.interrupted, "timed_out": self.timed_out,
            "chosen": self.chosen.name if self.chosen else None,
            "recipe": _recipe_dict(self.recipe) if self.recipe else None,
            "pareto": [self._point(t) for t in self.trials if t.name in self.pareto],
            "pareto_by_metric": {m: pareto_front(self.trials, m)
                                 for m in dict.fromkeys(t.metric for t in parse_budget(self.budget).terms)},
            "final_duel": self.duel, "notes": self.notes,
            "candidates": [t.as_dict() for t in self.trials],
        })

    def _point(self, t: Trial) -> dict:
        return {"name": t.name, "speedup": t.speedup, self.metric: t.held.get(self.metric),
                "meets_budget": t.meets_budget}


# ----------------------------------------------------------------------------------- candidates


def _step(name: str, **options: Any) -> recipe_mod.Step:
    return recipe_mod.Step(name, dict(options))


def plan(families: Sequence[str], provider: str, classifier: bool) -> tuple[list[Candidate], list[str]]:
    """The candidates, stage 1 first, cheapest and likeliest first; and notes on what was left out."""
    fam = set(families)
    q, ph, sp = "quantize", "prune-heads", "sparsify"
    c: list[Candidate] = []
    notes: list[str] = []
    if q in fam:
        c += [Candidate("int8", "default", (_step(q),)),  # the `int8` recipe
              Candidate("int8-dynamic", "default", (_step(q, mode="dynamic"),)),
              # every layer int8, no search for float layers: the fastest int8 form, if the budget allows
              Candidate("int8-static-all", "default", (_step(q, mode="static", mixed=False),))]
    if ph in fam:
        c.append(Candidate("prune-heads", "default", (_step(ph),)))
    if sp in fam:
        c.append(Candidate("sparsify-neurons", "default", (_step(sp, pattern="neurons"),)))
    if "early-exit" in fam:
        if classifier:
            c.append(Candidate("early-exit", "no-padding-removal", (_step("early-exit"),)))
        else:
            notes.append("early-exit: not tried (the model's output is not class logits [batch, classes])")
    if "convert-precision" in fam:
        if provider == "cuda":
            c.append(Candidate("fp16", "default", (_step("convert-precision", precision="fp16"),)))
        else:
            notes.append("convert-precision: not tried on cpu (ONNX Runtime's CPU provider runs fp16 ops "
                         "through casts to fp32: never faster)")
    if q in fam:
        if ph in fam:
            c += [Candidate(f"prune-heads-{int(s * 100)}+int8", "default",
                            (_step(ph, budget_share=s), _step(q)), stage=2, needs="prune-heads")
                  for s in (0.5, 0.25)]
        if sp in fam:
            c += [Candidate(f"neurons-{int(s * 1000) / 10:g}%+int8", "default",
                            (_step(sp, pattern="neurons", sparsity=s), _step(q)), stage=2, needs="sparsify-neurons")
                  for s in (0.125, 0.25)]
        if "early-exit" in fam and classifier:
            c.append(Candidate("int8+early-exit", "no-padding-removal", (_step(q), _step("early-exit")),
                               stage=2, needs="early-exit"))
        if provider == "cpu":  # measured slower than int8 on MiniLM (docs/benchmarks.md): last
            c.append(Candidate("int4-rtn", "default", (_step(q, mode="int4", int4_method="rtn"),), stage=2))
    return c, notes


def _is_classifier(model: ir.Model) -> bool:
    outs = model.graph.outputs
    return len(outs) == 1 and outs[0].shape is not None and len(outs[0].shape) == 2


# ----------------------------------------------------------------------------------- the trial (a worker)

_WORKER: dict[str, Any] = {}


def _init_worker(shared: _Shared) -> None:
    logging.basicConfig(level=logging.WARNING)
    _WORKER["shared"] = shared


def _pool_trial(cand: Candidate, incumbent: tuple[str, bytes] | None) -> Trial:
    return run_trial(_WORKER["shared"], cand, incumbent)


def _cache_dir(shared: _Shared) -> Path:
    d = Path(tempfile.gettempdir()) / f"graphopt-search-{shared.session}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _from_bytes(data: bytes) -> ir.Model:
    import onnx

    return ir.from_proto(onnx.load_model_from_string(data))


def _to_bytes(model: ir.Model) -> bytes:
    return io.to_proto(model).SerializeToString()


def _build(shared: _Shared, cand: Candidate, trial: Trial) -> ir.Model | None:
    """The candidate's model: each step through the pipeline (cached by its base and settings); None when a
    step declined (the trial says why)."""
    from graphopt.engine import pipeline

    cache = _cache_dir(shared)
    model = None
    for i, step in enumerate(cand.steps):
        key = _key(cand.base, [(s.pass_name, s.options) for s in cand.steps[: i + 1]])
        done, failed = cache / f"{key}.onnx", cache / f"{key}.declined.json"
        if failed.exists():
            info = json.loads(failed.read_text())
            trial.status, trial.reason, trial.notes = "declined", info["reason"], info["notes"]
            trial.cached_steps += 1
            return None
        if done.exists():
            model = io.load(done)
            trial.cached_steps += 1
            continue
        if model is None:
            model = _from_bytes(shared.bases[cand.base])
        res = pipeline.optimize(model, recipe_mod.Recipe("search-step", [step]), feeds=shared.feeds,
                                budget=shared.budget, provider=shared.provider, verify_level="structure")
        rec = res.report.passes[-1]
        notes = [f"{rec.name}: {n}" for n in rec.notes]
        trial.notes += notes
        if not res.ok or not rec.modified:
            reason = rec.error or f"{rec.name} changed nothing"
            io.write_atomic(failed, json.dumps({"reason": reason, "notes": trial.notes}))
            trial.status, trial.reason = "declined", reason
            return None
        model = res.model
        io.save(model, done)
    return model


def run_trial(shared: _Shared, cand: Candidate, incumbent: tuple[str, bytes] | None) -> Trial:
    """Build one candidate, measure its quality and its speed (interleaved with the base and the incumbent)."""
    from graphopt.bench import bench_sessions
    from graphopt.engine.verify import run_model
    from graphopt.runtime import session as runtime

    t0 = time.perf_counter()
    trial = Trial(cand.name, cand.base, cand.settings(), worker=f"{socket.gethostname()}:{os.getpid()}",
                  best_at_submit=incumbent[0] if incumbent else "")
    try:
        model = _build(shared, cand, trial)
        if model is None:
            return trial
        budget = parse_budget(shared.budget)
        calib, held = feeds_mod.split_feeds(shared.feeds)
        k = len(calib) if held is not calib else 0
        outs = list(run_model(model, shared.feeds))
        c_cal = compare(outs[: len(calib)], shared.refs[: len(calib)], calib)
        c_held = compare(outs[k:], shared.refs[k:], held)
        trial.calib, trial.held = c_cal.summary(), c_held.summary()
        trial.meets_calib = not budget.failures(c_cal)
        trial.meets_budget = trial.meets_calib and not budget.failures(c_held)
        if not trial.meets_budget:
            trial.reason = "; ".join(budget.failures(c_cal) and [f"calibration: {f}" for f in budget.failures(c_cal)]
                                     or [f"held-back: {f}" for f in budget.failures(c_held)])
        data = _to_bytes(model)
        trial.digest = hashlib.sha256(data).hexdigest()
        models = {"base": shared.bases["default"], "candidate": data}
        if incumbent is not None:
            models["best"] = incumbent[1]
        res = {r.name: r for r in _bench(models, calib, shared.provider, shared.rounds, runtime, bench_sessions)}
        trial.speedup = res["base"].p50 / res["candidate"].p50
        if "best" in res:
            trial.vs_best = res["best"].p50 / res["candidate"].p50
        if trial.meets_budget:
            trial.model = data
    except GraphoptError as e:
        trial.status, trial.reason = "error", e.message
    except Exception as e:  # a bug or an unexpected graph: the search goes on without this candidate
        logger.debug("trial %s raised", cand.name, exc_info=True)
        trial.status, trial.reason = "error", f"{type(e).__name__}: {e}"
    finally:
        trial.seconds = round(time.perf_counter() - t0, 2)
    return trial


def _bench(models: Mapping[str, bytes], feeds, provider: str, rounds: int, runtime, bench_sessions):
    cuda = provider == "cuda" and runtime.cuda_available()[0]
    sessions = {n: runtime.make_session(m, provider="cuda" if cuda else "cpu", threads=1, optimize=True,
                                        spinning=False) for n, m in models.items()}
    return bench_sessions(sessions, feeds, rounds=rounds, warmup=1, clock="wall" if cuda else "cpu",
                          device="cuda" if cuda else None)


# ----------------------------------------------------------------------------------- running trials


def _ray_module():
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray, which is not installed", hint="pip install 'graphopt[ray]'") from None
    return ray


class _Runner:
    """Submits trials: in this process, to spawned worker processes, or to a Ray cluster."""

    def __init__(self, shared: _Shared, workers: int, ray_address: str | None):
        self.shared, self.kind, self._ray_started = shared, "inline", False
        self.capacity = 1  # workers == 0: in this process, one at a time
        self._pool = None
        self._inc_cache: tuple[str, Any] | None = None
        if ray_address:
            ray = _ray_module()
            if not ray.is_initialized():
                ray.init(address=None if ray_address == "local" else ray_address, include_dashboard=False,
                         log_to_driver=False)
                self._ray_started = True
            self._ray = ray
            self._remote = ray.remote(num_cpus=1)(run_trial)
            self._shared_ref = ray.put(shared)
            cpus = int(ray.cluster_resources().get("CPU", 1))
            self.capacity = max(1, workers if workers > 1 else cpus)
            self.kind = f"ray ({ray_address}, {cpus} CPUs)"
        elif workers >= 1:  # even one: a trial past the time limit (or Ctrl-C) can then be stopped
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(shared,))
            self.capacity = workers
            self.kind = f"{workers} process{'es' if workers > 1 else ''}"

    def submit(self, cand: Candidate, incumbent: tuple[str, bytes] | None) -> concurrent.futures.Future:
        if self.kind.startswith("ray"):
            inc = incumbent
            if incumbent is not None:  # one copy of the incumbent in the object store
                if self._inc_cache is None or self._inc_cache[0] != incumbent[0]:
                    self._inc_cache = (incumbent[0], self._ray.put(incumbent))
                inc = self._inc_cache[1]
            return self._remote.remote(self._shared_ref, cand, inc).future()
        if self._pool is not None:
            return self._pool.submit(_pool_trial, cand, incumbent)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(run_trial(self.shared, cand, incumbent))
        return fut

    def stop(self) -> None:
        """Stop everything still running (time limit, Ctrl-C, or done)."""
        if self._pool is not None:
            procs = list(getattr(self._pool, "_processes", {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:  # running trials are abandoned: their processes are ended, ours only
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
            self._pool = None
        if self.kind.startswith("ray") and self._ray_started:
            self._ray.shutdown()
            self._ray_started = False


# ----------------------------------------------------------------------------------- the search


def parse_duration(text: str | float | int | None) -> float:
    """``'10m'``, ``'90s'``, ``'1h'``, ``'1h30m'`` or a number of seconds -> seconds."""
    import re

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
    from graphopt.engine import pipeline
    from graphopt.engine.verify import run_model

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
        res = pipeline.optimize(original.clone(), dataclasses.replace(rec, steps=list(rec.steps)),
                                feeds=all_feeds, provider=provider)
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
    from graphopt.bench import bench_sessions
    from graphopt.runtime import session as runtime

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


def pareto_front(trials: Sequence[Trial], metric: str) -> list[str]:
    """Names of the trials no other trial beats on both speed and held-back ``metric`` (the better way)."""
    up = METRICS[metric]
    pts = [(t.name, t.speedup, t.held.get(metric) if up else -t.held.get(metric))
           for t in trials if t.speedup is not None and t.held.get(metric) is not None
           and math.isfinite(t.held[metric])]
    front = []
    for name, s, q in pts:
        if not any((s2 >= s and q2 >= q) and (s2 > s or q2 > q) for _, s2, q2 in pts):
            front.append(name)
    return front


# ----------------------------------------------------------------------------------- outputs


def _recipe_dict(recipe: recipe_mod.Recipe) -> dict:
    steps = []
    for s in recipe.steps:
        d: dict[str, Any] = {"pass": s.pass_name}
        if s.options:
            d["options"] = dict(s.options)
        steps.append(d)
    return {"name": recipe.name, "description": recipe.description, "step": steps}


def paths_for(out: str | os.PathLike) -> dict[str, Path]:
    """Where :func:`write` puts the model, the chosen recipe, the report and the plot."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix == ".onnx" else out
    return {"model": out, "recipe": Path(f"{stem}.search.toml"), "report": Path(f"{stem}.search.json"),
            "plot": Path(f"{stem}.pareto.png")}


def check_plot_support() -> None:
    """The Pareto plot needs matplotlib (the ``graphopt[plot]`` extra): a one-line error before searching."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--search draws the Pareto front with matplotlib, which is not installed",
                         hint="pip install 'graphopt[plot]'") from None


def rerun_command(result: SearchResult, out: str | os.PathLike, recipe_path: str | os.PathLike,
                  calib: str | os.PathLike | None) -> str:
    budget = " ".join(f"--budget '{t}'" for t in parse_budget(result.budget).terms)
    parts = [f"graphopt optimize {result.input} -o {out} --recipe {recipe_path}"]
    if calib is not None:
        parts.append(f"--calib {calib}")
    if result.provider != "cpu":
        parts.append(f"--provider {result.provider}")
    return " ".join(parts + [budget])


def write(result: SearchResult, out: str | os.PathLike, *, report: str | os.PathLike | None = None,
          calib: str | os.PathLike | None = None, src: str | os.PathLike | None = None,
          in_place: bool = False) -> dict[str, Path]:
    """Write the chosen model, its recipe (TOML), the JSON report and the Pareto plot.

    Nothing met the budget: only the report, when ``report`` names a file, and a VerificationError (exit 3).
    """
    import tomli_w

    paths = paths_for(out)
    if report is not None:
        paths["report"] = Path(report)
    if result.chosen is None or result.chosen.model is None:  # not even the lossless model met the budget
        if report is not None:
            io.write_atomic(paths["report"], json.dumps(result.to_dict(), indent=1))
        tried = [t for t in result.trials if t.status == "ok" and t.name != "lossless"]
        closest = max(tried, key=lambda t: t.held.get(result.metric, -math.inf) * (1 if METRICS[result.metric] else -1),
                      default=None)
        detail = f"; closest: {closest.name} ({closest.reason})" if closest is not None else ""
        raise VerificationError(
            f"no candidate meets the budget {result.budget}, not even the lossless recipe's model "
            f"({len(tried)} lossy candidates measured){detail}",
            hint="nothing written, the input is unchanged; loosen --budget")
    model = _from_bytes(result.chosen.model)
    io.save(model, out, src=src, in_place=in_place)
    header = (f"# chosen by graphopt optimize --search: {result.chosen.name}, "
              f"{chosen_speedup(result.chosen):.2f}x the lossless recipe, held-back "
              + ", ".join(f"{k} {result.chosen.held[k]:.5f}" for k in sorted({t.metric for t in
                                                                              parse_budget(result.budget).terms}))
              + f"\n# rerun without searching:\n#   {rerun_command(result, out, paths['recipe'], calib)}\n")
    io.write_atomic(paths["recipe"], header + tomli_w.dumps(_recipe_dict(result.recipe)))
    d = result.to_dict()
    d["output"] = {k: str(v) for k, v in paths.items()}
    io.write_atomic(paths["report"], json.dumps(d, indent=1))
    io.write_atomic(paths["plot"], plot(result))
    return paths


def chosen_speedup(t: Trial) -> float:
    """The final duel's speed-up when there was one, else the trial's."""
    return t.duel_speedup if t.duel_speedup is not None else (t.speedup or 0.0)


def _panel(ax, result: SearchResult, metric: str, terms) -> None:
    """One budget metric against speed: every measured candidate, that metric's Pareto front, the budget line."""
    # similarity metrics (cosine, top1) crowd under 1: plot their loss 1 - value on a log scale
    loss = METRICS[metric] and metric != "mismatch"

    def y(v: float) -> float:
        return max(1.0 - v, 1e-7) if loss else v

    pts = [t for t in result.trials if t.speedup is not None and metric in t.held and math.isfinite(t.held[metric])]
    for ok, color, label in ((True, "tab:green", "meets the budget"), (False, "tab:red", "misses the budget")):
        sel = [t for t in pts if (t.meets_budget or t.status == "reference") == ok]
        ax.scatter([t.speedup for t in sel], [y(t.held[metric]) for t in sel], c=color, label=label, zorder=3)
    for t in pts:
        ax.annotate(t.name, (t.speedup, y(t.held[metric])), fontsize=7, xytext=(4, 3), textcoords="offset points")
    names = set(pareto_front(pts, metric))
    front = sorted((t for t in pts if t.name in names), key=lambda t: t.speedup)
    if front:
        ax.plot([t.speedup for t in front], [y(t.held[metric]) for t in front], "--", c="gray", label="Pareto front")
    if result.chosen is not None and result.chosen in pts:
        ax.scatter([result.chosen.speedup], [y(result.chosen.held[metric])], s=220, facecolors="none",
                   edgecolors="black", label=f"chosen: {result.chosen.name}", zorder=4)
    for t in terms:
        ax.axhline(y(t.value), c="tab:orange", lw=1, label=f"budget {t}")
    if loss:
        ax.set_yscale("log")
    ax.set_xlabel("speed vs the lossless recipe (x, interleaved in each trial)")
    ax.set_ylabel(f"1 - {metric} (lower is better)" if loss else metric)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot(result: SearchResult) -> bytes:
    """Speed against held-back quality, one panel per budget metric with its Pareto front, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    terms = parse_budget(result.budget).terms
    metrics = list(dict.fromkeys(t.metric for t in terms)) or [result.metric]
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.5), dpi=110, squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        _panel(ax, result, metric, [t for t in terms if t.metric == metric])
    fig.suptitle(f"graphopt --search: {Path(result.input).name} (held-back feeds)", fontsize=9)
    buf = _io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()

"""One trial: build a candidate (each step cached on disk by its base and settings), measure its quality
against the input model's reference outputs and its speed interleaved with the base and the incumbent.

``run_trial`` is what a worker process or a Ray task runs; ``Trial`` is what it reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphopt import io
from graphopt.bench import bench_sessions
from graphopt.data import feeds as feeds_mod
from graphopt.data.metrics import compare, parse_budget
from graphopt.engine import pipeline
from graphopt.engine import recipe as recipe_mod
from graphopt.engine.options import OptimizeOptions
from graphopt.engine.verify import run_model
from graphopt.errors import GraphoptError
from graphopt.runtime import session as runtime
from graphopt.search.candidates import Candidate

logger = logging.getLogger(__name__)


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


def _cache_dir(shared: _Shared) -> Path:
    d = Path(tempfile.gettempdir()) / f"graphopt-search-{shared.session}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _from_bytes(data: bytes) -> ir.Model:
    return ir.from_proto(onnx.load_model_from_string(data))


def _to_bytes(model: ir.Model) -> bytes:
    return io.to_proto(model).SerializeToString()


def _build(shared: _Shared, cand: Candidate, trial: Trial) -> ir.Model | None:
    """The candidate's model: each step through the pipeline (cached by its base and settings); None when a
    step declined (the trial says why)."""

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
        res = pipeline.optimize(model, OptimizeOptions(recipe=recipe_mod.Recipe("search-step", [step]),
                                                       feeds=shared.feeds, budget=shared.budget,
                                                       provider=shared.provider, verify_level="structure"))
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

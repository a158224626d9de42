"""The benchmark harness: named callables timed round-robin, medians, ratios to a baseline, a table, JSON.

On a machine with slow phases (a shared VM), timing one thing after another is unreliable; running
everything in one process, round-robin, exposes every contender to the same phases, and the ratio to a
baseline is what we report. Everything that times things in graphopt (``graphopt bench``, the ORT-session
benchmarks of :mod:`graphopt.bench.session_bench`, the scripts in ``tools/``) goes through
:func:`round_robin`.

One *round* runs every contender once (a contender is one callable, or a list of *steps*, e.g. one per
feed, that a turn runs back to back). The order rotates each round so none always runs first; untimed
warm-up rounds come first. Clocks: ``wall`` (``time.perf_counter``), ``cpu`` (the calling thread's CPU
time, ``time.thread_time``: with one ORT intra-op thread every kernel runs on it, so waiting for a core
held by other jobs is not counted) and ``process`` (the process's CPU time, all threads).

JSON (:func:`results_doc`): ``{"baseline": name, "clock": clock, "results": [row, ...], **extra}``, one row
per contender (:meth:`BenchResult.as_dict`): ``model`` (its name), ``p50_ms``, ``p90_ms``, ``items_per_s``,
``rounds`` and, against the baseline, ``speedup_vs_first`` (the baseline's p50 over this one's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

#: clock name -> the function it reads
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time,
                                          "process": time.process_time}

Steps = Callable[[], object] | Sequence[Callable[[], object]]


def median(values: Iterable[float]) -> float:
    return float(np.median(np.asarray(list(values), dtype=float)))


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation as numpy)."""
    return float(np.percentile(np.asarray(list(values), dtype=float), q))


@dataclasses.dataclass
class BenchResult:
    """Timing of one contender over every round (``items_per_round``: what one round processes, for
    the throughput)."""

    name: str
    round_seconds: list[float]
    items_per_round: int = 1

    @property
    def p50(self) -> float:
        return median(self.round_seconds)

    @property
    def p90(self) -> float:
        return percentile(self.round_seconds, 90)

    @property
    def best(self) -> float:
        return min(self.round_seconds)

    @property
    def worst(self) -> float:
        return max(self.round_seconds)

    @property
    def throughput(self) -> float:
        return self.items_per_round / self.p50 if self.p50 > 0 else float("inf")

    def speedup_over(self, base: BenchResult) -> float:
        """``base``'s median round over this one's (> 1: this one is faster)."""
        return base.p50 / self.p50 if self.p50 > 0 else float("inf")

    def as_dict(self, base: BenchResult | None = None) -> dict:
        d = {
            "model": self.name,
            "p50_ms": 1e3 * self.p50,
            "p90_ms": 1e3 * self.p90,
            "items_per_s": self.throughput,
            "rounds": len(self.round_seconds),
        }
        if base is not None:
            d["speedup_vs_first"] = self.speedup_over(base)
        return d


def rotation(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated left by ``r``."""
    names = list(names)
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def round_robin(
    calls: Mapping[str, Steps],
    *,
    rounds: int = 20,
    warmup: int = 2,
    min_seconds: float = 0.0,
    clock: str = "wall",
    schedule: Callable[[int], Sequence[str]] | None = None,
    by_step: bool = False,
    items_per_round: int | Mapping[str, int] = 1,
) -> list[BenchResult]:
    """Time every contender of ``calls`` (name -> a callable or a list of steps) round-robin.

    ``warmup`` untimed rounds first (contenders in their given order), then ``rounds`` timed rounds (more
    while ``min_seconds`` of wall time have not passed). A round's order is ``schedule(r)`` (default
    :func:`rotation`); each turn runs a contender's steps back to back and is timed as a whole. With
    ``by_step`` the interleaving is finer: step ``i`` of every contender (in the order ``schedule(k)``,
    ``k`` counting steps over all rounds) runs before step ``i + 1``, and a contender's round time is the
    sum of its steps' (all contenders need as many steps). Results are in the order of ``calls``.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    tick = CLOCKS[clock]
    steps = {n: [c] if callable(c) else list(c) for n, c in calls.items()}
    names = list(steps)
    order = schedule or (lambda r: rotation(names, r))
    n_steps = {len(s) for s in steps.values()}
    if by_step and len(n_steps) > 1:
        raise ValueError(f"by_step needs as many steps per contender, got {sorted(n_steps)}")
    for _ in range(warmup):
        for n in names:
            for go in steps[n]:
                go()
    times: dict[str, list[float]] = {n: [] for n in names}
    t_begin = time.perf_counter()
    r = k = 0
    while r < rounds or (time.perf_counter() - t_begin) < min_seconds:
        if by_step:
            total = dict.fromkeys(names, 0.0)
            for i in range(next(iter(n_steps), 0)):
                for n in order(k):
                    t0 = tick()
                    steps[n][i]()
                    total[n] += tick() - t0
                k += 1
            for n in names:
                times[n].append(total[n])
        else:
            for n in order(r):
                t0 = tick()
                for go in steps[n]:
                    go()
                times[n].append(tick() - t0)
        r += 1
    items = items_per_round if isinstance(items_per_round, Mapping) else dict.fromkeys(names, items_per_round)
    return [BenchResult(n, times[n], items[n]) for n in names]


def by_name(results: Iterable[BenchResult]) -> dict[str, BenchResult]:
    return {r.name: r for r in results}


def speedups(results: Sequence[BenchResult], base: str | None = None) -> dict[str, float]:
    """Each contender's speed-up over the baseline (``base``, default the first): its p50 over theirs."""
    ref = by_name(results)[base] if base is not None else results[0]
    return {r.name: r.speedup_over(ref) for r in results}


def paired_ratios(num: BenchResult, den: BenchResult) -> list[float]:
    """Round by round ``num``'s time over ``den``'s (rounds paired by index; rounds where ``den`` took no
    time are left out): the phases a round shares cancel in its ratio."""
    return [a / b for a, b in zip(num.round_seconds, den.round_seconds) if b > 0]


def repeats_for(fn: Callable[[], object], seconds: float, *, probe_seconds: float = 0.05,
                min_calls: int = 3) -> int:
    """How many calls of ``fn`` last at least ``seconds`` (wall), from a short probe: for tiny models,
    so a round is long enough to time."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < probe_seconds or n < min_calls:
        fn()
        n += 1
    per = (time.perf_counter() - t0) / n
    return max(1, math.ceil(seconds / per))


def time_call(fn: Callable[[], object], clock: str = "wall") -> tuple[float, object]:
    """One call of ``fn``, timed: ``(seconds, what it returned)``."""
    tick = CLOCKS[clock]
    t0 = tick()
    out = fn()
    return tick() - t0, out


def results_doc(results: Sequence[BenchResult], *, base: str | None = None, clock: str = "wall",
                **extra) -> dict:
    """The JSON document of a benchmark (the keys are in this module's docstring)."""
    ref = by_name(results)[base] if base is not None else results[0]
    return {"baseline": ref.name, "clock": clock, "results": [r.as_dict(ref) for r in results], **extra}


def write_json(path: str | Path, doc: object, *, indent: int | None = 1, default=None) -> None:
    Path(path).write_text(json.dumps(doc, indent=indent, default=default))


class Table:
    """A plain markdown table on stdout (or ``file``), printed as it goes: :meth:`header` once, then
    :meth:`row` per row. ``align``: one letter per column, ``l`` or ``r`` (``---:``); none: ``---``."""

    def __init__(self, headers: Sequence[str], align: str | None = None, file=None):
        self.headers = list(headers)
        self.align = align
        self.file = file

    def lines(self, rows: Iterable[Sequence[object]] = ()) -> list[str]:
        seps = ["---:" if self.align and a == "r" else "---" for a in (self.align or "l" * len(self.headers))]
        return [markdown_row(self.headers), "|" + "".join(f"{s}|" for s in seps),
                *(markdown_row(r) for r in rows)]

    def header(self) -> None:
        for line in self.lines():
            print(line, file=self.file or sys.stdout, flush=True)

    def row(self, *cells: object) -> None:
        print(markdown_row(cells), file=self.file or sys.stdout, flush=True)


def markdown_row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None,
                file=None) -> None:
    """Header, separator and rows of a markdown table (:class:`Table`), all at once."""
    t = Table(headers, align, file)
    t.header()
    for r in rows:
        t.row(*r)

"""The "never slower" guard of ``optimize``: time the output against the input, find the lossless passes
that made the model slower, and say which ones the pipeline should roll back.

Timing (:func:`time_pair`): both models in ORT CPU sessions as ``graphopt bench`` opens them (all graph
optimizations, sequential, spinning off), one intra-op thread (on a shared machine one thread is the
least noisy), the run's own verification feeds. Rounds are interleaved (A then B, then B then A, ...);
each round times ``reps`` runs over every feed per model, ``reps`` chosen so a measurement lasts
:data:`MEASURE_S`. The verdict is on the per-round ratios ``t(A) / t(B)`` (the speedup of B):

- **slower** when their median is below :data:`SLOWER_BELOW` and at least :data:`AGREE` of the rounds
  say B is slower (a sign test: with 7 rounds, 6 agreeing happen by chance 6% of the time), and B's run
  over the feeds takes :data:`MIN_SLOWER_S` longer than A's (two sessions of one microsecond-sized model
  differ by a steady few percent);
- a verdict of slower is measured again (as many rounds more) and must hold over all the rounds
  (12 of 14 agreeing happen by chance 0.6% of the time), so a burst of load on a shared machine does
  not roll back a pass;
- identical models measured on a loaded 2-vCPU VM (MiniLM; a 20 us MatMul+Relu, the noisiest
  case) gave medians of 0.87-1.06 over 7 rounds, none judged slower (``docs/benchmarks.md``).

When the output is still slower without them and every step was lossless, every step is rolled back
(the output is the input). The check is cheap or skipped: ``auto`` runs it when it is estimated to cost at most :data:`AUTO_CHECK_S`
(from the time the input's verification session took to make and to run the feeds); ``on`` always,
``off`` never. When the output is slower, each lossless pass that modified the model is timed against the
model before it (its snapshot), and those slower on their own are named for rollback.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.errors import GraphoptError, UsageError
from graphopt.generate import float_view
from graphopt.runtime.session import make_session

logger = logging.getLogger(__name__)

#: a measurement (reps runs over the feeds) lasts at least this long
MEASURE_S = 0.02
#: interleaved rounds per comparison
ROUNDS = 7
#: median speedup below which the candidate is slower (beyond the noise of identical models)
SLOWER_BELOW = 0.97
#: fraction of rounds that must agree the candidate is slower
AGREE = 0.8
#: seconds per run over the feeds the candidate must lose, too, to be slower: two sessions of the same
#: microsecond-sized model differ by a steady ~5% (0.5 us of 9 us measured), which no user can notice
MIN_SLOWER_S = 20e-6
#: ``auto``: run the check when it is estimated (``estimate_check``) to cost at most this
AUTO_CHECK_S = 2.0
#: ``auto`` without that estimate: run the check when one round (both models) costs at most this
AUTO_ROUND_S = 0.15
#: ``auto``: models whose weights exceed this are never timed
AUTO_MAX_BYTES = 256 << 20
MODES = ("auto", "on", "off")


@dataclasses.dataclass
class Timing:
    """One interleaved comparison of A (the reference) and B (the candidate)."""

    ratios: list[float]  # t(A) / t(B) per round: above 1, B is faster
    seconds_a: float  # median seconds of one run over the feeds
    seconds_b: float

    @property
    def speedup(self) -> float:
        return statistics.median(self.ratios) if self.ratios else 1.0

    @property
    def slower(self) -> bool:
        """B is slower than A beyond noise."""
        agree = sum(r < 1.0 for r in self.ratios)
        return (self.speedup < SLOWER_BELOW and agree >= math.ceil(AGREE * len(self.ratios))
                and self.seconds_b - self.seconds_a > MIN_SLOWER_S)


def _session(model: ir.Model | bytes):
    return make_session(model, provider="cpu", threads=1, optimize=True, spinning=False,
                        execution_mode="sequential", inter_op_threads=1)


def _runner(sess, feeds: Sequence[Mapping[str, np.ndarray]]):
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    prepared = [{k: v for k, v in f.items() if k in wanted} for f in feeds]

    def run_all():
        for f in prepared:
            sess.run(names, f)
    return run_all


def _measure(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


class Runners:
    """One timed session per model (by identity), made on first use and warmed up, kept for the check."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]]):
        self.feeds, self._by_id = feeds, {}

    def get(self, model: ir.Model):
        key = id(model)
        if key not in self._by_id:
            sess = _session(model)
            run = _runner(sess, float_view.graph_feeds(sess, model, self.feeds))
            run()  # warm up: first runs allocate
            self._by_id[key] = (model, run)
        return self._by_id[key][1]


def time_pair(a: ir.Model, b: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]], *,
              rounds: int = ROUNDS, confirm: bool = True, runners: Runners | None = None) -> Timing:
    """Interleaved timing of ``a`` and ``b`` on ``feeds`` (see the module docstring). With ``confirm``, a
    verdict of slower is re-measured with as many rounds again and must hold over all of them."""
    runners = runners or Runners(feeds)
    ra, rb = runners.get(a), runners.get(b)
    one = max(_measure(ra, 1), _measure(rb, 1), 1e-6)
    reps = max(1, math.ceil(MEASURE_S / one))
    timing = _rounds(ra, rb, reps, rounds)
    if confirm and timing.slower:
        more = _rounds(ra, rb, reps, rounds)
        timing = Timing(timing.ratios + more.ratios, statistics.median([timing.seconds_a, more.seconds_a]),
                        statistics.median([timing.seconds_b, more.seconds_b]))
    return timing


def _rounds(ra, rb, reps: int, rounds: int) -> Timing:
    ratios, ta, tb = [], [], []
    for r in range(rounds):
        if r % 2:
            sb, sa = _measure(rb, reps), _measure(ra, reps)
        else:
            sa, sb = _measure(ra, reps), _measure(rb, reps)
        ta.append(sa)
        tb.append(sb)
        ratios.append(sa / sb if sb > 0 else 1.0)
    return Timing(ratios, statistics.median(ta), statistics.median(tb))


def estimate_round(model: ir.Model, runners: Runners) -> float:
    """Seconds one round of :func:`time_pair` is estimated to cost for ``model`` (twice one measurement)."""
    run = runners.get(model)
    one = min(_measure(run, 1) for _ in range(3))
    return 2 * max(MEASURE_S, one)


def _weight_bytes(model: ir.Model) -> int:
    total = 0
    for v in model.graph.initializers.values():
        t = v.const_value
        if t is not None:
            total += int(getattr(t, "nbytes", 0) or 0)
    return total


def estimate_check(session_s: float, run_s: float) -> float:
    """Seconds the check is estimated to cost from how long the input's verification session took to make
    (``session_s``; an optimized one and the output's are counted at twice that each) and to run the feeds
    (``run_s``, unoptimized: an upper bound of the optimized run)."""
    return 4 * session_s + ROUNDS * 2 * max(MEASURE_S, run_s)


def should_check(mode: str, model: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]],
                 runners: Runners | None = None, estimate: float | None = None) -> tuple[bool, str]:
    """(run the check, why not when not): ``on`` always (with feeds), ``off`` never, ``auto`` when cheap."""
    if mode == "off":
        return False, "off"
    if not feeds:
        return False, "no feeds to time on"
    if mode == "on":
        return True, ""
    size = _weight_bytes(model)
    if size > AUTO_MAX_BYTES:
        return False, f"skipped: weights of {size / 2**20:.0f} MiB (--speed-check times it anyway)"
    if estimate is not None:
        if estimate > AUTO_CHECK_S:
            return False, f"skipped: estimated to cost {estimate:.1f} s (--speed-check on times it anyway)"
        return True, ""
    try:
        cost = estimate_round(model, runners or Runners(feeds))
    except GraphoptError as e:
        return False, f"skipped: {e.message}"
    if cost > AUTO_ROUND_S:
        return False, f"skipped: a timed round costs {cost:.2f} s (--speed-check on times it anyway)"
    return True, ""


def keeps_snapshots(mode: str, model: ir.Model) -> bool:
    """Whether the pipeline keeps the model after each step for :func:`guard` (not for ``off`` or large models)."""
    if mode not in MODES:
        raise UsageError(f"unknown speed check {mode!r}", hint="use " + ", ".join(MODES))
    return mode == "on" or (mode == "auto" and _weight_bytes(model) <= AUTO_MAX_BYTES)


@dataclasses.dataclass
class Snapshot:
    """The model after a step that modified it."""

    index: int  # the step's position in the recipe
    name: str
    exact: bool
    model: ir.Model


def slow_passes(base: ir.Model, snapshots: Sequence[Snapshot], feeds, runners: Runners | None = None
                ) -> dict[int, Timing]:
    """The lossless steps that are slower than the model before them (step index -> its timing)."""
    out = {}
    prev = base
    for snap in snapshots:
        if snap.exact:
            t = time_pair(prev, snap.model, feeds, runners=runners)
            logger.info("speed check: %s %.3fx the model before it", snap.name, t.speedup)
            if t.slower:
                out[snap.index] = t
        prev = snap.model
    return out


@dataclasses.dataclass
class Outcome:
    """What the guard decided: the model to keep, the report's ``speed`` entry, the steps rolled back."""

    model: ir.Model
    info: dict
    rolled_back: dict[int, Timing] = dataclasses.field(default_factory=dict)
    #: records of the steps re-run without the rolled-back ones (their recipe indices -> model), when any
    rerun: object = None


def guard(mode: str, base: ir.Model, final: ir.Model, snapshots: Sequence[Snapshot], feeds, rerun, *,
          estimate: float | None = None) -> Outcome:
    """Time ``final`` against ``base``; when slower beyond noise, roll back the lossless steps slower on
    their own: ``rerun(start_model, first_index, skip)`` re-runs the recipe's steps after ``first_index``
    but those in ``skip`` on ``start_model`` and returns ``(model, what it reports)``.

    A slowdown no single lossless step explains is kept (and said); so is one a later lossy step built on.
    """
    t0 = time.perf_counter()
    runners = Runners(feeds)
    if not snapshots:
        return Outcome(final, {"checked": False, "reason": "skipped: the model is unchanged"})
    run, why = should_check(mode, base, feeds, runners, estimate)
    if not run:
        return Outcome(final, {"checked": False, "reason": why})
    total = time_pair(base, final, feeds, runners=runners)
    info: dict = {"checked": True, "speedup": round(total.speedup, 3), "rounds": len(total.ratios),
                  "rolled_back": []}
    out = Outcome(final, info)
    if total.slower:
        slow = slow_passes(base, snapshots, feeds, runners)
        first = min(slow) if slow else None
        if first is None:
            info["note"] = f"{total.speedup:.2f}x the input, but no lossless pass is slower on its own: kept"
        elif any(not s.exact and s.index > first for s in snapshots):
            info["note"] = (f"{total.speedup:.2f}x the input; a lossy pass builds on the slower "
                            + ", ".join(s.name for s in snapshots if s.index in slow) + ": kept")
        else:
            start = next((s.model for s in reversed(snapshots) if s.index < first), base)
            model, rerun_info = rerun(start, first, set(slow))
            after = time_pair(base, model, feeds, runners=runners)
            info["speedup_before_rollback"] = info["speedup"]
            if after.slower and all(s.exact for s in snapshots):
                # still slower without them: no lossless pass is worth a slower model, the output is the input
                info["note"] = (f"still {after.speedup:.2f}x the input without "
                                + ", ".join(s.name for s in snapshots if s.index in slow)
                                + ": every pass rolled back, the output is the input model")
                slow = {s.index: slow.get(s.index, after) for s in snapshots}
                out = Outcome(base, info, slow)
                info["speedup"] = 1.0
            else:
                out = Outcome(model, info, slow, rerun_info)
                info["speedup"] = round(after.speedup, 3)
            info["rolled_back"] = [s.name for s in snapshots if s.index in slow]
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def note(info: Mapping) -> str:
    """The report's one line on the speed check."""
    if not info:
        return ""
    if not info.get("checked"):
        return f"speed check {info.get('reason', 'skipped')}"
    line = f"speed check: {info['speedup']:.2f}x the input (median of {info['rounds']} interleaved rounds, " \
           f"{info['seconds']:.1f} s)"
    if info.get("rolled_back"):
        line += (f"; rolled back {', '.join(info['rolled_back'])} (slower than the model before; the output was "
                 f"{info['speedup_before_rollback']:.2f}x the input with it)")
    if info.get("note"):
        line += f"; {info['note']}"
    return line

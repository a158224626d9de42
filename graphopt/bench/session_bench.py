"""ORT sessions benchmarked on the harness (:mod:`graphopt.bench.harness`): all models in one process,
round-robin, intra-op spinning off, medians and ratios; thread counts and concurrent instances compared.

On CUDA (``device="cuda"``) every run goes through an IO binding: the feeds are copied to the GPU once,
outputs are left on the GPU, so the timing is the session's compute, not host-device copies.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.bench.harness import BenchResult, round_robin
from graphopt.runtime import session as runtime
from graphopt.runtime import session_hints


def open_sessions(models: Mapping[str, object], *, threads: int | None = 1, **kwargs) -> dict[str, object]:
    """One CPU session per model (name -> path, bytes or model) the way benchmarks make them: intra-op
    spinning off (``session.intra_op.allow_spinning=0``: idle pool threads do not steal the cores other
    sessions of the round-robin are timed on), ``threads`` intra-op threads; ``kwargs`` go to
    :func:`graphopt.runtime.session.make_session`."""
    return {name: runtime.make_session(m, threads=threads, spinning=False, **kwargs) for name, m in models.items()}


def feed_items(feed: Mapping[str, np.ndarray]) -> int:
    for v in feed.values():
        a = np.asarray(v)
        if a.ndim >= 1:
            return int(a.shape[0])
    return 1


def _runners(sess, feeds: Sequence[Mapping[str, np.ndarray]], device: str | None) -> list:
    """One callable per feed running ``sess`` on it: ``sess.run``, or on ``device`` through an IO binding
    with the inputs already there and the outputs left there."""
    if device is None:
        return [lambda f=f: sess.run(None, f) for f in feeds]
    import onnxruntime as ort

    runners = []
    for f in feeds:
        binding = sess.io_binding()
        for name, value in f.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), device, 0))
        for out in sess.get_outputs():
            binding.bind_output(out.name, device, 0)
        runners.append(lambda b=binding: sess.run_with_iobinding(b))
    return runners


def bench_sessions(
    sessions: Mapping[str, object],
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    rounds: int = 20,
    warmup: int = 2,
    min_seconds: float = 0.0,
    clock: str = "wall",
    device: str | None = None,
    schedule: Callable[[int], Sequence[str]] | None = None,
) -> list[BenchResult]:
    """Round-robin over sessions; each turn runs every feed once through one session.

    The order of sessions rotates each round so none always runs first (``schedule(r)``, when given,
    is round ``r``'s order instead). ``clock='cpu'`` times the calling thread's CPU time (with one
    intra-op thread ORT runs every kernel on it, so waiting for a core held by other jobs is not
    counted); ``'wall'`` times wall time.
    """
    prepared = {}
    for n, s in sessions.items():
        wanted = {i.name for i in s.get_inputs()} | {i.name for i in s.get_overridable_initializers()}
        prepared[n] = _runners(s, [{k: v for k, v in f.items() if k in wanted} for f in feeds], device)
    return round_robin(prepared, rounds=rounds, warmup=warmup, min_seconds=min_seconds, clock=clock,
                       schedule=schedule, items_per_round=sum(feed_items(f) for f in feeds))


def bench_models(
    models: Mapping[str, object],
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    threads: int = 1,
    rounds: int = 20,
    warmup: int = 2,
    provider: str = "cpu",
) -> list[BenchResult]:
    """Make one session per model (ORT_ENABLE_ALL, intra-op spinning off) and bench them interleaved.

    ``provider='cuda'`` needs the CUDA provider (a one-line RuntimeSetupError names what is missing, no
    CPU fallback) and runs through IO bindings, after ``warmup`` untimed rounds.
    """
    return bench_thread_counts(models, feeds, [threads], rounds=rounds, warmup=warmup, provider=provider)[threads]


def bench_thread_counts(
    models: Mapping[str, object],
    feeds: Sequence[Mapping[str, np.ndarray]],
    thread_counts: Sequence[int],
    *,
    rounds: int = 20,
    warmup: int = 2,
    provider: str = "cpu",
    hints: bool = True,
) -> dict[int, list[BenchResult]]:
    """Bench every model at each intra-op thread count, one interleaved round-robin per thread count.

    The sessions of one thread count are made, benched together (all models exposed to the same
    phases) and released before the next count's; compare thread counts with :func:`scaling`. With
    ``hints`` each model's session uses the settings recorded in its metadata (graph optimization level,
    execution mode, inter-op threads: :mod:`graphopt.runtime.session_hints`), the thread count staying ``threads``.
    """
    cuda = provider == "cuda"
    if cuda:
        runtime.require_cuda()
    settings = {name: model_settings(m) if hints else {} for name, m in models.items()}
    out: dict[int, list[BenchResult]] = {}
    for threads in thread_counts:
        sessions = {
            name: runtime.make_session(m, provider=provider, threads=threads, optimize=True, spinning=False,
                                       strict_provider=cuda, **session_hints.session_kwargs(settings[name]))
            for name, m in models.items()
        }
        out[threads] = bench_sessions(sessions, feeds, rounds=rounds, warmup=warmup,
                                      device="cuda" if cuda else None)
        del sessions
    return out


class ConcurrentSessions:
    """``n`` single-thread sessions of one model that run each feed at the same time (one Python thread
    each; ONNX Runtime releases the GIL): ``n`` times the items per run. How a CPU service scales by
    model instances (Triton's ``instance_group``) rather than by intra-op threads."""

    def __init__(self, sessions: Sequence[object]):
        from concurrent.futures import ThreadPoolExecutor

        self.sessions = list(sessions)
        self._pool = ThreadPoolExecutor(len(self.sessions), thread_name_prefix="graphopt-bench")

    def get_inputs(self):
        return self.sessions[0].get_inputs()

    def get_overridable_initializers(self):
        return self.sessions[0].get_overridable_initializers()

    def run(self, output_names, feed):
        return list(self._pool.map(lambda s: s.run(output_names, feed), self.sessions))

    def close(self) -> None:
        self._pool.shutdown()


#: how ``bench_thread_pairs`` spends a count of ``n`` cores: one session with ``n`` intra-op threads, or
#: ``n`` concurrent single-thread sessions
SCALE_BY = ("threads", "instances")


def bench_thread_pairs(
    models: Mapping[str, object],
    feeds: Sequence[Mapping[str, np.ndarray]],
    thread_counts: Sequence[int],
    *,
    rounds: int = 20,
    warmup: int = 2,
    hints: bool = True,
    scale_by: str = "threads",
) -> dict[int, list[BenchResult]]:
    """Like :func:`bench_thread_counts` (CPU), but every thread count in one round-robin: each round runs
    each model's sessions back to back, one per thread count (their order reversed every other round,
    the models' order rotating), so a model's timings at different counts are seconds apart and share
    the machine's phase. Compare them round by round with :func:`paired_scaling`.

    ``scale_by='instances'``: a count ``n`` is ``n`` concurrent single-thread sessions
    (:class:`ConcurrentSessions`, ``n`` times the items per round) instead of ``n`` intra-op threads."""
    if scale_by not in SCALE_BY:
        raise ValueError(f"scale_by must be one of {SCALE_BY}, got {scale_by!r}")
    settings = {name: model_settings(m) if hints else {} for name, m in models.items()}

    def make(m, name: str, n: int):
        kw = dict(optimize=True, spinning=False, **session_hints.session_kwargs(settings[name]))
        if scale_by == "threads" or n == 1:
            return runtime.make_session(m, threads=n, **kw)
        return ConcurrentSessions([runtime.make_session(m, threads=1, **kw) for _ in range(n)])

    sessions = {(name, n): make(m, name, n) for name, m in models.items() for n in thread_counts}
    keys = {f"{n}\t{name}": (name, n) for name, n in sessions}
    names = list(models)

    def schedule(r: int) -> list[str]:
        counts = list(thread_counts) if r % 2 == 0 else list(reversed(thread_counts))
        rotated = names[r % len(names):] + names[: r % len(names)]
        return [f"{n}\t{name}" for name in rotated for n in counts]

    try:
        flat = bench_sessions({k: sessions[v] for k, v in keys.items()}, feeds, rounds=rounds, warmup=warmup,
                              schedule=schedule)
    finally:
        for s in sessions.values():
            if isinstance(s, ConcurrentSessions):
                s.close()
    by_key = {keys[r.name]: r for r in flat}
    copies = {(name, n): n if isinstance(s, ConcurrentSessions) else 1 for (name, n), s in sessions.items()}
    return {n: [dataclasses.replace(by_key[name, n], name=name,
                                    items_per_round=by_key[name, n].items_per_round * copies[name, n])
                for name in names] for n in thread_counts}


def paired_scaling(results: Mapping[int, Sequence[BenchResult]], relative_to: str | None = None
                   ) -> dict[int, dict[str, float]]:
    """Each model's scaling, round by round (its throughput in a round at each thread count over its
    throughput in the same round at the first count; rounds paired by index, as :func:`bench_thread_pairs` makes them), the median over
    rounds. With ``relative_to`` (a model's name), each round's scaling is first divided by that model's
    in the same round: the model's scaling relative to a baseline's, with the machine's phases cancelled."""
    counts = list(results)
    first = {r.name: r.items_per_round / np.asarray(r.round_seconds) for r in results[counts[0]]}
    out: dict[int, dict[str, float]] = {}
    for n in counts:
        per = {r.name: r.items_per_round / np.asarray(r.round_seconds) / first[r.name] for r in results[n]}
        if relative_to is not None:
            per = {k: v / per[relative_to] for k, v in per.items()}
        out[n] = {k: float(np.median(v)) for k, v in per.items()}
    return out


def model_settings(model: object) -> dict:
    """The session settings recorded in a model (path or ``onnx_ir.Model``; others have none): ``{}`` if none."""

    if isinstance(model, (str, os.PathLike, ir.Model)):
        return session_hints.read(model)
    return {}


def scaling(results: Mapping[int, Sequence[BenchResult]]) -> dict[int, dict[str, float]]:
    """Each model's throughput at each thread count over its throughput at the first thread count."""
    counts = list(results)
    first = {r.name: r.throughput for r in results[counts[0]]}
    return {t: {r.name: r.throughput / first[r.name] if first[r.name] > 0 else float("inf") for r in results[t]}
            for t in counts}

"""Where trials run: in this process, in spawned worker processes (``concurrent.futures``), or as tasks on a
Ray cluster (the ``graphopt[ray]`` extra, imported only when asked for)."""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
from typing import Any

from graphopt.errors import UsageError
from graphopt.search.candidates import Candidate
from graphopt.search.trials import Trial, _Shared, run_trial

_WORKER: dict[str, Any] = {}


def _init_worker(shared: _Shared) -> None:
    logging.basicConfig(level=logging.WARNING)
    _WORKER["shared"] = shared


def _pool_trial(cand: Candidate, incumbent: tuple[str, bytes] | None) -> Trial:
    return run_trial(_WORKER["shared"], cand, incumbent)


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

"""The generation engine: one thread drives the continuous-batching ``Scheduler``; asyncio handlers stream.

::

    handler ──submit──▶ inbox (bounded: --max-queue) ──engine thread: Scheduler.step()──▶ events
    handler ◀──asyncio.Queue per request (call_soon_threadsafe)────────────────────────────┘

``submit`` refuses with ``Busy`` (HTTP 429) when ``max_queue`` requests already wait for a slot, and with
``Closing`` (503) once shutdown began; a bad prompt is a ``UsageError`` (400) before anything is queued.
``cancel`` (a client went away, a stop string matched) frees the request's slot at the next step. ``close``
stops taking requests, lets every queued and running one finish, then ends the thread. A fault of a step
(an ONNX Runtime error) fails the requests of that step with an ``EngineError`` (500) and the engine serves on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from graphopt.errors import GraphoptError
from graphopt.generate.sampling import Sampling
from graphopt.generate.scheduler import Scheduler, Sequence

logger = logging.getLogger(__name__)


class Busy(GraphoptError):
    """Too many requests wait for a slot (HTTP 429)."""


class Closing(GraphoptError):
    """The server is shutting down (HTTP 503)."""


class EngineError(GraphoptError):
    """A step of the engine failed (HTTP 500)."""


class Stream:
    """One request's tokens, as ``(token id, finish reason or None)`` pairs on an asyncio queue; an
    ``EngineError`` on the queue when its step failed."""

    def __init__(self, seq: Sequence, submitted: float):
        self.seq = seq
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submitted = submitted

    async def next(self):
        item = await self.queue.get()
        if isinstance(item, EngineError):
            raise item
        return item


class Engine:
    def __init__(self, scheduler: Scheduler, *, max_queue: int = 64):
        self.scheduler = scheduler
        self.max_queue = max(0, max_queue)
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        #: requests finished (any reason), refused as busy, tokens generated: the /stats endpoint
        self.finished = 0
        self.refused = 0
        self.tokens = 0
        self.failures = 0

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="graphopt-generate", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop taking requests; finish the queued and running ones; stop the thread."""
        with self._cv:
            self._closing = True
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return self.scheduler.active

    # -- requests --------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], max_new: int, sampling: Sampling, stop_ids=()) -> Stream:
        """Queue a request; its Stream (``seq.max_new`` is ``max_new`` within the context)."""
        max_new = self.scheduler.check(prompt, max_new)  # UsageError: nothing queued
        seq = Sequence(list(prompt), max_new, sampling, frozenset(stop_ids))
        stream = Stream(seq, time.perf_counter())
        seq.tag = stream
        with self._cv:
            if self._closing:
                raise Closing("the server is shutting down: no new requests")
            free = self.scheduler.slots - self.scheduler.active
            if self.queued >= self.max_queue + free:
                self.refused += 1
                raise Busy(f"the server is busy: {self.queued} requests wait for one of {self.scheduler.slots} "
                           f"slots (--max-queue {self.max_queue})", hint="retry later")
            self._inbox.append(seq)
            self._cv.notify()
        return stream

    @staticmethod
    def cancel(stream: Stream) -> None:
        """No more tokens for ``stream``: its slot is freed at the next step (a no-op once it finished)."""
        Scheduler.cancel(stream.seq)

    # -- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                while not self._inbox and sched.idle and not self._stop:
                    self._cv.wait()
                if self._stop and not self._inbox and sched.idle:
                    return
                sched.waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                events = sched.step()
            except Exception as e:  # a fault of the runtime: fail what was running, keep serving
                logger.exception("generation step failed")
                self._fail_all(EngineError(f"generation failed: {type(e).__name__}: {str(e).splitlines()[0]}"))
                continue
            if events:
                self._loop.call_soon_threadsafe(self._deliver, events)

    def _fail_all(self, error: EngineError) -> None:
        sched = self.scheduler
        victims = [s for s in sched.running if s is not None] + list(sched.waiting)
        sched.running = [None] * sched.slots
        sched.waiting.clear()
        self.failures += len(victims)
        for seq in victims:
            seq.finish = "error"
            self._loop.call_soon_threadsafe(seq.tag.queue.put_nowait, error)

    def _deliver(self, events) -> None:
        for seq, tok, finish in events:
            self.tokens += 1
            if finish is not None:
                self.finished += 1
            seq.tag.queue.put_nowait((tok, finish))

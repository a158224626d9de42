"""Dynamic batching: concurrent requests wait at most ``max_delay`` for a batch of up to ``max_batch`` rows.

One worker task per runner instance (``Runner.instances``, one ONNX Runtime session each) takes the oldest
request, collects more until the batch is full or the delay since that request's arrival has passed, and
runs the batch on its own thread and session (``Runner.run``) while new requests queue up for the next
one, or for another idle instance. ``max_batch=1`` turns batching off. ``close`` finishes every queued
request first.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from graphopt.serve.runner import InferError, Item, Runner

logger = logging.getLogger(__name__)


class Batcher:
    def __init__(self, runner: Runner, *, max_batch: int = 32, max_delay_ms: float = 5.0):
        self.runner = runner
        self.max_batch = max(1, max_batch if runner.sig.batched else 1)
        self.max_delay = max(0.0, max_delay_ms) / 1000.0
        self._pending: collections.deque[tuple[Item, asyncio.Future, float]] = collections.deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(runner.instances, thread_name_prefix="graphopt-ort")
        self._tasks: list[asyncio.Task] = []
        self._forming: dict[int, int] = {}
        #: session runs and requests answered (the /stats endpoint), and batches run per instance
        self.batches = 0
        self.requests = 0
        self.instance_batches = [0] * runner.instances

    @property
    def pending(self) -> int:
        """Requests waiting for their batch to start (queued, or collected into the batch being formed)."""
        return len(self._pending) + sum(self._forming.values())

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._worker(k)) for k in range(self.runner.instances)]

    async def submit(self, item: Item):
        """The request's outputs, or raises its ``InferError``."""
        if self._closing:
            raise InferError("the server is shutting down", status=503)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut, time.monotonic()))
        self._wake.set()
        result = await fut
        if isinstance(result, InferError):
            raise result
        return result

    async def close(self) -> None:
        """Stop taking requests, finish the queued ones, stop the worker."""
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            await task
        self._executor.shutdown(wait=True)

    async def _wait(self, timeout: float | None) -> bool:
        self._wake.clear()
        if self._pending or (self._closing and timeout is None):
            return True
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _worker(self, instance: int = 0) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._closing:
                    return
                await self._wait(None)
                continue
            first = self._pending.popleft()
            batch, rows = [first], first[0].rows
            self._forming[instance] = 1
            deadline = first[2] + self.max_delay
            while rows < self.max_batch:
                if self._pending:
                    if rows + self._pending[0][0].rows > self.max_batch:
                        break
                    nxt = self._pending.popleft()
                    batch.append(nxt)
                    rows += nxt[0].rows
                    self._forming[instance] = len(batch)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing or not await self._wait(remaining):
                    break
            items = [b[0] for b in batch]
            self._forming[instance] = 0
            try:
                results = await loop.run_in_executor(self._executor, self.runner.run, items, instance)
            except Exception as e:  # a bug in batching itself: fail this batch, keep serving
                logger.exception("batch failed")
                results = [InferError(f"internal error: {e}", status=500)] * len(items)
            self.batches += len(self.runner.groups(items))
            self.instance_batches[instance] += 1
            self.requests += len(items)
            for (_, fut, _), res in zip(batch, results):
                if not fut.done():  # the client may have gone away
                    fut.set_result(res)

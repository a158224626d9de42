"""Ending a run by a signal without leaving anything behind.

By default SIGTERM ends a Python process at once: no ``finally`` runs, so the temporary files
graphopt makes (``.graphopt-*`` model files beside a model's weights, ``.NAME.*.tmp`` folders beside
an output, spilled outputs in the temp folder) would stay. Within :func:`unwind_on_signals` (the
CLI runs in it) SIGTERM raises ``SystemExit(143)`` and SIGINT ``KeyboardInterrupt``, so the stack
unwinds and every cleanup runs; a signal that arrives inside :func:`uninterrupted` (the renames
that put a written model in place) waits until that block is done, so an output is there whole
or not at all.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_depth = 0  # nesting of uninterrupted blocks
_pending: int | None = None  # a signal that arrived inside one


def _raise_for(signum: int):
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def uninterrupted():
    """A signal handled by :func:`unwind_on_signals` waits until this block is done."""
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending is not None:
            signum, _pending = _pending, None
            _raise_for(signum)


def _handler(signum, frame):
    global _pending
    if _depth:
        _pending = signum
        return
    _raise_for(signum)


@contextlib.contextmanager
def unwind_on_signals():
    """SIGTERM and SIGINT unwind the stack within the block (see the module docstring); the previous
    handlers come back after it. Outside the main thread it does nothing (Python handles signals
    there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)

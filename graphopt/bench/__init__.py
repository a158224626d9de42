"""Benchmarking: the harness (:mod:`graphopt.bench.harness`: named callables timed round-robin, medians,
ratios, a table, JSON) and ORT sessions benchmarked on it (:mod:`graphopt.bench.session_bench`).

The session names load on first use, so ``graphopt.bench.harness`` alone stays light (numpy only)."""

from __future__ import annotations

import importlib

from graphopt.bench.harness import (
    CLOCKS,
    BenchResult,
    Table,
    by_name,
    markdown_row,
    median,
    paired_ratios,
    percentile,
    print_table,
    repeats_for,
    results_doc,
    rotation,
    round_robin,
    speedups,
    time_call,
    write_json,
)

_SESSION_NAMES = ("SCALE_BY", "ConcurrentSessions", "bench_models", "bench_sessions", "bench_thread_counts",
                  "bench_thread_pairs", "feed_items", "model_settings", "open_sessions", "paired_scaling", "scaling")

__all__ = [
    "CLOCKS", "BenchResult", "Table", "by_name", "markdown_row", "median", "paired_ratios", "percentile", "print_table",
    "repeats_for", "results_doc", "rotation", "round_robin", "speedups", "time_call", "write_json",
    *_SESSION_NAMES,
]


def __getattr__(name: str):
    if name in _SESSION_NAMES:
        return getattr(importlib.import_module("graphopt.bench.session_bench"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

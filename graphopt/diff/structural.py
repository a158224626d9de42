"""Structural diff, split into :mod:`graphopt.diff.matching` (node and value matching, typed node
ids), :mod:`graphopt.diff.regions` (rewritten regions) and :mod:`graphopt.diff.deltas` (initializer,
IO and subgraph deltas). This module re-exports their public names for existing importers
(``graphopt.diff.numeric``).
"""

from __future__ import annotations

from graphopt.analysis.flops import FLOP_BATCH, FLOP_SEQ, estimate_flops
from graphopt.diff.deltas import initializer_delta, initializer_stats, io_delta, subgraph_delta
from graphopt.diff.matching import (
    Matching,
    NodeId,
    Side,
    graph_fingerprint,
    match_graphs,
    pass_of,
    tensor_hash,
)
from graphopt.diff.regions import Region, find_regions
from graphopt.opsets import op_histogram, op_key

__all__ = [
    "FLOP_BATCH", "FLOP_SEQ", "Matching", "NodeId", "Region", "Side", "estimate_flops", "find_regions",
    "graph_fingerprint", "initializer_delta", "initializer_stats", "io_delta", "match_graphs", "op_histogram",
    "op_key", "pass_of", "subgraph_delta", "tensor_hash",
]

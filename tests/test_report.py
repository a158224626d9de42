"""graphopt.engine.report.json_safe: what the JSON reports (``--report``, diff) are written from."""

from __future__ import annotations

import json

import numpy as np

from graphopt.engine.report import json_safe


def test_json_safe():
    got = json_safe({"a": float("nan"), 1: (np.float32(1.5), float("-inf")), "b": [np.int64(3), {"c": float("inf")}]})
    assert got == {"a": "nan", "1": [1.5, "-inf"], "b": [3, {"c": "inf"}]}
    assert type(got["b"][0]) is int and type(got["1"][0]) is float
    json.dumps(got, allow_nan=False)

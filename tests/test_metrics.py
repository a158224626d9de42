"""Mask-aware comparison and budgets."""

from __future__ import annotations

import numpy as np
import pytest

from graphopt.data.metrics import compare, parse_budget
from graphopt.errors import UsageError


def _feed(mask):
    return {"attention_mask": np.array(mask, dtype=np.int64)}


def test_padded_positions_are_ignored():
    mask = [[1, 1, 0], [1, 0, 0]]
    ref = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    got = ref.copy()
    got[0, 2] += 100.0  # garbage at padded positions only
    got[1, 1:] = np.nan
    c = compare([{"y": got}], [{"y": ref}], [_feed(mask)])
    assert c.within(1e-4, 1e-4) and c.worst("max_abs") == 0.0
    assert c.outputs["y"].samples == 3  # three real tokens
    got[1, 0, 0] += 1.0  # a real token
    c = compare([{"y": got}], [{"y": ref}], [_feed(mask)])
    assert not c.within(1e-4, 1e-4) and c.worst("max_abs") == pytest.approx(1.0)


def test_packed_output_compared_with_real_tokens():
    mask = np.array([[1, 1, 0], [0, 1, 1]])
    ref = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    packed = ref[mask.astype(bool)]
    c = compare([{"y": packed}], [{"y": ref}], [_feed(mask)])
    assert c.outputs["y"].shape_mismatch is None and c.within(1e-4, 1e-4)
    c = compare([{"y": packed[::-1]}], [{"y": ref}], [_feed(mask)])
    assert not c.within(1e-4, 1e-4)


def test_cosine_top1_and_shape_mismatch():
    ref = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    got = np.array([[1.0, 0.1], [1.0, 0.0]], np.float32)
    c = compare([{"y": got}], [{"y": ref}])
    d = c.outputs["y"]
    assert d.cosine_min == pytest.approx(0.0) and d.top1 == 0.5
    assert d.cosine == pytest.approx((1 / np.sqrt(1.01)) / 2)
    c = compare([{"y": got[:1]}], [{"y": ref}])
    assert c.outputs["y"].shape_mismatch and c.worst("cosine") == -np.inf


def test_int_outputs_must_be_equal():
    c = compare([{"i": np.array([1, 2, 3])}], [{"i": np.array([1, 2, 4])}])
    assert not c.within(1e-4, 1e-4) and c.outputs["i"].exact_dtype


def test_budget_parsing_and_checking():
    b = parse_budget(["cosine>=0.99", "max_abs<0.1, top1>=1"])
    assert [str(t) for t in b.terms] == ["cosine>=0.99", "max_abs<0.1", "top1>=1"]
    ref = np.ones((4, 8), np.float32)
    c = compare([{"y": ref * 1.01}], [{"y": ref}])
    assert b.failures(c) == []
    c = compare([{"y": ref * 1.5}], [{"y": ref}])
    assert b.failures(c) == ["max_abs<0.1 not met: max_abs=0.5"]
    for bad in ("cosine", "cos>=1", "cosine=>1", "cosine>=x"):
        with pytest.raises(UsageError):
            parse_budget(bad)


def test_nan_or_inf_where_the_reference_is_finite_always_fails():
    """A finite reference turned NaN/Inf fails a lossless check and any budget, whatever the tolerance or
    metric: silence through a dropped epsilon guard must not pass on a cosine that ignores a few elements."""
    import numpy as np

    from graphopt.data.metrics import compare, parse_budget

    ref = [{"y": np.ones((4, 64), np.float32)}]
    got = [{"y": np.ones((4, 64), np.float32)}]
    got[0]["y"][0, 0] = -np.inf
    cmp = compare(got, ref)
    assert cmp.outputs["y"].new_nonfinite == 1 and not cmp.within(1e9, 1e9)
    assert any("NaN/Inf where the reference is finite" in f for f in parse_budget("top1>=0.5").failures(cmp))
    same = compare([{"y": np.full((1, 2), np.nan, np.float32)}], [{"y": np.full((1, 2), np.nan, np.float32)}])
    assert same.outputs["y"].new_nonfinite == 0 and same.within(1e-4, 1e-4)  # NaN in the reference too: not new

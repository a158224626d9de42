"""graphopt.feeds.split_feeds: calibration and held-back feeds."""

from __future__ import annotations

import numpy as np

from graphopt.feeds import split_feeds


def _feeds(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full((1, 2), i, np.float32)} for i in range(n)]


def test_first_half_calibrates_the_rest_is_held_back():
    feeds = _feeds(5)
    calib, held = split_feeds(feeds)
    assert calib == feeds[:2] and held == feeds[2:]
    calib, held = split_feeds(iter(_feeds(4)))
    assert [int(f["x"][0, 0]) for f in calib] == [0, 1] and [int(f["x"][0, 0]) for f in held] == [2, 3]


def test_fewer_than_two_feeds_serve_both():
    for n in (0, 1):
        calib, held = split_feeds(_feeds(n))
        assert len(calib) == n and calib is held

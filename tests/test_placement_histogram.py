"""EW histogram, evaluation and baselines."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_sparse.placement import (
    BASELINES,
    DepthHistogram,
    DepthLaw,
    block_placement,
    evaluate_placement,
    log_placement,
    sqrt_placement,
)


def test_exponential_weights_match_closed_form() -> None:
    h = DepthHistogram(gamma=0.9, refresh=3)
    for d in [100, 200, 100, 300]:
        h.observe(d)
    depths, weights = h.items()
    assert depths.tolist() == [100, 200, 300]
    assert weights.tolist() == pytest.approx([0.9**3 + 0.9, 0.9**2, 1.0])
    assert h.total == pytest.approx(sum(0.9**k for k in range(4)))


def test_rescale_keeps_weights_and_prunes_stale_depths() -> None:
    h = DepthHistogram(gamma=0.5, refresh=10)
    h.observe(7)
    for _ in range(200):  # 0.5**-200 overflows the scale many times over
        h.observe(64)
    d, w = h.items()
    assert d.tolist() == [64]  # the depth seen 200 steps ago decayed below the prune floor
    assert w[0] == pytest.approx(2.0, rel=1e-9)  # geometric series 1 + 1/2 + 1/4 + ...
    assert np.isfinite(h._scale) and h._scale <= 1e12


def test_refresh_period() -> None:
    h = DepthHistogram(refresh=3)
    assert [h.observe(1) for _ in range(3)] == [False, False, True]
    assert h.due
    h.mark_refreshed()
    assert not h.due and not h.observe(1)
    assert h.observations == 4


def test_histogram_law_equals_direct_law() -> None:
    rng = np.random.default_rng(1)
    h = DepthHistogram(gamma=0.97)
    depths = rng.integers(0, 3000, 500)
    for d in depths:
        h.observe(int(d))
    w = 0.97 ** np.arange(499, -1, -1)
    direct = DepthLaw.on_grid(depths, w, 3000)
    law = h.law(direct.candidates)
    np.testing.assert_allclose(law.mass, direct.mass, rtol=1e-9)
    np.testing.assert_allclose(law.moment, direct.moment, rtol=1e-9)


def test_bad_histogram_inputs() -> None:
    with pytest.raises(ValueError, match="gamma"):
        DepthHistogram(gamma=0)
    with pytest.raises(ValueError, match="refresh"):
        DepthHistogram(refresh=0)
    h = DepthHistogram()
    with pytest.raises(ValueError, match="depth"):
        h.observe(-1)
    with pytest.raises(ValueError, match="weight"):
        h.observe(3, float("nan"))


def test_evaluate_expected_worst_and_reduction() -> None:
    s = evaluate_placement([64, 128], [0, 70, 130, 200], [1, 1, 1, 1])
    assert s.expected == pytest.approx((0 + 6 + 2 + 72) / 4)
    assert s.worst == 72
    assert s.no_cache == pytest.approx(400 / 4)
    assert s.reduction == pytest.approx(100 / 20)
    assert evaluate_placement([], [10]).reduction == 1.0
    assert evaluate_placement([10], [10]).reduction == float("inf")
    with pytest.raises(ValueError, match="origin"):
        evaluate_placement([64], [3], origin=10)


def test_baselines_shapes() -> None:
    assert block_placement(300, 64) == (64, 128, 192, 256)
    with pytest.raises(ValueError, match="multiple"):
        block_placement(300, 100)
    for name, place in BASELINES.items():
        for length, budget in [(0, 4), (63, 4), (64, 4), (5000, 0), (5000, 1), (5000, 7), (5000, 500)]:
            pos = place(length, budget, 64, 0)
            assert len(pos) <= budget, name
            assert all(p % 64 == 0 and 0 < p <= length for p in pos), name
            assert list(pos) == sorted(set(pos)), name
    lg = log_placement(64 * 1000, 6)
    assert np.all(np.diff(np.diff([0, *lg])) > 0)  # gaps grow
    sq = sqrt_placement(64 * 1000, 6)
    assert np.all(np.diff(np.diff([0, *sq])) < 0)  # gaps shrink

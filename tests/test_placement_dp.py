"""The placement DP: optimal (vs exhaustive search), fast path == reference, Theorem 1, edge cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_sparse.placement import (
    HAVE_NATIVE,
    DepthLaw,
    balanced_placement,
    evaluate_placement,
    grid_candidates,
    solve_dp,
    solve_dp_python,
    solve_dp_reference,
)

SOLVERS = [solve_dp_python, solve_dp_reference] + ([solve_dp] if HAVE_NATIVE else [])


def exhaustive(law: DepthLaw, budget: int) -> float:
    """Minimum cost over every subset of at most ``budget`` candidates."""
    n = law.positions.size - 1
    best = law.cost_of_indices([])
    for m in range(1, min(budget, n) + 1):
        for combo in itertools.combinations(range(1, n + 1), m):
            best = min(best, law.cost_of_indices(list(combo)))
    return best


@st.composite
def small_instances(draw: st.DrawFn) -> tuple[DepthLaw, int]:
    grid = draw(st.sampled_from([1, 4, 64]))
    nblocks = draw(st.integers(0, 8))
    length = nblocks * grid + draw(st.integers(0, grid - 1))
    k = draw(st.integers(0, 12))
    depths = draw(st.lists(st.integers(0, length), min_size=k, max_size=k))
    weights = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.25]), min_size=k, max_size=k))
    include_end = draw(st.booleans())
    budget = draw(st.integers(0, 10))
    return DepthLaw.on_grid(depths, weights, length, grid, include_end=include_end), budget


@settings(max_examples=400, deadline=None)
@given(small_instances())
def test_dp_equals_exhaustive_search(inst: tuple[DepthLaw, int]) -> None:
    law, budget = inst
    truth = exhaustive(law, budget)
    for solve in SOLVERS:
        res = solve(law, budget)
        assert res.cost == pytest.approx(truth, rel=1e-9, abs=1e-9), solve.__name__
        assert len(res.positions) <= budget
        assert list(res.positions) == sorted(set(res.positions))
        assert set(res.positions) <= set(law.candidates.tolist())
        # the reported cost is the true cost of the returned positions
        assert law.cost_of_indices(law.indices_of(res.positions)) == pytest.approx(res.cost, abs=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_hull_equals_quadratic_reference_on_larger_instances(seed: int) -> None:
    rng = np.random.default_rng(seed)
    length = int(rng.integers(2_000, 40_000))
    kind = seed % 3
    if kind == 0:
        depths = rng.integers(0, length + 1, size=500)
    elif kind == 1:  # clustered, like documents with questions
        centres = rng.integers(0, length, size=5)
        depths = np.clip(rng.choice(centres, 800) + rng.integers(-50, 50, 800), 0, length)
    else:  # heavy tail with many empty blocks
        depths = np.minimum((rng.pareto(1.2, 300) * 500).astype(int), length)
    weights = rng.random(depths.size) ** 2
    law = DepthLaw.on_grid(depths, weights, length, 64)
    for budget in (1, 3, 8, 33, 64):
        ref = solve_dp_reference(law, budget)
        for solve in SOLVERS[:1] + SOLVERS[2:]:
            got = solve(law, budget)
            assert got.cost == pytest.approx(ref.cost, rel=1e-9, abs=1e-6)
            assert len(got.positions) == len(ref.positions)


@pytest.mark.parametrize("nblocks,budget", [(10, 1), (10, 3), (31, 5), (100, 7), (64, 63), (257, 16)])
def test_balanced_is_optimal_under_uniform_law(nblocks: int, budget: int) -> None:
    """Theorem 1: uniform mass on the grid points 0, g, ..., n*g -> groups differ by at most one.

    Splitting the n+1 points into M+1 runs of sizes s_i costs g * sum s_i (s_i - 1) / 2, minimised
    by q = (n+1) // (M+1) with r = (n+1) % (M+1) runs of size q+1.
    """
    g = 64
    length = nblocks * g
    depths = np.arange(0, nblocks + 1) * g
    law = DepthLaw.on_grid(depths, None, length, g)
    q, r = divmod(nblocks + 1, budget + 1)
    closed_form = g * (r * (q + 1) * q / 2 + (budget + 1 - r) * q * (q - 1) / 2)
    res = solve_dp(law, budget)
    assert res.cost == pytest.approx(closed_form)
    gaps = np.diff([0, *res.positions, length + g]) // g
    assert gaps.max() - gaps.min() <= 1
    bal = balanced_placement(length, budget, g)
    assert len(bal) == budget
    assert law.cost_of_indices(law.indices_of(bal)) == pytest.approx(closed_form)
    bal_gaps = np.diff([0, *bal, length + g]) // g
    assert bal_gaps.max() - bal_gaps.min() <= 1


def test_all_zero_histogram_and_empty_prefix() -> None:
    for solve in SOLVERS:
        law = DepthLaw.on_grid([], None, 4096)
        res = solve(law, 8)
        assert res.positions == () and res.cost == 0.0 and res.expected == 0.0
        res = solve(DepthLaw.on_grid([5, 10], None, 0), 4)
        assert res.positions == ()
        assert res.cost == pytest.approx(15.0)


def test_budget_above_useful_positions_uses_each_once() -> None:
    law = DepthLaw.on_grid([100, 100, 700, 2000], None, 4096)
    for solve in SOLVERS:
        res = solve(law, 50)
        assert res.positions == (64, 640, 1984)
        assert res.cost == pytest.approx((100 - 64) * 2 + (700 - 640) + (2000 - 1984))


def test_bad_budget_and_bad_law_inputs() -> None:
    law = DepthLaw.on_grid([100], None, 1000)
    for solve in SOLVERS:
        for bad in (-1, 1.5, "3", True):
            with pytest.raises(ValueError, match="budget"):
                solve(law, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights"):
        DepthLaw.on_grid([1, 2], [1.0, -1.0], 100)
    with pytest.raises(ValueError, match="differ"):
        DepthLaw.on_grid([1, 2], [1.0], 100)
    with pytest.raises(ValueError, match="increasing"):
        DepthLaw.from_depths([1], None, [64, 64])
    with pytest.raises(ValueError, match="grid"):
        grid_candidates(100, 0)
    with pytest.raises(ValueError, match="not candidates"):
        law.indices_of([65])


def test_origin_and_end_candidate() -> None:
    """Per-edge use: depths below the origin are dropped, the edge end can be a candidate."""
    law = DepthLaw.on_grid([1000, 1100, 1100, 1100, 5], None, 1100, 64, origin=960, include_end=True)
    assert law.origin == 960 and law.candidates.tolist() == [1024, 1088, 1100]
    res = solve_dp(law, 1)
    assert res.positions == (1100,)
    stats = evaluate_placement(res.positions, [1000, 1100, 1100, 1100], origin=960)
    assert stats.expected == pytest.approx(40 / 4)


def test_dp_beats_or_ties_every_baseline_on_its_own_law() -> None:
    from sglang_sparse.placement import BASELINES

    rng = np.random.default_rng(7)
    length = 20_000
    depths = np.concatenate([rng.normal(12_000, 300, 400), rng.integers(0, length, 100)]).clip(0, length)
    law = DepthLaw.on_grid(depths, None, length)
    for budget in (1, 2, 4, 8, 16):
        dp = solve_dp(law, budget)
        for name, place in BASELINES.items():
            pos = place(length, budget, 64, 0)
            assert len(pos) <= budget
            assert dp.cost <= law.cost_of_indices(law.indices_of(pos)) + 1e-6, name

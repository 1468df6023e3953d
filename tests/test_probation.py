"""ProbationPlanner: where a new leaf's first-sight guesses go, given the plan's own positions."""

from __future__ import annotations

from sglang_sparse.policy.choose import ProbationPlanner


def _planner(observed: list[int]) -> ProbationPlanner:
    p = ProbationPlanner(0.99, grid=64, budget=2)
    for d in observed:
        p.observe(d)
    return p


def test_guesses_go_below_the_deepest_planned_position_in_the_range() -> None:
    """A planned state at 896 of a 976-token prompt serves every divergence past it: the two
    guesses hedge the part below it, as if the range ended there (placed over the whole range,
    the second guess landed at 640, above a divergence at 600 that 576 or 512 would serve)."""
    p = _planner([192, 200, 200, 256, 300, 100, 120, 150])
    got = p.positions(0, 976, exclude=[896, 979])
    assert got == p.positions(0, 896), got
    assert len(got) == 2 and max(got) <= 576, got
    # positions outside (start, end) do not restrict: the last-token state, the match itself
    assert p.positions(0, 976, exclude=[979]) == p.positions(0, 976)
    assert p.positions(300, 976, exclude=[256, 979]) == p.positions(300, 976)


def test_planned_positions_are_never_guessed_and_the_budget_is_kept() -> None:
    p = _planner([])
    free = p.positions(0, 976)
    assert len(free) == 2
    got = p.positions(0, 976, exclude=[free[0], 960])
    assert free[0] not in got and len(got) == 2 and all(64 <= q < 960 and q % 64 == 0 for q in got), got
    assert _planner([]).positions(0, 60) == []  # no grid position in range

"""Data-independent checkpoint placements (the baselines of the DP).

Every function takes the prefix ``length`` (tokens), a ``budget`` (max checkpoints) and the chunk
``grid`` (tokens), and returns increasing token positions on the grid in ``(origin, length]``;
at most ``budget`` of them and never more than the grid holds. Duplicate positions that rounding
produces are merged, so a baseline may use fewer checkpoints than its budget.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .dp import DEFAULT_GRID, grid_candidates

Placer = Callable[[int, int, int, int], tuple[int, ...]]
"""Signature shared by the baselines: ``(length, budget, grid, origin) -> positions``."""


def _snap(raw: np.ndarray, length: int, grid: int, origin: int) -> tuple[int, ...]:
    """Round token positions down to the grid, keep those in (origin, length], dedupe."""
    cands = grid_candidates(length, grid, origin)
    if cands.size == 0 or raw.size == 0:
        return ()
    snapped = (np.floor(raw / grid) * grid).astype(np.int64)
    snapped = snapped[(snapped > origin) & (snapped <= length)]
    return tuple(int(x) for x in np.unique(snapped))


def _check(length: int, budget: int, grid: int) -> None:
    if length < 0 or budget < 0 or grid <= 0:
        raise ValueError(f"need length >= 0, budget >= 0, grid > 0; got {length}, {budget}, {grid}")


def block_placement(
    length: int, block_size: int, grid: int = DEFAULT_GRID, origin: int = 0
) -> tuple[int, ...]:
    """Block caching (vLLM-style): a checkpoint every ``block_size`` tokens (a grid multiple)."""
    if block_size <= 0 or block_size % grid:
        raise ValueError(f"block_size must be a positive multiple of the grid ({grid}), got {block_size}")
    _check(length, 0, grid)
    first = (origin // block_size + 1) * block_size
    return tuple(range(first, length + 1, block_size))


def block_budget_placement(
    length: int, budget: int, grid: int = DEFAULT_GRID, origin: int = 0
) -> tuple[int, ...]:
    """Block caching with the smallest grid-multiple block size that fits ``budget`` checkpoints."""
    _check(length, budget, grid)
    n = grid_candidates(length, grid, origin).size
    if budget == 0 or n == 0:
        return ()
    block = grid * int(np.ceil(n / budget))
    return block_placement(length, block, grid, origin)[:budget]


def balanced_placement(
    length: int, budget: int, grid: int = DEFAULT_GRID, origin: int = 0
) -> tuple[int, ...]:
    """``budget`` checkpoints evenly spaced: on the grid points ``origin, c_1..c_n`` the groups each
    checkpoint serves differ in size by at most one (optimal for a uniform law, Theorem 1)."""
    _check(length, budget, grid)
    cands = grid_candidates(length, grid, origin)
    n = cands.size
    m = min(budget, n)
    if m == 0:
        return ()
    k = np.arange(1, m + 1)
    idx = (k * (n + 1)) // (m + 1)  # index into [origin, *cands]; always >= 1 since m <= n
    return tuple(int(x) for x in cands[idx - 1])


def log_placement(length: int, budget: int, grid: int = DEFAULT_GRID, origin: int = 0) -> tuple[int, ...]:
    """Log-spaced: gaps doubling from the start (positions g, 3g, 7g, ... scaled to end at the last
    grid point), i.e. dense near the origin and sparse near the end."""
    _check(length, budget, grid)
    cands = grid_candidates(length, grid, origin)
    if budget == 0 or cands.size == 0:
        return ()
    span = float(cands[-1] - origin)
    m = min(budget, 60)
    k = np.arange(1, m + 1, dtype=np.float64)
    raw = origin + span * (np.exp2(k) - 1.0) / (2.0**m - 1.0)
    return _snap(raw, length, grid, origin)


def sqrt_placement(length: int, budget: int, grid: int = DEFAULT_GRID, origin: int = 0) -> tuple[int, ...]:
    """Square-root spacing: position ``k`` at ``span * sqrt(k / M)``, gaps shrinking toward the end
    (dense where long overlaps land)."""
    _check(length, budget, grid)
    cands = grid_candidates(length, grid, origin)
    if budget == 0 or cands.size == 0:
        return ()
    span = float(cands[-1] - origin)
    k = np.arange(1, budget + 1, dtype=np.float64)
    return _snap(origin + span * np.sqrt(k / budget), length, grid, origin)


def last_only_placement(
    length: int, budget: int, grid: int = DEFAULT_GRID, origin: int = 0
) -> tuple[int, ...]:
    """One checkpoint at the deepest grid position (what a plain prefix cache keeps)."""
    _check(length, budget, grid)
    cands = grid_candidates(length, grid, origin)
    return (int(cands[-1]),) if budget > 0 and cands.size else ()


BASELINES: dict[str, Placer] = {
    "block": block_budget_placement,
    "balanced": balanced_placement,
    "log": log_placement,
    "sqrt": sqrt_placement,
    "last": last_only_placement,
}
"""Budgeted baselines by name."""

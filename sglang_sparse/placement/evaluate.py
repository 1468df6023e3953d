"""Expected and worst-case recompute of any checkpoint set under observed depths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .dp import weighted_depths


@dataclass(frozen=True)
class RecomputeStats:
    """Recompute of a checkpoint set, in tokens.

    ``expected``: weight-averaged ``d - c(d)``; ``worst``: the largest ``d - c(d)`` over depths with
    positive weight; ``no_cache``: weight-averaged ``d - origin`` (nothing checkpointed);
    ``reduction``: ``no_cache / expected`` (inf when expected is 0 and no_cache > 0, 1 when both 0)."""

    expected: float
    worst: float
    no_cache: float

    @property
    def reduction(self) -> float:
        if self.expected > 0:
            return self.no_cache / self.expected
        return float("inf") if self.no_cache > 0 else 1.0


def resume_points(positions: Sequence[int] | np.ndarray, depths: np.ndarray, origin: int = 0) -> np.ndarray:
    """Deepest checkpoint ``c <= d`` for every depth (``origin`` when there is none)."""
    pos = np.unique(np.asarray(positions, dtype=np.int64))
    pos = pos[pos > origin]
    d = np.asarray(depths, dtype=np.float64)
    k = np.searchsorted(pos, d, side="right")
    return np.where(k > 0, pos[np.maximum(k - 1, 0)] if pos.size else origin, origin).astype(np.float64)


def evaluate_placement(
    positions: Sequence[int] | np.ndarray,
    depths: Sequence[float] | np.ndarray,
    weights: Sequence[float] | np.ndarray | None = None,
    origin: int = 0,
) -> RecomputeStats:
    """Exact recompute statistics of checkpoint ``positions`` for ``depths`` (tokens >= origin)."""
    d, w = weighted_depths(depths, weights)
    if np.any(d < origin):
        raise ValueError(f"depths must be >= origin ({origin})")
    mask = w > 0
    d, w = d[mask], w[mask]
    if d.size == 0:
        return RecomputeStats(0.0, 0.0, 0.0)
    r = d - resume_points(positions, d, origin)
    tot = w.sum()
    return RecomputeStats(float((w * r).sum() / tot), float(r.max()), float((w * (d - origin)).sum() / tot))

"""Overlap-depth laws binned onto candidate checkpoint positions.

Vocabulary (all positions and depths are *token counts* from the start of the sequence):

* A **checkpoint at position p** is the exact recurrent state after the first ``p`` tokens.
* A future request **overlaps to depth d** when its first ``d`` tokens equal the cached prefix.
  It resumes from the deepest checkpoint ``c <= d`` and recomputes ``d - c`` recurrent tokens.
* The **origin** is a free resume point below every candidate (0 for a whole prefix, or the
  position of a checkpoint that an ancestor edge already holds). Depths below the first chosen
  checkpoint resume there.

A :class:`DepthLaw` keeps, for each interval between consecutive candidates, the total weight and
the weighted sum of depths (first moment). That is exactly enough to evaluate the expected
recompute of any checkpoint set drawn from the candidates:
``cost = sum_bins (moment[i] - position_of_server(i) * mass[i])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_GRID = 64
"""SGLang's recurrent-state chunk size: checkpoints live on multiples of 64 tokens."""


def grid_candidates(
    length: int, grid: int = DEFAULT_GRID, origin: int = 0, include_end: bool = False
) -> np.ndarray:
    """Candidate checkpoint positions in ``(origin, length]``: multiples of ``grid`` (absolute).

    With ``include_end`` the position ``length`` itself is a candidate even when it is off the
    grid (the state after the last token, which an engine can always capture for free).
    """
    if grid <= 0:
        raise ValueError(f"grid must be a positive number of tokens, got {grid}")
    if length < 0 or origin < 0:
        raise ValueError(f"length and origin must be >= 0, got length={length}, origin={origin}")
    first = (origin // grid + 1) * grid
    cands = np.arange(first, length + 1, grid, dtype=np.int64)
    if include_end and length > origin and (cands.size == 0 or cands[-1] != length):
        cands = np.append(cands, np.int64(length))
    return cands


@dataclass(frozen=True)
class DepthLaw:
    """A depth distribution aggregated onto ``positions = [origin, *candidates]``.

    Invariants:
      * ``positions`` is strictly increasing int64; ``positions[0]`` is the origin.
      * ``mass[i]`` (>= 0) is the weight of depths ``d`` with ``positions[i] <= d < positions[i+1]``
        (the last bin is unbounded above); depths below the origin are dropped at construction.
      * ``moment[i]`` is the weighted sum of those depths (tokens x weight).
      * ``max_depth[i]`` is the largest depth with positive weight in bin ``i`` (-1 when empty).
    Weights need not sum to one; :attr:`total` gives the normaliser.
    """

    positions: np.ndarray
    mass: np.ndarray
    moment: np.ndarray
    max_depth: np.ndarray

    @property
    def origin(self) -> int:
        return int(self.positions[0])

    @property
    def candidates(self) -> np.ndarray:
        return self.positions[1:]

    @property
    def total(self) -> float:
        return float(self.mass.sum())

    @staticmethod
    def from_depths(
        depths: Sequence[float] | np.ndarray,
        weights: Sequence[float] | np.ndarray | None,
        candidates: Sequence[int] | np.ndarray,
        origin: int = 0,
    ) -> DepthLaw:
        """Bin observed depths (tokens) with non-negative weights onto ``candidates`` (> origin)."""
        d = np.asarray(depths, dtype=np.float64).reshape(-1)
        w = np.ones_like(d) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape != d.shape:
            raise ValueError(f"depths and weights differ in length: {d.size} vs {w.size}")
        if np.any(w < 0) or not np.all(np.isfinite(w)):
            raise ValueError("weights must be finite and >= 0")
        if np.any(~np.isfinite(d)):
            raise ValueError("depths must be finite")
        cand = np.asarray(candidates, dtype=np.int64).reshape(-1)
        if cand.size and (np.any(np.diff(cand) <= 0) or cand[0] <= origin):
            raise ValueError("candidates must be strictly increasing and > origin")
        positions = np.concatenate([np.array([origin], dtype=np.int64), cand])
        keep = (d >= origin) & (w > 0)
        d, w = d[keep], w[keep]
        idx = np.searchsorted(positions, d, side="right") - 1
        n = positions.size
        mass = np.bincount(idx, weights=w, minlength=n).astype(np.float64)
        moment = np.bincount(idx, weights=w * d, minlength=n).astype(np.float64)
        max_depth = np.full(n, -1.0)
        if d.size:
            np.maximum.at(max_depth, idx, d)
        return DepthLaw(positions, mass, moment, max_depth)

    @staticmethod
    def on_grid(
        depths: Sequence[float] | np.ndarray,
        weights: Sequence[float] | np.ndarray | None,
        length: int,
        grid: int = DEFAULT_GRID,
        origin: int = 0,
        include_end: bool = False,
    ) -> DepthLaw:
        """:meth:`from_depths` with the grid candidates of a prefix of ``length`` tokens."""
        return DepthLaw.from_depths(
            depths, weights, grid_candidates(length, grid, origin, include_end), origin
        )

    def server_index(self, chosen: Sequence[int] | np.ndarray) -> np.ndarray:
        """For every bin, the index (into ``positions``) of the deepest chosen position at or below it.

        ``chosen`` are indices into ``positions`` (index 0, the origin, is always available).
        """
        flag = np.zeros(self.positions.size, dtype=bool)
        flag[0] = True
        flag[np.asarray(chosen, dtype=np.int64)] = True
        idx = np.where(flag, np.arange(self.positions.size), 0)
        return np.maximum.accumulate(idx)

    def cost_of_indices(self, chosen: Sequence[int] | np.ndarray) -> float:
        """Weighted recompute (tokens x weight) when checkpoints sit at ``positions[chosen]``."""
        server = self.positions[self.server_index(chosen)].astype(np.float64)
        return float(np.sum(self.moment - server * self.mass))

    def indices_of(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Map checkpoint positions to candidate indices; raise if one is not a candidate."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        idx = np.searchsorted(self.positions, pos)
        bad = (idx >= self.positions.size) | (self.positions[np.minimum(idx, self.positions.size - 1)] != pos)
        if np.any(bad):
            raise ValueError(f"positions {pos[bad].tolist()} are not candidates of this law")
        return idx

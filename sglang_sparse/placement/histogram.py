"""Exponentially weighted overlap-depth histogram with a refresh period.

Each observation ``observe(depth)`` gets weight 1 and every older one is multiplied by ``gamma``
(so an observation ``k`` steps old weighs ``gamma**k``). Instead of touching every bin per step,
the histogram stores ``weight * scale`` with a growing scale factor and renormalises in one pass
when the scale exceeds ``_RESCALE_AT``; that pass also drops bins whose weight fell below
``_PRUNE_BELOW`` of the total. Observing is therefore O(1) amortised and memory stays bounded by
the depths seen in the last ~``log(_RESCALE_AT) / log(1/gamma)`` observations.

Depths are exact integer token counts, so the law can be binned onto any candidate set later.
The histogram counts observations and reports when a re-plan is due (every ``refresh``).
"""

from __future__ import annotations

import math

import numpy as np

from .law import DepthLaw

_RESCALE_AT = 1e12
_PRUNE_BELOW = 1e-9


class DepthHistogram:
    """EW histogram of overlap depths (tokens). Deterministic: it depends only on the order of
    observations, never on wall time."""

    __slots__ = ("gamma", "refresh", "_bins", "_scale", "_since_refresh", "_n")

    def __init__(self, gamma: float = 0.99, refresh: int = 10) -> None:
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if refresh < 1:
            raise ValueError(f"refresh must be >= 1 observation, got {refresh}")
        self.gamma = float(gamma)
        self.refresh = int(refresh)
        self._bins: dict[int, float] = {}
        self._scale = 1.0
        self._since_refresh = 0
        self._n = 0

    def copy(self) -> DepthHistogram:
        """An independent, bit-exact copy (O(bins); no ``copy.deepcopy`` machinery)."""
        out = type(self).__new__(type(self))
        out.gamma, out.refresh, out._bins = self.gamma, self.refresh, dict(self._bins)
        out._scale, out._since_refresh, out._n = self._scale, self._since_refresh, self._n
        return out

    def observe(self, depth: int, weight: float = 1.0) -> bool:
        """Record one overlap depth (tokens >= 0). Returns True when a re-plan is due."""
        if depth < 0:
            raise ValueError(f"depth must be >= 0 tokens, got {depth}")
        if weight < 0 or not math.isfinite(weight):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        if self.gamma < 1.0:
            self._scale /= self.gamma
        d = int(depth)
        self._bins[d] = self._bins.get(d, 0.0) + weight * self._scale
        self._n += 1
        self._since_refresh += 1
        if self._scale > _RESCALE_AT:
            self._rescale()
        return self._since_refresh >= self.refresh

    def _rescale(self) -> None:
        s = self._scale
        total = sum(self._bins.values()) / s
        floor = total * _PRUNE_BELOW
        self._bins = {d: w / s for d, w in self._bins.items() if w / s >= floor}
        self._scale = 1.0

    @property
    def due(self) -> bool:
        """True when ``refresh`` observations arrived since the last :meth:`mark_refreshed`."""
        return self._since_refresh >= self.refresh

    def mark_refreshed(self) -> None:
        self._since_refresh = 0

    @property
    def observations(self) -> int:
        """Number of observations ever recorded."""
        return self._n

    @property
    def total(self) -> float:
        """Current total (decayed) weight."""
        return sum(self._bins.values()) / self._scale

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Distinct depths (int64, increasing) and their current weights."""
        if not self._bins:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
        d = np.fromiter(self._bins.keys(), dtype=np.int64, count=len(self._bins))
        w = np.fromiter(self._bins.values(), dtype=np.float64, count=len(self._bins)) / self._scale
        order = np.argsort(d)
        return d[order], w[order]

    def law(self, candidates: np.ndarray, origin: int = 0) -> DepthLaw:
        """The current law binned onto ``candidates`` (token positions > ``origin``)."""
        d, w = self.items()
        return DepthLaw.from_depths(d, w, candidates, origin)

    def __len__(self) -> int:
        return len(self._bins)

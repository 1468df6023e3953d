"""Exact checkpoint placement: one-sided weighted k-median on a line -- the depth law (the problem's
input), where it comes from (an EW histogram) and the exact DP that solves it.

Problem. Given a :class:`DepthLaw` (bins at ``positions``, the first
being the free origin) and a budget of ``M`` checkpoints, choose ``M`` candidate positions
minimising the weighted recompute ``sum_i (moment[i] - P[server(i)] * mass[i])``, where
``server(i)`` is the deepest chosen position at or below bin ``i``.

Reduction. Only candidates whose bin has positive mass are useful: a checkpoint on an empty bin can
be moved up to the next non-empty bin it serves (never worse) or dropped. Adding a useful
checkpoint strictly lowers the cost, so the optimum uses exactly ``min(M, #useful)`` of them.

Recurrence over the compressed points ``0..n-1`` with prefix sums ``SM`` (moments) and ``SW``
(masses), ``G[m][a]`` = cost of bins ``[0, a)`` with ``m`` checkpoints, the last one at ``a``::

    G[0][0] = 0
    G[m][a] = SM[a] + min_{a' < a} ( G[m-1][a'] - SM[a'] + P[a'] * SW[a'] )  -  P[a'] * SW[a]
    answer  = G[m*][a] + (SM[n] - SM[a]) - P[a] * (SW[n] - SW[a])   minimised over a

Each ``a'`` contributes a line of slope ``-P[a']`` (strictly decreasing in ``a'``) queried at
``SW[a]`` (non-decreasing in ``a``; ties on zero mass cannot occur after compression but are
handled anyway), so a monotone convex-hull trick evaluates a layer in O(n): O(n·M) in all.

Three implementations, tested against each other and against exhaustive search:
``solve_dp`` (native C fast path when built, else the pure-Python hull),
``solve_dp_python`` (pure-Python hull) and ``solve_dp_reference`` (textbook O(n²·M), numpy).

Vocabulary (all positions and depths are *token counts* from the start of the sequence):

* A **checkpoint at position p** is the exact recurrent state after the first ``p`` tokens.
* A future request **overlaps to depth d** when its first ``d`` tokens equal the cached prefix.
  It resumes from the deepest checkpoint ``c <= d`` and recomputes ``d - c`` recurrent tokens.
* The **origin** is a free resume point below every candidate (0 for a whole prefix, or the
  position of a checkpoint that an ancestor edge already holds). Depths below the first chosen
  checkpoint resume there.

A :class:`DepthLaw` keeps, per interval between consecutive candidates, the total weight and the
first moment: exactly enough to evaluate the cost above for any checkpoint set of its candidates.

Where the law comes from: :class:`DepthHistogram`, an exponentially weighted histogram of overlap
depths with a refresh period. Each observation ``observe(depth)`` gets weight 1 and every older one
is multiplied by ``gamma`` (so an observation ``k`` steps old weighs ``gamma**k``). Instead of
touching every bin per step, the histogram stores ``weight * scale`` with a growing scale factor and
renormalises in one pass when the scale exceeds ``_RESCALE_AT``; that pass also drops bins whose
weight fell below ``_PRUNE_BELOW`` of the total. Observing is therefore O(1) amortised and memory
stays bounded by the depths seen in the last ~``log(_RESCALE_AT) / log(1/gamma)`` observations.
Depths are exact integer token counts, so the law can be binned onto any candidate set later. The
histogram counts observations and reports when a re-plan is due (every ``refresh``).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_GRID = 64
"""SGLang's recurrent-state chunk size: checkpoints live on multiples of 64 tokens."""


def grid_candidates(
    length: int, grid: int = DEFAULT_GRID, origin: int = 0, include_end: bool = False
) -> np.ndarray:
    """Candidate checkpoint positions in ``(origin, length]``: multiples of ``grid`` (absolute). With
    ``include_end`` the position ``length`` itself is a candidate even when it is off the grid (the
    state after the last token, which an engine can always capture for free)."""
    if grid <= 0:
        raise ValueError(f"grid must be a positive number of tokens, got {grid}")
    if length < 0 or origin < 0:
        raise ValueError(f"length and origin must be >= 0, got length={length}, origin={origin}")
    first = (origin // grid + 1) * grid
    cands = np.arange(first, length + 1, grid, dtype=np.int64)
    if include_end and length > origin and (cands.size == 0 or cands[-1] != length):
        cands = np.append(cands, np.int64(length))
    return cands


def weighted_depths(
    depths: Sequence[float] | np.ndarray, weights: Sequence[float] | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """``depths`` (tokens) and their ``weights`` as float64 vectors of one length (weight 1 each
    when ``weights`` is None); raises ValueError when the lengths differ."""
    d = np.asarray(depths, dtype=np.float64).reshape(-1)
    w = np.ones_like(d) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != d.shape:
        raise ValueError(f"depths and weights differ in length: {d.size} vs {w.size}")
    return d, w


@dataclass(frozen=True)
class DepthLaw:
    """A depth distribution aggregated onto ``positions = [origin, *candidates]``.

    Invariants:
      * ``positions`` is strictly increasing int64; ``positions[0]`` is the origin.
      * ``mass[i]`` (>= 0) is the weight of depths ``d`` with ``positions[i] <= d < positions[i+1]``
        (the last bin is unbounded above); depths below the origin are dropped at construction.
      * ``moment[i]`` is the weighted sum of those depths (tokens x weight).
      * ``max_depth[i]`` is the largest depth with positive weight in bin ``i`` (-1 when empty).
    Weights need not sum to one; :attr:`total` gives the normaliser."""

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
        d, w = weighted_depths(depths, weights)
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
        ``chosen`` are indices into ``positions`` (index 0, the origin, is always available)."""
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


@dataclass(frozen=True)
class Placement:
    """A checkpoint set and its cost under the law it was solved for. ``positions`` are increasing token
    positions (candidates of the law, origin excluded); ``cost`` is the weighted recompute in tokens x
    weight; ``total`` the law's total weight."""

    positions: tuple[int, ...]
    cost: float
    total: float

    @property
    def expected(self) -> float:
        """Expected recompute per request, in tokens (0 for an empty law)."""
        return self.cost / self.total if self.total > 0 else 0.0


def _compress(law: DepthLaw) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Points (origin + useful candidates): original indices, positions, prefix sums SM, SW."""
    keep = np.flatnonzero(law.mass > 0)
    keep = keep[keep > 0]
    idx = np.concatenate([[0], keep]).astype(np.int64)
    p = law.positions[idx].astype(np.float64)
    sm = np.concatenate([[0.0], np.cumsum(law.moment[idx])])
    sw = np.concatenate([[0.0], np.cumsum(law.mass[idx])])
    return idx, p, sm, sw


def _check_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer) or budget < 0:
        raise ValueError(f"budget must be an integer >= 0 checkpoints, got {budget!r}")
    return int(budget)


def _finish(law: DepthLaw, chosen_idx: np.ndarray) -> Placement:
    chosen_idx = np.sort(np.asarray(chosen_idx, dtype=np.int64))
    return Placement(
        tuple(int(x) for x in law.positions[chosen_idx]), law.cost_of_indices(chosen_idx), law.total
    )


def solve_dp_python(law: DepthLaw, budget: int) -> Placement:
    """Optimal placement by the monotone convex-hull trick in pure Python: O(n·M)."""
    budget = _check_budget(budget)
    idx, p, sm, sw = _compress(law)
    n = p.size
    mstar = min(budget, n - 1)
    if mstar == 0:
        return _finish(law, np.empty(0, dtype=np.int64))
    inf = float("inf")
    prev = [inf] * n
    prev[0] = 0.0
    parent = np.zeros((mstar + 1, n), dtype=np.int64)
    pl, sml, swl = p.tolist(), sm.tolist(), sw.tolist()
    for m in range(1, mstar + 1):
        cur = [inf] * n
        hk: list[float] = []
        hb: list[float] = []
        hi: list[int] = []
        ptr = 0
        par = parent[m]
        for a in range(m, n):
            ap = a - 1
            g = prev[ap]
            if g < inf:
                k3 = -pl[ap]
                b3 = g - sml[ap] + pl[ap] * swl[ap]
                while len(hk) >= 2:
                    k1, b1, k2, b2 = hk[-2], hb[-2], hk[-1], hb[-1]
                    if (b3 - b1) * (k1 - k2) <= (b2 - b1) * (k1 - k3):
                        hk.pop()
                        hb.pop()
                        hi.pop()
                    else:
                        break
                hk.append(k3)
                hb.append(b3)
                hi.append(ap)
                if ptr >= len(hk):
                    ptr = len(hk) - 1
            if not hk:
                continue
            x = swl[a]
            while ptr + 1 < len(hk) and hk[ptr + 1] * x + hb[ptr + 1] <= hk[ptr] * x + hb[ptr]:
                ptr += 1
            cur[a] = sml[a] + hk[ptr] * x + hb[ptr]
            par[a] = hi[ptr]
        prev = cur
    return _backtrack(law, idx, p, sm, sw, np.asarray(prev), parent, mstar)


def _backtrack(
    law: DepthLaw,
    idx: np.ndarray,
    p: np.ndarray,
    sm: np.ndarray,
    sw: np.ndarray,
    last: np.ndarray,
    parent: np.ndarray,
    mstar: int,
) -> Placement:
    n = p.size
    a_all = np.arange(n)
    tail = (sm[n] - sm[a_all]) - p * (sw[n] - sw[a_all])
    total = np.where(np.isfinite(last), last + tail, np.inf)
    a = int(np.argmin(total))
    chosen = []
    for m in range(mstar, 0, -1):
        chosen.append(a)
        a = int(parent[m][a])
    return _finish(law, idx[np.asarray(chosen, dtype=np.int64)])


def solve_dp_reference(law: DepthLaw, budget: int) -> Placement:
    """Textbook O(n²·M) dynamic program over *all* candidates (no compression), numpy per layer."""
    budget = _check_budget(budget)
    p = law.positions.astype(np.float64)
    n = p.size
    sm = np.concatenate([[0.0], np.cumsum(law.moment)])
    sw = np.concatenate([[0.0], np.cumsum(law.mass)])
    mstar = min(budget, n - 1)
    # seg[a', a] = cost of bins [a', a) served by position a' (only a' < a is used).
    seg = (sm[None, :n] - sm[:n, None]) - p[:, None] * (sw[None, :n] - sw[:n, None])
    lower = np.tril(np.ones((n, n), dtype=bool))  # a' >= a is not allowed
    seg = np.where(lower, np.inf, seg)
    g = np.full(n, np.inf)
    g[0] = 0.0
    tail = (sm[n] - sm[:n]) - p * (sw[n] - sw[:n])
    best_cost, best_m, parents = float(g[0] + tail[0]), 0, []
    layers = [g]
    for m in range(1, mstar + 1):
        tot = layers[-1][:, None] + seg
        par = np.argmin(tot, axis=0)
        g = tot[par, np.arange(n)]
        parents.append(par)
        layers.append(g)
        c = float(np.min(g + tail))
        if c < best_cost - 1e-12 * max(1.0, abs(best_cost)):
            best_cost, best_m = c, m
    if best_m == 0:
        return _finish(law, np.empty(0, dtype=np.int64))
    a = int(np.argmin(layers[best_m] + tail))
    chosen = []
    for m in range(best_m, 0, -1):
        chosen.append(a)
        a = int(parents[m - 1][a])
    return _finish(law, np.asarray(chosen, dtype=np.int64))


def _load_native() -> ctypes.CDLL | None:
    try:  # the extension module only carries the C symbol; ctypes loads its file
        from ._cht_native import __file__ as native_path  # type: ignore[import-not-found]
    except ImportError:
        return None
    lib = ctypes.CDLL(native_path)
    fn = lib.spc_cht_solve
    dp, ip = ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [ctypes.c_int64, dp, dp, dp, ctypes.c_int64, ip, dp, ip, ip]
    fn.restype = ctypes.c_int
    return lib


_NATIVE = _load_native()
HAVE_NATIVE = _NATIVE is not None
"""True when the C fast path (``_cht_native``) was built at install time."""


def solve_dp_native(law: DepthLaw, budget: int) -> Placement:
    """The same hull algorithm in C (built by ``pip install``); raises if it was not built."""
    if _NATIVE is None:
        raise RuntimeError("the native DP was not built; reinstall with a C compiler (pip install -e .)")
    budget = _check_budget(budget)
    idx, p, sm, sw = _compress(law)
    n = p.size
    mstar = min(budget, n - 1)
    if mstar == 0:
        return _finish(law, np.empty(0, dtype=np.int64))
    parent = np.zeros((mstar + 1) * n, dtype=np.int64)
    work = np.empty(2 * n, dtype=np.float64)
    hull = np.empty(n, dtype=np.int64)
    chosen = np.empty(mstar, dtype=np.int64)
    dptr, iptr = ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int64)
    rc = _NATIVE.spc_cht_solve(
        n,
        p.ctypes.data_as(dptr),
        sm.ctypes.data_as(dptr),
        sw.ctypes.data_as(dptr),
        mstar,
        parent.ctypes.data_as(iptr),
        work.ctypes.data_as(dptr),
        hull.ctypes.data_as(iptr),
        chosen.ctypes.data_as(iptr),
    )
    if rc != 0:
        raise RuntimeError(f"native DP failed with code {rc}")
    return _finish(law, idx[chosen])


def solve_dp(law: DepthLaw, budget: int) -> Placement:
    """Optimal checkpoint placement for ``law`` with at most ``budget`` checkpoints, O(n·M). Returns
    ``min(budget, #candidates with positive mass)`` positions; with an all-zero law (nothing observed)
    it returns no positions and zero cost."""
    return solve_dp_native(law, budget) if _NATIVE is not None else solve_dp_python(law, budget)

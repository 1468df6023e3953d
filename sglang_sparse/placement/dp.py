"""Exact checkpoint placement: one-sided weighted k-median on a line.

Problem. Given a :class:`~sglang_sparse.placement.law.DepthLaw` (bins at ``positions``, the first
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
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .law import DepthLaw


@dataclass(frozen=True)
class Placement:
    """A checkpoint set and its cost under the law it was solved for.

    ``positions`` are increasing token positions (candidates of the law, origin excluded);
    ``cost`` is the weighted recompute in tokens x weight; ``total`` the law's total weight.
    """

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
    """Optimal checkpoint placement for ``law`` with at most ``budget`` checkpoints, O(n·M).

    Returns ``min(budget, #candidates with positive mass)`` positions; with an all-zero law
    (nothing observed) it returns no positions and zero cost.
    """
    return solve_dp_native(law, budget) if _NATIVE is not None else solve_dp_python(law, budget)

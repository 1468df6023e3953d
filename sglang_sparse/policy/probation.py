"""Probation states: where a *new* leaf keeps states before any request has shown where it diverges.

A request that creates a leaf is the first sight of its sequence: no edge histogram and, for a new
prompt family, no tail-prior observation says where the next request on it will diverge, so
Marconi-style admission keeps only the branch point and the last token, and the second request on
a new prefix recomputes it (SGLang's no_buffer cache instead keeps every chunk end, at a state slot
each, and thrashes its pool with them when the chunk size is small).

With in-forward capture a state costs a copy, not a forward, so the ``sparse`` admission keeps a few
states on **probation**: they are evicted before every other state (oldest first; the eviction key
``PROBATION_KEY + recency`` of :mod:`.eviction_index`), and a probation state becomes a normal one
the first time a request resumes from it (:meth:`~.cache.HybridCache.observe`). Probation states
therefore only use room no other state needs, and the states kept per request are the plan's, not
the engine's chunk ends.

Where (:meth:`ProbationPlanner.positions`): the exact DP (:func:`~sglang_sparse.placement.solve_dp`)
over the grid positions of the new part of the prompt, on a law that mixes (a) a prior over the
absolute depths at which requests have shared a prefix so far (an exponentially weighted histogram
of KV-match depths, :meth:`ProbationPlanner.observe`) restricted to that range, and (b) a uniform
hedge over the range (the whole law when the prior has no mass there). With a budget of ``B``
states and no observation this places them evenly (a request diverging anywhere on the new part
resumes within ``1 / (B + 1)`` of its length); once prefix lengths repeat (multi-tenant RAG with
similar document sizes) they move to those depths. Positions the plan already captures are dropped.
The last-token state, when the plan does not want it, is also kept on probation (see
:func:`~.admission.capture_positions`): the leaf then ends at its sequence end while it is cached,
which is what the tail prior learns continuations from.

Units: depths and positions in tokens from the root; weights dimensionless.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from sglang_sparse.placement import DEFAULT_GRID, DepthHistogram, DepthLaw, grid_candidates, solve_dp

#: probation states per new leaf, besides an unplanned last-token state (the default budget)
DEFAULT_PROBATION_BUDGET = 2


class ProbationPlanner:
    """EW prior over shared-prefix depths + the DP that places a new leaf's probation states.

    ``gamma``: decay per observation; ``grid``: candidate grid (tokens); ``budget``: states per new
    leaf (0 = no first-sight probation states); ``hedge``: weight of the uniform part of the law
    when the prior has mass on the range (in ``(0, 1]``)."""

    def __init__(
        self,
        gamma: float = 0.99,
        grid: int = DEFAULT_GRID,
        budget: int = DEFAULT_PROBATION_BUDGET,
        hedge: float = 0.5,
    ) -> None:
        if budget < 0:
            raise ValueError(f"probation budget must be >= 0, got {budget}")
        if not 0.0 < hedge <= 1.0:
            raise ValueError(f"hedge must be in (0, 1], got {hedge}")
        self.depths = DepthHistogram(gamma, refresh=1)
        self.grid = int(grid)
        self.budget = int(budget)
        self.hedge = float(hedge)

    def observe(self, kv_depth: int) -> None:
        """Record that a request shared ``kv_depth`` tokens with the cache (ignored below one grid
        step: no state shallower than that is worth its bytes)."""
        if kv_depth >= self.grid:
            self.depths.observe(int(kv_depth))

    def positions(self, start: int, end: int, exclude: Collection[int] = ()) -> list[int]:
        """Up to ``budget`` grid positions in ``(start, end)`` (the new, not yet cached part of a
        prompt; ``end`` excluded), sorted, none in ``exclude`` and none below one grid step.

        ``exclude``: the positions the request's plan captures anyway. Inside the range (past the
        KV match) those are the tail prior's predicted divergences, named positions or a fit
        state; the deepest of them already serves every divergence past it, so the probation
        states, hedges against the prediction, go below it (the range ends there). Placed over the
        whole range, the DP spent a guess on the part the planned state covers and left the rest a
        grid step or more short (a tail-prior state at 896 of a 976-token prompt moved the second
        guess from 576 to 640, above a divergence at 600). Planned positions lower down are only
        excluded as candidates. (The exact optimum given the planned positions, one DP per segment
        between them, measured worse: it spends the whole budget, also above the deepest one, and
        cut ``sim_compare``'s rag hit rate at 5% of the footprint from 0.101 to 0.088; this rule
        reads 0.100 there and the same or better at every other trace and size.)"""
        if self.budget <= 0:
            return []
        skip = {int(p) for p in exclude}
        lo = max(int(start), self.grid - 1)
        top = max((p for p in skip if lo < p < end), default=int(end))
        cand = grid_candidates(top - 1, self.grid, lo, include_end=False)
        cand = cand[~np.isin(cand, list(skip))]
        if not cand.size:
            return []
        uniform = np.full(cand.size, 1.0 / cand.size)
        depths, weights = cand.astype(np.float64), uniform
        s, w = self.depths.items()
        if s.size:
            inside = (s > lo) & (s < top)
            mass = float(w[inside].sum())
            if mass > 0:
                depths = np.concatenate([depths, s[inside].astype(np.float64)])
                weights = np.concatenate([uniform * self.hedge, w[inside] / mass * (1.0 - self.hedge)])
        law = DepthLaw.from_depths(depths, weights, cand, lo)
        return sorted(int(p) for p in solve_dp(law, self.budget).positions)

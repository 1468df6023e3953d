"""Where will future requests leave a *new* leaf? A learned prior over suffix distances.

A freshly inserted sequence has no observations of its own, so the per-edge DP has nothing to plan
with; Marconi only checkpoints it at its last token and learns the real branch point when a second
request diverges there (that second request misses). Traces show a strong regularity instead: the
*distance from the end of a leaf at which later requests diverge* (the user turn + answer after a
system prompt, the question + answer after a document, 0 for multi-turn continuations) is stable
across leaves even though absolute depths are not.

:class:`TailPrior` keeps an EW histogram (:class:`~sglang_sparse.placement.DepthHistogram`) of
those suffix distances ``s = leaf.end - d`` (tokens), observed whenever a request's KV match ends
on a leaf edge at depth ``d``. For a new leaf ``(a, b]`` it maps the law to depths ``b - s`` and
lets the exact DP choose up to ``budget`` positions on the grid (plus ``b`` itself, the last-token
state), keeping only positions that serve at least ``min_share`` of the prior mass: a checkpoint
costs a whole recurrent state, so an unlikely position is not worth capturing.

With a finer ``exact_grid`` (an engine that captures a state at any page-aligned depth inside a
prefill, e.g. the page size) the candidates are the predicted depths themselves, aligned down to
that grid, and ``b``: the optimum of the one-sided k-median lies on them (moving a position up to
the next predicted depth serves the same requests from deeper), so a suffix that repeats exactly
(a fixed-length question after a document) gets its state at the divergence, not up to a grid
step below it. Two positions less than ``min_gap`` tokens apart keep only the shallower (besides
``b``): the DP splits one cluster of nearly equal suffixes (questions that share their first
20-25 tokens diverge 19-25 tokens before the end) into states a few tokens apart, each saving those
few tokens per hit for a whole state, and under pool pressure they push out the states that save
hundreds. ``min_gap`` defaults to a quarter of the grid (16 tokens on the 64-token grid); measured
on the 60-request doc_qa serving slice (tiny model, page 1, in-forward capture), prefilled tokens
per ``min_gap``: 1: 8,343 (the document-end states evicted), 2: 6,552, 4-16: 6,506, 32-64: 6,554.

The suffix law is conditional on a revisit: it says *where* a later request leaves a leaf, given
that one does, not *whether* one does while the state is held. The cache therefore follows the
prior's own states (:meth:`TailPrior.observe_outcome`: a request resumed from it, or it was freed
unused) and keeps an EW :attr:`TailPrior.hit_rate` (one pseudo-hit: trusted until shown
otherwise). Below ``min_hit_rate`` (2%) the prior's positions are still captured but on probation
(evicted before every used state; one that serves a request is promoted and counts as a hit, so the
rate recovers). Measured: the prior's hit rate reads 0.44-0.46 on the doc_qa / system_prompts
serving slices and 0.00-0.01 in the 500-request RAG storm (15 requests in flight: a request that
shares a question's documents is mostly admitted before the other's leaf exists), where a normal
state per request at the predicted depth displaced shared-prefix states from the pool (prefilled
279,841 -> 274,183 with the gate). In the simulator the rate reads 0.004-0.23 (doc_qa 5%-50%, rag
5%-20%, agent 10%) and a tail state there still pays at 5.7% (doc_qa at 10%: gating at 20% took its
hit rate from 0.256 to 0.056), hence the low bar.
"""

from __future__ import annotations

import numpy as np

from sglang_sparse.placement import DEFAULT_GRID, DepthHistogram, DepthLaw, grid_candidates, solve_dp


class TailPrior:
    """EW law of suffix distances (tokens) at which requests diverge from leaves."""

    def __init__(
        self,
        gamma: float = 0.99,
        min_share: float = 0.2,
        grid: int = DEFAULT_GRID,
        exact_grid: int | None = None,
        min_gap: int | None = None,
        min_hit_rate: float = 0.02,
    ) -> None:
        if not 0.0 < min_share <= 1.0:
            raise ValueError(f"min_share must be in (0, 1], got {min_share}")
        if exact_grid is not None and exact_grid < 1:
            raise ValueError(f"exact_grid must be >= 1, got {exact_grid}")
        if min_gap is not None and min_gap < 1:
            raise ValueError(f"min_gap must be >= 1, got {min_gap}")
        self.hist = DepthHistogram(gamma, refresh=1)
        self.min_share = float(min_share)
        self.grid = int(grid)
        #: alignment (tokens) of the candidates at the predicted depths; ``grid``: the grid only
        self.exact_grid = int(grid if exact_grid is None else exact_grid)
        #: least distance (tokens) between two kept positions below ``end`` (off-grid plans only)
        self.min_gap = int(max(1, grid // 4) if min_gap is None else min_gap)
        self.gamma = float(gamma)
        if not 0.0 <= min_hit_rate < 1.0:
            raise ValueError(f"min_hit_rate must be in [0, 1), got {min_hit_rate}")
        #: below this :attr:`hit_rate` the prior's positions are kept on probation (:meth:`trusted`)
        self.min_hit_rate = float(min_hit_rate)
        #: EW counts (states) of the prior's resolved states and of those a request resumed from
        #: before they were freed (:attr:`hit_rate`), starting from one pseudo-hit: the prior is
        #: trusted until a few of its states have gone unused, not after the first one
        self._resolved = 1.0
        self._hits = 1.0

    def observe_outcome(self, hit: bool) -> None:
        """A state this prior placed is resolved: a request resumed from it (``hit``) or it was
        freed before any did."""
        self._resolved = self.gamma * self._resolved + 1.0
        self._hits = self.gamma * self._hits + float(hit)

    @property
    def hit_rate(self) -> float:
        """EW share of this prior's resolved states that served a request before being freed,
        with one pseudo-hit (1.0 before any outcome)."""
        return self._hits / self._resolved

    def trusted(self) -> bool:
        """Do the prior's states serve requests often enough to be kept as normal states? Below
        ``min_hit_rate`` its positions go on probation (evicted before every used state)."""
        return self.hit_rate >= self.min_hit_rate

    def observe_suffix(self, suffix: int) -> None:
        """Record that a request diverged ``suffix`` tokens before the end of a leaf (0 = continued)."""
        self.hist.observe(max(0, int(suffix)))

    @property
    def observations(self) -> int:
        return self.hist.observations

    def continuation_share(self) -> float:
        """Share of the (decayed) mass at suffix 0: requests that extend a leaf exactly at its end."""
        s, w = self.hist.items()
        tot = float(w.sum())
        return float(w[s == 0].sum()) / tot if tot > 0 else 0.0

    def positions(self, start: int, end: int, budget: int) -> list[int]:
        """Up to ``budget`` checkpoint positions in ``(start, end]`` for a new leaf spanning those
        depths: grid positions and ``end`` (the last-token state), each serving >= ``min_share`` of
        the prior mass that falls on the leaf. Empty before any observation."""
        if budget <= 0 or end <= start:
            return []
        s, w = self.hist.items()
        if not s.size:
            return []
        depths = end - s
        keep = depths > start
        if not np.any(keep):
            return []
        depths, w = depths[keep], w[keep]
        if self.exact_grid < self.grid:
            g = self.exact_grid
            cand = np.unique(np.append(depths // g * g, end))
            cand = cand[cand > start]
        else:
            cand = grid_candidates(end, self.grid, start, include_end=True)
        law = DepthLaw.from_depths(depths, w, cand, start)
        plan = solve_dp(law, budget).positions
        if self.exact_grid < self.grid:
            # Off the grid the DP may split one cluster of predicted depths into states a few
            # tokens apart: each extra one saves those few tokens at the cost of a whole state.
            # A position closer than ``min_gap`` to the previous one is dropped (the previous
            # one serves its requests); the last-token state is kept (continuations).
            kept: list[int] = []
            for p in plan:
                if not kept or p == end or p - kept[-1] >= self.min_gap:
                    kept.append(p)
            plan = kept
        if not plan:
            return []
        total = float(w.sum())
        out = []
        bounds = list(plan) + [end + 1]
        for p, nxt in zip(plan, bounds[1:], strict=True):
            served = float(w[(depths >= p) & (depths < nxt)].sum())
            if served >= self.min_share * total:
                out.append(int(p))
        return out

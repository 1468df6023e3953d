"""Online checkpoint placement for one cache entry: own law + global prior + hedge, DP, fill.

A cache entry (a cached token sequence of ``length`` tokens) may hold at most ``M`` recurrent-state
checkpoints on the ``grid`` (multiples of ``grid`` tokens in ``(0, length]``). Its own
:class:`~sglang_sparse.placement.DepthHistogram` records the overlap depths (tokens) that requests
had with it; :class:`OnlinePlanner` turns those depths into *target* positions:

1. **Law** (:meth:`OnlinePlanner.law`). The entry's own EW depths, plus a light mixture of
   * the **global prior** (:class:`DepthPrior`): where requests stopped on the entries they
     matched best, transferred to this entry's length by two models - relative depth
     (``d / length``) and suffix distance (``length - d``) - weighted by their online track record,
     restricted to depths a checkpoint can serve (``>= grid``); and
   * a **uniform hedge**: equal mass in the middle of every grid block (alone, its DP optimum is
     balanced spacing).
   The mixture mass is ``prior_weight`` times the entry's *informative* own mass (own weight at
   depths ``>= grid``), split equally between prior and hedge; with no informative own mass the
   mixture alone (prior 1/2, hedge 1/2) decides.
2. **DP.** :func:`~sglang_sparse.placement.solve_dp` on that law with budget ``M``.
3. **Fill.** Budget the DP leaves unused (it uses at most one checkpoint per bin with mass) is
   filled by balanced spacing (:func:`balanced_fill`); with no information at all, exactly
   :func:`~sglang_sparse.placement.balanced_placement` (:meth:`OnlinePlanner.plan`).

Invariants of the targets: sorted, distinct int64 multiples of ``grid`` in ``(0, length]``;
``min(M, length // grid)`` of them; a depth with a large enough share of the own law gets a
checkpoint at its grid floor ``grid * (d // grid)``.

Capture and admission (what an engine can do online): a target is captured only when a request's
prefill passes it (:func:`passed_positions`); :func:`admit` decides which held position makes room.

Units: every position, depth and length is a token count from the start of the sequence; weights
are dimensionless (EW observation counts). Everything here is deterministic and numpy-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .baselines import balanced_placement
from .dp import DEFAULT_GRID, DepthHistogram, DepthLaw, grid_candidates, solve_dp

PRIOR_WEIGHT = 0.05
"""Mass of prior + hedge relative to the entry's informative own mass (module docstring, step 1)."""

REL_RESOLUTION = 4096
"""Relative depths ``d / length`` are kept in the global histogram as integers in
``[0, REL_RESOLUTION]``."""


class DepthPrior:
    """Global EW laws of where requests stop on the entries they match best, shared by all entries.

    Each request's deepest overlap (``depth`` tokens into an entry of ``length`` tokens) is recorded
    in two *transfer models*: as a **relative depth** ``depth / length`` (integers in
    ``[0, resolution]``; scale-free: "three quarters in") and as a **suffix distance**
    ``length - depth`` (tokens; shift-free: "the user turn + answer before the end", 0 for a
    continuation). :meth:`on_entry` maps both onto an entry of a given length, so a fresh entry
    with no history of its own can still place checkpoints where requests tend to stop.
    The two models are mixed by online EM. With ``pi = (1 - suffix_share, suffix_share)`` and
    the planner's no-own-data predictive law ``0.5 * (pi_r * rel + pi_s * suf) + 0.5 * uniform``
    over the ``length // grid`` servable grid blocks, an observation at a servable depth (``>=
    grid``) gives model ``i`` the responsibility ``0.5 * pi_i * hit_i / (that law's mass on the
    observed block)``, ``hit_i`` = the model's mass (mapped onto that entry, before learning the
    observation) in the observed depth's grid block: the chance a checkpoint planned from it sits
    in that block. :attr:`suffix_share` is the suffix model's share of the EW (``gamma``) sums of
    responsibilities, which start at ``(1/2, 1/2)`` (a pseudo-observation, so neither model's
    weight can collapse to zero for good): stops a fixed distance before the end (prompt +
    question, continuations) move it to the suffix model, stops that scale with the length
    (retrieved-chunk boundaries) to the relative one.
    Invariants: depths above the length are clipped to it; ``0 <= suffix_share <= 1``."""

    __slots__ = ("relative", "suffix", "resolution", "grid", "gamma", "_score")

    def __init__(
        self, gamma: float = 0.99, grid: int = DEFAULT_GRID, resolution: int = REL_RESOLUTION
    ) -> None:
        if resolution < 1:
            raise ValueError(f"resolution must be >= 1, got {resolution}")
        if grid <= 0:
            raise ValueError(f"grid must be > 0 tokens, got {grid}")
        self.relative = DepthHistogram(gamma, refresh=1)
        self.suffix = DepthHistogram(gamma, refresh=1)
        self.resolution = int(resolution)
        self.grid = int(grid)
        self.gamma = float(gamma)
        self._score = np.full(2, 0.5)  # EW responsibilities of (relative, suffix)

    def observe(self, depth: int, length: int) -> None:
        """Record an overlap of ``depth`` tokens (>= 0) with an entry of ``length`` tokens (> 0)."""
        if length <= 0:
            raise ValueError(f"length must be > 0 tokens, got {length}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0 tokens, got {depth}")
        depth = min(int(depth), int(length))
        if depth >= self.grid:
            block = depth // self.grid
            uniform = 1.0 / (length // self.grid)
            share = self.suffix_share
            resp = np.zeros(2)
            for i, ((d, w), pi) in enumerate(zip(self._mapped(length), (1.0 - share, share), strict=True)):
                if w.size:
                    resp[i] = 0.5 * pi * w[(d // self.grid) == block].sum()
            self._score = self._score * self.gamma + resp / (resp.sum() + 0.5 * uniform)
        self.relative.observe(round(depth / length * self.resolution))
        self.suffix.observe(int(length) - depth)

    @property
    def observations(self) -> int:
        return self.relative.observations

    @property
    def suffix_share(self) -> float:
        """Weight of the suffix-distance model in :meth:`on_entry` (the rest: relative depth)."""
        tot = float(self._score.sum())
        return float(self._score[1]) / tot if tot > 0 else 0.5

    def _mapped(self, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(relative, suffix) models on an entry of ``length`` tokens: servable depths (tokens,
        ``grid <= d <= length``) and weights normalised to 1 (empty arrays when none)."""
        rel, rel_w = self.relative.items()
        suf, suf_w = self.suffix.items()
        out = []
        for d, w in (
            (np.floor(rel.astype(np.float64) / self.resolution * length), rel_w),
            ((length - suf).astype(np.float64), suf_w),
        ):
            ok = (d >= self.grid) & (d <= length)
            tot = float(w[ok].sum())
            out.append((d[ok], w[ok] / tot) if tot > 0 else (np.empty(0), np.empty(0)))
        return out

    def on_entry(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The prior on an entry of ``length`` tokens, restricted to *servable* depths (``>= grid``:
        below the first grid point no checkpoint can help). Relative depths map to
        ``floor(rel * length)``, suffix distances to ``length - s``; each model is normalised over
        its servable depths and weighted ``1 - suffix_share`` and ``suffix_share``; a model with no
        servable mass hands its share to the other. Returns depths (tokens, float64) and weights
        summing to 1, or two empty arrays when nothing is servable."""
        share = self.suffix_share
        parts = [(d, w, s) for (d, w), s in zip(self._mapped(length), (1.0 - share, share), strict=True)]
        parts = [(d, w, s) for d, w, s in parts if w.size and s > 0]
        if not parts:
            return np.empty(0), np.empty(0)
        norm = sum(s for _, _, s in parts)
        return np.concatenate([d for d, _, _ in parts]), np.concatenate([w * (s / norm) for _, w, s in parts])


def balanced_fill(plan: Iterable[int], length: int, budget: int, grid: int = DEFAULT_GRID) -> np.ndarray:
    """``plan`` plus balanced-spaced grid positions until ``budget`` positions (or the grid) are used.

    Positions come from ``balanced_placement(length, spare)`` first (``spare = budget - len(plan)``:
    the optimum of a uniform law for what is left), then ``balanced_placement(length, budget)``.
    For ``plan`` a set of at most ``budget`` grid positions in ``(0, length]`` the result (sorted
    int64) is a superset of it with exactly ``min(budget, length // grid)`` positions: the second
    list alone holds that many distinct ones."""
    chosen = set(int(p) for p in plan)
    spare = budget - len(chosen)
    if spare > 0:
        for p in balanced_placement(length, spare, grid) + balanced_placement(length, budget, grid):
            if len(chosen) >= budget:
                break
            chosen.add(p)
    return np.array(sorted(chosen), dtype=np.int64)


def passed_positions(pending: Iterable[int], resume: int, depth: int) -> set[int]:
    """Target positions a prefill that resumes at ``resume`` and reuses the prefix up to ``depth``
    tokens passes (``resume <= p <= depth``): those it can capture (the state at ``p`` exists only
    while computing token ``p``)."""
    return {int(p) for p in pending if resume <= p <= depth}


def admit(
    held: Iterable[int], captured: Iterable[int], target: Iterable[int], budget: int, law: DepthLaw
) -> np.ndarray:
    """Positions held after capturing ``captured``: ``held | captured`` cut to ``budget``.

    While over budget, drop the held position *not in* ``target`` whose removal raises the weighted
    recompute under ``law`` least (ties: the shallowest); only when every held position is planned
    is a planned one dropped by the same rule. All positions must be candidates of ``law``.
    Returns sorted int64 positions, at most ``max(budget, 0)`` of them."""
    keep = set(int(p) for p in held) | set(int(p) for p in captured)
    plan = set(int(p) for p in target)
    while len(keep) > max(budget, 0):
        extra = sorted(keep - plan) or sorted(keep)
        base = law.cost_of_indices(law.indices_of(sorted(keep)))
        loss = [law.cost_of_indices(law.indices_of(sorted(keep - {p}))) - base for p in extra]
        keep.discard(extra[int(np.argmin(loss))])
    return np.array(sorted(keep), dtype=np.int64)


@dataclass(frozen=True)
class OnlinePlanner:
    """Turns an entry's own depth histogram into target checkpoint positions (see module doc). ``grid``:
    chunk size in tokens (targets are multiples of it in ``(0, length]``); ``prior_weight``: mass of
    prior + hedge relative to the entry's informative own mass."""

    grid: int = DEFAULT_GRID
    prior_weight: float = PRIOR_WEIGHT

    def __post_init__(self) -> None:
        if self.grid <= 0:
            raise ValueError(f"grid must be > 0 tokens, got {self.grid}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")

    def law(
        self,
        depths: np.ndarray | Sequence[int],
        weights: np.ndarray | Sequence[float],
        length: int,
        prior: DepthPrior | None = None,
    ) -> DepthLaw:
        """The planning law of an entry of ``length`` tokens on its grid candidates: own EW depths
        (tokens) and weights, plus prior and hedge (module doc, step 1)."""
        return self._law(depths, weights, length, prior)[0]

    def _law(
        self,
        depths: np.ndarray | Sequence[int],
        weights: np.ndarray | Sequence[float],
        length: int,
        prior: DepthPrior | None,
    ) -> tuple[DepthLaw, bool]:
        if length < 0:
            raise ValueError(f"length must be >= 0 tokens, got {length}")
        own_d = np.asarray(depths, dtype=np.float64).reshape(-1)
        own_w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if own_d.shape != own_w.shape:
            raise ValueError(f"depths and weights differ in length: {own_d.size} vs {own_w.size}")
        if prior is not None and prior.grid != self.grid:
            raise ValueError(f"prior grid {prior.grid} differs from the planner grid {self.grid}")
        cands = grid_candidates(length, self.grid)
        informative = float(own_w[own_d >= self.grid].sum())
        mix = self.prior_weight * informative if informative > 0 else 1.0
        pri_d, pri_w = prior.on_entry(length) if prior is not None else (np.empty(0), np.empty(0))
        pri_w = pri_w * (0.5 * mix)
        uni_d = np.minimum(cands + self.grid // 2, length).astype(np.float64)
        uni_w = np.full(uni_d.size, 0.5 * mix / max(uni_d.size, 1))
        law = DepthLaw.from_depths(
            np.concatenate([own_d, pri_d, uni_d]), np.concatenate([own_w, pri_w, uni_w]), cands
        )
        return law, informative > 0 or pri_w.size > 0

    def targets(self, law: DepthLaw, length: int, budget: int) -> np.ndarray:
        """DP positions on ``law`` for ``budget`` checkpoints, filled by balanced spacing (step 2-3).
        Sorted int64 grid positions in ``(0, length]``, ``min(budget, length // grid)`` of them."""
        return balanced_fill(solve_dp(law, budget).positions, length, budget, self.grid)

    def plan(
        self,
        depths: np.ndarray | Sequence[int],
        weights: np.ndarray | Sequence[float],
        length: int,
        budgets: Sequence[int],
        prior: DepthPrior | None = None,
    ) -> tuple[DepthLaw, dict[int, np.ndarray]]:
        """The planning law of an entry (own EW ``depths``/``weights``, e.g.
        ``DepthHistogram.items()``; ``length`` tokens) and its targets for every budget.

        With no information at all (no own mass at depths ``>= grid`` and no servable prior mass)
        the targets are exactly :func:`~sglang_sparse.placement.balanced_placement` (the optimum of
        the hedge alone; the DP could return another of its tied optima)."""
        law, informed = self._law(depths, weights, length, prior)
        if not informed:
            return law, {
                m: np.array(balanced_placement(length, m, self.grid), dtype=np.int64) for m in budgets
            }
        return law, {m: self.targets(law, length, m) for m in budgets}

    def target(
        self,
        depths: np.ndarray | Sequence[int],
        weights: np.ndarray | Sequence[float],
        length: int,
        budget: int,
        prior: DepthPrior | None = None,
    ) -> np.ndarray:
        """Target positions (sorted int64 grid positions in ``(0, length]``, at most ``budget``) of
        one budget: :meth:`plan` with ``budgets=(budget,)``."""
        return self.plan(depths, weights, length, (budget,), prior)[1][budget]

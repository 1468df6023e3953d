"""The policy's per-edge state: each edge's depth histogram and checkpoint plan, keyed by node uid.

The tree (:class:`~sglang_sparse.tree.CheckpointTree`: :class:`~sglang_sparse.tree.RadixTree` or
:class:`~sglang_sparse.tree.MirrorTree`) is mechanism only; a :class:`PlanTable` is its
``listener`` (:class:`~sglang_sparse.tree.TreeListener`) and follows the same structural events
for both trees: a split divides an edge's entry, a merge joins two, a removed node's entry goes.

Invariants: an entry exists only for a live node's uid (a missing entry means: no histogram, an
empty plan, not fresh); ``plan`` holds absolute depths ``p`` (tokens) with ``start < p <= end`` of
its edge (those the DP solved for, ``<= plan_budget`` of them); ``fresh`` means every depth the edge
observed since its last re-plan was its ``end`` and the plan holds ``end``, so re-solving would
return the same plan (see :attr:`PlanTable.skip_fresh_replans`).

Depth observations (what each edge's histogram sees). A request whose KV match reaches depth
``d`` observes ``d`` on the edge ``(a, b]`` containing ``d``; every strict ancestor edge
``(a', b']`` observes ``b'`` (its end, i.e. the depth clipped to the edge). Rationale: within the
per-edge model an edge's origin (its start) is assumed to be a free resume point; for an ancestor,
the best place to serve traffic that continues below it is its end, which is exactly where the
ancestor's DP then puts a checkpoint, making the assumption true for its children.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import numpy as np

from sglang_sparse.placement import DEFAULT_GRID, DepthHistogram, DepthLaw, grid_candidates, solve_dp
from sglang_sparse.tree import CheckpointTree, MatchResult, Node

#: ``(node, tree) -> (depths, weights)``: a law source replacing the histograms (the simulator's oracle)
LawProvider = Callable[[Node, CheckpointTree], tuple[np.ndarray, np.ndarray]]


class EdgePlan:
    """One edge's policy state: ``hist`` (``None`` before its first observation), ``plan`` (sorted
    absolute depths, tokens) and ``fresh`` (module docstring)."""

    __slots__ = ("hist", "plan", "fresh")

    def __init__(self, hist: DepthHistogram | None = None, plan: tuple[int, ...] = (), fresh: bool = False):
        self.hist = hist
        self.plan = plan
        self.fresh = fresh


def _split_hist(h: DepthHistogram, at: int) -> tuple[DepthHistogram, DepthHistogram]:
    """Split an edge histogram at depth ``at``: depths ``<= at`` go up, deeper ones go down and also
    count as pass-through mass at ``at`` on the upper part (the ancestor rule of this module)."""
    up = DepthHistogram(h.gamma, h.refresh)
    down = DepthHistogram(h.gamma, h.refresh)
    d, w = h.items()
    for hh, bins in ((up, {}), (down, {})):
        hh._n = h.observations  # noqa: SLF001 - placement exposes no split; documented open problem
        hh._since_refresh = h.refresh  # re-plan both halves at the next observation
        hh._bins = bins
    for di, wi in zip(d.tolist(), w.tolist(), strict=True):
        if di <= at:
            up._bins[di] = up._bins.get(di, 0.0) + wi
        else:
            up._bins[at] = up._bins.get(at, 0.0) + wi
            down._bins[di] = wi
    return up, down


def _merge_hist(upper: DepthHistogram | None, lower: DepthHistogram | None, at: int) -> DepthHistogram | None:
    """Histogram of a merged edge: the lower edge's depths plus the upper edge's depths ``< at`` (its
    mass at ``at`` is pass-through mass that the lower edge already records at the true depths)."""
    if upper is None:
        return lower
    merged = DepthHistogram(upper.gamma, upper.refresh)
    # every observation of the lower edge passed through the upper one (the ancestor rule), so the
    # merged edge saw max(...) of them; a sum doubles on every split/merge cycle of a live session
    merged._n = max(upper.observations, lower.observations if lower else 0)  # noqa: SLF001
    merged._since_refresh = merged.refresh  # noqa: SLF001
    bins: dict[int, float] = {}
    d, w = upper.items()
    for di, wi in zip(d.tolist(), w.tolist(), strict=True):
        if di < at:
            bins[di] = wi
    if lower is not None:
        d, w = lower.items()
        for di, wi in zip(d.tolist(), w.tolist(), strict=True):
            bins[di] = bins.get(di, 0.0) + wi
    merged._bins = bins  # noqa: SLF001
    return merged


class PlanTable:
    """Per-edge depth histograms and DP plans of one tree, keyed by node uid (module docstring).

    ``gamma``/``refresh`` configure each edge's :class:`DepthHistogram`; ``plan_budget`` is the
    per-edge checkpoint budget ``M`` handed to :func:`solve_dp`; ``grid`` the chunk size of
    candidate positions (tokens); ``law_provider`` (optional) replaces the online histogram by
    another law source (the simulator's oracle). Attach it with ``tree.listener = table``."""

    #: Skip a due re-plan of an edge whose observations since its last re-plan were all at its end
    #: while its plan holds the end (``fresh``): the DP's optimum is then unchanged (the end's mass
    #: costs nothing to a plan holding the end, and the EW decay scales every other depth alike).
    #: Ancestors of a match observe their end (module docstring), so along a deep chain (a long
    #: multi-turn session) this removes almost every re-plan of a request. ``False`` re-solves every
    #: time (the differential tests compare both).
    skip_fresh_replans = True

    def __init__(
        self,
        *,
        gamma: float = 0.99,
        refresh: int = 10,
        plan_budget: int = 4,
        grid: int = DEFAULT_GRID,
        law_provider: LawProvider | None = None,
    ) -> None:
        if plan_budget < 0:
            raise ValueError(f"plan_budget must be >= 0 checkpoints per edge, got {plan_budget}")
        DepthHistogram(gamma, refresh)  # validate early
        self.gamma, self.refresh = float(gamma), int(refresh)
        self.plan_budget = int(plan_budget)
        self.grid = int(grid)
        self.law_provider = law_provider
        self.entries: dict[int, EdgePlan] = {}

    # ------------------------------------------------------------------ reads

    def plan(self, node: Node) -> tuple[int, ...]:
        """``node``'s current plan (absolute depths; ``()`` if none)."""
        e = self.entries.get(node.uid)
        return e.plan if e is not None else ()

    def hist(self, node: Node) -> DepthHistogram | None:
        """``node``'s depth histogram (``None`` before its first observation)."""
        e = self.entries.get(node.uid)
        return e.hist if e is not None else None

    def fresh(self, node: Node) -> bool:
        e = self.entries.get(node.uid)
        return e is not None and e.fresh

    def edge_law(self, node: Node, tree: CheckpointTree) -> tuple[np.ndarray, np.ndarray]:
        """Observed depths (tokens) and weights on ``node``'s edge (law provider or histogram)."""
        if self.law_provider is not None:
            return self.law_provider(node, tree)
        e = self.entries.get(node.uid)
        if e is None or e.hist is None:
            return np.empty(0, dtype=np.int64), np.empty(0)
        return e.hist.items()

    # ------------------------------------------------------------------ observe and re-plan

    def observe(self, tree: CheckpointTree, match: MatchResult) -> list[Node]:
        """Record an admitted request's match: the tree's clock and recency (:meth:`CheckpointTree.touch`),
        then each path edge's histogram and its re-plan when due. Returns the re-planned nodes.
        Call once per request (not per match call)."""
        if not tree.touch(match):
            return []
        d = match.kv_depth
        replanned = []
        entries = self.entries
        refresh = self.refresh
        for node in match.path:
            e = entries.get(node.uid)
            if e is None:
                e = entries[node.uid] = EdgePlan()
            if e.hist is None:
                e.hist = DepthHistogram(self.gamma, refresh)
            end = node.end
            obs = min(d, end)
            due = e.hist.observe(obs)
            if obs != end:
                e.fresh = False
            if due or e.hist.observations <= refresh:  # plan early on young edges
                if e.fresh and self.skip_fresh_replans:
                    e.hist.mark_refreshed()  # same plan: see skip_fresh_replans
                else:
                    self._replan(node, e, tree)
                    replanned.append(node)
        return replanned

    def _replan(self, node: Node, e: EdgePlan, tree: CheckpointTree) -> tuple[int, ...]:
        """Re-solve the edge's checkpoint plan with :func:`solve_dp` within ``plan_budget``."""
        cands = grid_candidates(node.end, self.grid, origin=node.start, include_end=True)
        d, w = self.edge_law(node, tree)
        law = DepthLaw.from_depths(d, w, cands, node.start)
        e.plan = plan = solve_dp(law, self.plan_budget).positions if cands.size else ()
        e.fresh = self.law_provider is None and bool(plan) and plan[-1] == node.end
        if e.hist is not None:
            e.hist.mark_refreshed()
        return plan

    def planned_captures(self, tree: CheckpointTree, match: MatchResult) -> list[int]:
        """Planned positions on the matched path that a prefill resuming at ``resume_depth`` passes
        (``resume_depth < p <= kv_depth``) and that are not cached yet.

        A plan position at an edge's end is captured when the tree's edge ends are divergence
        points (:attr:`CheckpointTree.edge_ends_diverge`), else only at a branch point or a
        sequence end. The end of the edge the KV match ends on, when the match ends exactly there,
        is the point where this request diverges (an engine that splits an edge where a match ends,
        SGLang's, made that edge end for this request): a branch point in every tree, so a plan
        that wants it (the per-edge DP, on that edge's observed depths) captures it at its exact
        depth."""
        out = []
        lo, hi = match.resume_depth, match.kv_depth
        branch = match.node if match.kv_depth > 0 and match.kv_depth == match.node.end else None
        all_ends = tree.edge_ends_diverge
        entries = self.entries
        for node in match.path:
            if node.end <= lo:
                continue
            e = entries.get(node.uid)
            if e is None or not e.plan:
                continue
            keep_end = node is branch or all_ends or len(node.children) != 1 or node.seq_end
            skip = -1 if keep_end else node.end
            for p in e.plan:
                if lo < p <= hi and p != skip and p not in node.checkpoints:
                    out.append(p)
        return out

    # ------------------------------------------------------------------ structural events (TreeListener)

    def on_split(self, lower: Node, upper: Node, at: int) -> None:
        """``upper`` took ``lower``'s edge up to depth ``at``: the histogram splits
        (:func:`_split_hist`), plan positions ``<= at`` move up, neither half is fresh."""
        e = self.entries.get(lower.uid)
        if e is None:
            return
        up = EdgePlan()
        if e.hist is not None:
            up.hist, e.hist = _split_hist(e.hist, at)
        if e.plan:
            up.plan = tuple(p for p in e.plan if p <= at)
            e.plan = tuple(p for p in e.plan if p > at)
        e.fresh = False
        if up.hist is not None or up.plan:
            self.entries[upper.uid] = up

    def on_merge(self, upper: Node, child: Node) -> None:
        """``upper`` (ending at ``upper.end``) is merged into its only ``child``: the child's entry
        gets the joined histogram (:func:`_merge_hist`) and plan, not fresh; ``upper``'s goes."""
        eu = self.entries.pop(upper.uid, None)
        ec = self.entries.get(child.uid)
        if eu is None:
            if ec is not None:
                ec.fresh = False
            return
        if ec is None:
            ec = self.entries[child.uid] = EdgePlan()
        ec.hist = _merge_hist(eu.hist, ec.hist, upper.end)
        ec.plan = eu.plan + ec.plan
        ec.fresh = False

    def on_remove(self, node: Node) -> None:
        """``node`` left the tree: its entry goes."""
        self.entries.pop(node.uid, None)

    def on_reset(self) -> None:
        """The tree forgot every node."""
        self.entries.clear()

    # ------------------------------------------------------------------ copies

    def snapshot(self, uids: Iterable[int] | None = None) -> PlanTable:
        """An independent copy (only the entries of ``uids``, if given; without the law provider):
        what a :class:`~.cache.CacheSnapshot` carries. Flat (a dict of entries): it pickles and
        copies without recursion in tree depth, histograms bit-exact. O(entries + bins), without
        ``copy.deepcopy`` (which took ~20 s for a 100,000-edge session)."""
        src = self.entries if uids is None else {u: self.entries[u] for u in uids if u in self.entries}
        out = PlanTable.__new__(PlanTable)
        out.__dict__.update(self.__dict__)  # settings (and any instance override), shared immutables
        out.law_provider = None
        out.entries = {
            u: EdgePlan(None if e.hist is None else e.hist.copy(), e.plan, e.fresh) for u, e in src.items()
        }
        return out

    def __deepcopy__(self, memo: dict) -> PlanTable:
        """``copy.deepcopy`` (e.g. of a whole cache): :meth:`snapshot`'s fast copy, the law
        provider deep-copied as the default would."""
        out = self.snapshot()
        out.law_provider = copy.deepcopy(self.law_provider, memo)
        return out

    def with_law(self, law_provider: LawProvider | None) -> PlanTable:
        """An independent copy using ``law_provider`` (:meth:`snapshot`'s inverse)."""
        out = self.snapshot()
        out.law_provider = law_provider
        return out

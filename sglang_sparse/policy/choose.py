"""Choose: which recurrent-state positions a request captures, and what the policy learns to choose them.

The one module for *what enters the cache*. A request is observed once (``HybridCache.observe``: the
plan table's per-edge depth histograms and DP re-plans, the tail prior, the probation prior,
sessions) and planned once (``HybridCache.plan`` -> :func:`capture_positions`, the one entry point
that turns those into absolute token depths). Units: depths and positions in tokens from the root,
clocks in logical ticks of the tree's clock, weights dimensionless.

Per-edge plans (:class:`PlanTable`)
-----------------------------------

Each edge's depth histogram and checkpoint plan, keyed by node uid. The tree
(:class:`~sglang_sparse.tree.CheckpointTree`: :class:`~sglang_sparse.tree.RadixTree` or
:class:`~sglang_sparse.tree.MirrorTree`) is mechanism only; a :class:`PlanTable` is its ``listener``
(:class:`~sglang_sparse.tree.TreeListener`) and follows the same structural events for both trees: a
split divides an edge's entry, a merge joins two, a removed node's entry goes.

Invariants: an entry exists only for a live node's uid (a missing entry means: no histogram, an
empty plan, not fresh); ``plan`` holds absolute depths ``p`` with ``start < p <= end`` of its edge
(those the DP solved for, ``<= plan_budget`` of them); ``fresh`` means every depth the edge observed
since its last re-plan was its ``end`` and the plan holds ``end``, so re-solving would return the
same plan (see :attr:`PlanTable.skip_fresh_replans`).

Depth observations. A request whose KV match reaches depth ``d`` observes ``d`` on the edge ``(a,
b]`` containing ``d``; every strict ancestor edge ``(a', b']`` observes ``b'`` (the depth clipped to
the edge). Rationale: the per-edge model assumes an edge's start is a free resume point; for an
ancestor, the best place to serve traffic that continues below it is its end, which is exactly where
the ancestor's DP then puts a checkpoint, making the assumption true for its children.

The tail prior (:class:`TailPrior`)
-----------------------------------

Where future requests will leave a *new* leaf (no observations of its own yet): the *distance from a
leaf's end at which later requests diverge* (user turn + answer after a system prompt, question +
answer after a document, 0 for multi-turn continuations) is stable across leaves even though
absolute depths are not: :class:`TailPrior` keeps an EW histogram of those suffix distances ``s =
leaf.end - d``, observed whenever a request's KV match ends on a leaf edge at depth ``d``. For a new
leaf ``(a, b]`` it maps the law to depths ``b - s`` and lets the exact DP choose up to ``budget``
positions on the grid (plus ``b``, the last-token state), keeping only positions that serve at least
``min_share`` of the prior mass on the leaf. With a finer ``exact_grid`` (an engine that captures at
any page-aligned depth inside a prefill) the candidates are the predicted depths themselves, aligned
down to that grid, and ``b`` (the optimum of the one-sided k-median lies on them: moving a position
up to the next predicted depth serves the same requests from deeper); two positions less than
``min_gap`` tokens apart (default a quarter of the grid) then keep only the shallower (besides
``b``): one cluster of nearly equal suffixes split into states a few tokens apart saves those few
tokens per hit for a whole state.

The suffix law says *where* a later request leaves a leaf, not *whether* one does while the state is
held. The cache follows the prior's own states (:meth:`TailPrior.observe_outcome`: resumed from, or
freed unused) into an EW :attr:`TailPrior.hit_rate` (one pseudo-hit: trusted until shown otherwise).
Below ``min_hit_rate`` (2%: a tail state can pay at a few percent) the prior's positions are
captured on probation; one that serves a request is promoted and counts as a hit.

Probation states (:class:`ProbationPlanner`)
--------------------------------------------

Where a *new* leaf keeps states before any request has shown where it diverges. With in-forward
capture a state costs a copy, not a forward, so the ``sparse`` admission keeps a few states on
**probation**: evicted before every other state (oldest first; the key ``PROBATION_KEY + recency``
of :mod:`.evict`), and made normal the first time a request resumes from one
(:meth:`~.cache.HybridCache.observe`). They only use room no other state needs, and the states kept
per request are the plan's, not the engine's chunk ends.

Where (:meth:`ProbationPlanner.positions`): the exact DP over the grid positions of the new part of
the prompt, on a law that mixes (a) an EW histogram of the absolute KV-match depths seen so far
(:meth:`ProbationPlanner.observe`) restricted to that range and (b) a uniform hedge over the range
(the whole law when the prior has no mass there). With a budget of ``B`` and no observation this
places them evenly (a request diverging anywhere on the new part resumes within ``1 / (B + 1)`` of
its length); once prefix lengths repeat they move to those depths. The last-token state, when the
plan does not want it, is also kept on probation (:meth:`~.cache.HybridCache.plan`): the leaf then
ends at its sequence end while it is cached, which is what the tail prior learns continuations from.

Online sessions (:class:`ChainTracker`)
---------------------------------------

Sessions without session ids: *chains* of leaves continued from their end. A multi-turn session
sends turn ``k + 1`` as turn ``k``'s whole sequence plus new tokens, so its KV match ends **exactly
at the end of a leaf where a sequence ended** (:attr:`Node.seq_end`) and its insert hangs a new leaf
below it; both the simulator and an engine mirror see that from structural events alone:

* :meth:`ChainTracker.continuation` (at ``observe``, before the tree's): the request continues leaf
  ``L`` when ``kv_depth == L.end >= grid`` (a shared chat header is no session), ``L`` has no
  children and is a sequence end or on a chain (a tip cut back to a state still ends the session's
  cached prefix). :meth:`ChainTracker.arrive` (after the tree's ``observe``): the first continuation
  of ``L`` creates a chain (``L.chain``); each records an arrival and makes ``L`` the pending tip.
* :meth:`ChainTracker.end_sequence` (a sequence ends at ``N``: the simulator's insert, an engine's
  final insert): ``N`` joins the chain of the nearest ancestor on a chain or a sequence end (at most
  :data:`MAX_WALK` nodes up, through an engine's nodes for the same request's earlier chunks) if
  that is the chain's pending tip. A chain is linear (a second request forking from the same turn
  does not join it).
* A split's upper part keeps the chain of the node it was split from
  (:func:`~sglang_sparse.tree.radix.split_node_state`); a merge keeps the surviving child's.

Per chain (:class:`Chain`): the **due** tick ``last + gap_sum / gaps`` from the session's own
inter-arrival gaps (the first measured from the continued leaf's last access). Invariants: ``gaps >=
1`` for every chain; every live node's ``chain`` is ``-1`` or a key of :attr:`ChainTracker.chains`;
the live nodes of one chain lie on one root path and its arrivals are exactly the requests that
continued it. All of them are on the path a continuing request observes, so the eviction index
refreshes every row whose due tick changed without a tree scan. Use:
:func:`~.evict.effective_recency`. Cost: :meth:`~ChainTracker.arrive` O(1),
:meth:`~ChainTracker.end_sequence` O(:data:`MAX_WALK`), :meth:`~ChainTracker.collect` O(nodes) once
the table doubles (amortised O(1) per chain). Chain ids are never reused, so a stale id can only
miss. Everything is a deterministic function of the event stream (ints; the due tick is one float
division); ``tests/test_tree_mirror_sessions.py`` checks simulator and mirror agree.

Admission (:func:`capture_positions`)
-------------------------------------

A request resuming at ``resume_depth`` can only capture ``resume_depth < p <= total_len``
(``total_len``: input + output tokens); positions ``<= len(input)`` are captured during prefill,
deeper ones during decode.

* ``marconi`` (Marconi speculative insertion, arXiv 2411.19379 sec. 4.1): the branch point
  ``floor(kv_depth / branch_grid) * branch_grid`` when the request would create a new branch (its
  input continues past the KV match and the match does not end at a leaf's end), plus the state
  after the last token (``total_len``).
* ``block``: every multiple of ``block`` tokens (vLLM-style, independent of the tree).
* ``dp``: the DP plans of the edges on the matched path (:meth:`PlanTable.planned_captures`), plus
  the last-token state.
* ``sparse`` (the product): ``dp`` + the Marconi branch point + the :class:`TailPrior`'s positions
  on the new leaf ``(kv_depth, total_len]`` (the last-token state only when requests do continue
  leaves at their end); before ``warmup`` prior observations, the last token as Marconi. Planned
  positions shallower than one grid step are not captured: such a state saves fewer than ``grid``
  tokens per hit for a whole state, and, used by every request (a shared chat-template header), it
  would never age out. *Fit state*: when ``total_len > fit`` (the most KV tokens that fit with one
  state), every state past ``fit`` is unservable and would be evicted with its whole leaf;
  ``sparse`` then captures the deepest grid position at which the prefix fits next to this state and
  the branch point, if any (``state_tokens`` KV tokens of room per state), and drops its other
  planned positions up to ``fit``, so eviction can cut the leaf back to that state and keep the
  longest prefix that fits. States already on the matched path are not counted in that room (left to
  eviction).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import numpy as np

from sglang_sparse.placement import DEFAULT_GRID, DepthHistogram, DepthLaw, grid_candidates, solve_dp
from sglang_sparse.tree import CheckpointTree, MatchResult, Node, sequence_leaf

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
    ``gamma``/``refresh`` configure each edge's :class:`DepthHistogram`; ``plan_budget``: the
    per-edge checkpoint budget ``M`` of :func:`solve_dp`; ``grid``: the candidate positions' chunk
    size (tokens); ``law_provider``: replaces the histograms (the simulator's oracle). Attach it
    with ``tree.listener = table``."""

    #: Skip a due re-plan of a ``fresh`` edge: the DP's optimum is unchanged (the end's mass costs
    #: nothing to a plan holding the end, and the EW decay scales every other depth alike). Along a
    #: deep chain every ancestor observes its end, so this removes almost every re-plan of a request.
    #: ``False`` re-solves every time (the differential tests compare both).
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
        (``resume_depth < p <= kv_depth``) and that are not cached yet. A plan position at an edge's end
        is captured when the tree's edge ends are divergence points
        (:attr:`CheckpointTree.edge_ends_diverge`), else only at a branch point or a sequence end. The
        end of the edge the KV match ends on, when the match ends exactly there, is where this request
        diverges (SGLang splits an edge where a match ends): a branch point in every tree, so a plan that
        wants it captures it at its exact depth."""
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
        ``copy.deepcopy``."""
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
        #: EW counts of the prior's resolved states and of those a request resumed from before they
        #: were freed (:attr:`hit_rate`), from one pseudo-hit (not distrusted after one unused state)
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
            # ``min_gap`` (module docstring): the previous position serves a closer one's
            # requests; the last-token state is kept (continuations).
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


#: probation states per new leaf, besides an unplanned last-token state (the default budget)
DEFAULT_PROBATION_BUDGET = 2


class ProbationPlanner:
    """EW prior over shared-prefix depths + the DP that places a new leaf's probation states
    (module docstring). ``gamma``: decay per observation; ``grid``: candidate grid (tokens);
    ``budget``: states per new leaf (0 = none); ``hedge``: weight of the uniform part of the law when
    the prior has mass on the range (in ``(0, 1]``)."""

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

        ``exclude``: the positions the request's plan captures anyway (the tail prior's predicted
        divergences, named positions, a fit state). The deepest of them inside the range already
        serves every divergence past it, so the probation states, hedges against the prediction, go
        below it (the range ends there); planned positions lower down are only excluded as
        candidates."""
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


#: how many nodes :meth:`ChainTracker.end_sequence` walks up from a sequence's last node
MAX_WALK = 64
#: decay per observation of the continuation share (:attr:`ChainTracker.continuation_share`)
PRIOR_GAMMA = 0.99


@dataclass(slots=True)
class Chain:
    """One online session: ``last`` arrival tick, ``gap_sum`` ticks over ``gaps`` gaps (>= 1),
    ``pending``: uid of the tip the next sequence end joins from (``-1``: none)."""

    last: int
    gap_sum: int
    gaps: int
    pending: int = -1

    @property
    def due(self) -> float:
        """The tick the session is expected back: ``last + gap_sum / gaps``."""
        return self.last + self.gap_sum / self.gaps

    @property
    def mean_gap(self) -> float:
        """Mean ticks between its arrivals."""
        return self.gap_sum / self.gaps


class ChainTracker:
    """Chains and their arrival statistics (module docstring). Plain data: copies with
    ``copy.deepcopy`` / ``pickle`` (no node references; tips are kept by uid)."""

    def __init__(self, gamma: float = PRIOR_GAMMA, grid: int = DEFAULT_GRID) -> None:
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must be in (0, 1), got {gamma}")
        #: matches shallower than this (tokens) are neither continuations nor evidence
        self.grid = int(grid)
        #: chain id -> its statistics (ids are never reused)
        self.chains: dict[int, Chain] = {}
        self.next_id = 0
        #: table size that triggers the next :meth:`collect` (amortised garbage collection)
        self.collect_at = 64
        #: continuations seen / sequence ends that joined a chain (diagnostics)
        self.arrivals = 0
        self.joins = 0
        #: every chain's gaps so far: sum (ticks) and count (the prior of a chain-less leaf)
        self.gap_sum = 0
        self.gaps = 0
        #: EW share of the requests reaching a sequence-end leaf that continued it from its end:
        #: numerator and denominator (decay ``gamma`` per such request)
        self.gamma = float(gamma)
        self._cont = 0.0
        self._reach = 0.0

    # ------------------------------------------------------------------ queries

    def due(self, chain: int) -> float | None:
        """The due tick of chain ``chain`` (``None``: no chain, or one already collected)."""
        c = self.chains.get(chain) if chain >= 0 else None
        return None if c is None else c.due

    @property
    def continuation_share(self) -> float:
        """EW share (decay ``gamma`` per observation) of the requests whose KV match ended on a
        sequence-end leaf (or a chain's leaf) that continued it from its end; 0 before any. A
        workload property more than a cache one: requests that miss everything do not count, so a
        thrashing cache does not switch the prior off."""
        return self._cont / self._reach if self._reach else 0.0

    def prior_gap(self) -> float | None:
        """The gap (ticks) after its last access at which a sequence-end leaf no chain holds is
        expected back: the mean gap of every chain so far, while :attr:`continuation_share` >= 1/2
        (a session workload); ``None`` otherwise (such leaves keep their own recency)."""
        if not self.gaps or 2.0 * self._cont < self._reach:
            return None
        return self.gap_sum / self.gaps

    # ------------------------------------------------------------------ events

    def continuation(self, match: MatchResult) -> Node | None:
        """The leaf ``match`` continues from its end (a session's next turn), else ``None``. Call
        once per request, before the tree's ``observe`` (it counts the request for
        :attr:`continuation_share`; it does not change the tree)."""
        node = match.node
        if match.kv_depth < self.grid or node.parent is None:
            return None
        leaf = sequence_leaf(node, chains=True)  # the match may end one engine split above it
        if leaf is None:
            return None
        g = self.gamma
        cont = match.kv_depth == leaf.end
        self._reach = g * self._reach + 1.0
        self._cont = g * self._cont + (1.0 if cont else 0.0)
        return leaf if cont else None

    def arrive(self, leaf: Node, now: int, previous_access: int) -> int:
        """Record that a request continued ``leaf`` at tick ``now``; ``previous_access``: the leaf's
        ``last_access`` before this request's ``observe`` (the first gap of a new chain). Returns
        the chain id. Makes ``leaf`` the chain's pending tip."""
        self.arrivals += 1
        c = self.chains.get(leaf.chain) if leaf.chain >= 0 else None
        if c is None:
            cid = self.next_id
            self.next_id += 1
            gap = max(1, int(now) - int(previous_access))
            c = Chain(last=int(now), gap_sum=gap, gaps=1)
            self.chains[cid] = c
            leaf.chain = cid
        else:
            gap = max(1, int(now) - c.last)
            c.gap_sum += gap
            c.gaps += 1
            c.last = int(now)
        self.gap_sum += gap
        self.gaps += 1
        c.pending = leaf.uid
        return leaf.chain

    def end_sequence(self, node: Node) -> int:
        """A sequence ended at ``node``: it joins the chain of its pending tip above it, if any
        (module docstring), with the nodes between them. Returns ``node.chain``."""
        if node.chain >= 0 or node.parent is None:
            return node.chain
        between: list[Node] = []
        u = node.parent
        for _ in range(MAX_WALK):
            if u.parent is None or u.chain >= 0 or u.seq_end:
                break
            between.append(u)
            u = u.parent
        if u.parent is None or u.chain < 0:
            return -1
        c = self.chains.get(u.chain)
        if c is None or c.pending != u.uid:
            return -1
        node.chain = u.chain
        for b in between:
            b.chain = u.chain
        c.pending = -1
        self.joins += 1
        return node.chain

    def collect(self, nodes: Iterable[Node], *, force: bool = False) -> int:
        """Drop the chains no live node references, once the table has doubled since the last
        collection (``force``: now). ``nodes``: every live node. Returns the number dropped."""
        if not force and len(self.chains) < self.collect_at:
            return 0
        live = {n.chain for n in nodes if n.chain >= 0}
        dead = [cid for cid in self.chains if cid not in live]
        for cid in dead:
            del self.chains[cid]
        self.collect_at = max(64, 2 * len(self.chains))
        return len(dead)


ADMISSIONS = ("marconi", "block", "dp", "sparse")
#: observations the tail prior needs before it plans (until then ``sparse`` admits the last token)
TAIL_WARMUP = 2


def extends_leaf(match: MatchResult) -> bool:
    """Does the KV match end exactly at a leaf's end (the request continues a sequence: a new
    turn of a session), so it creates no branch?"""
    node = match.node
    return match.kv_depth > 0 and match.kv_depth == node.end and not node.children


def marconi_branch_point(match: MatchResult, input_len: int, grid: int = DEFAULT_GRID) -> int | None:
    """Chunk-aligned depth where this request would split the tree, or ``None`` if it creates no branch."""
    d = match.kv_depth
    if d == 0 or d >= input_len or extends_leaf(match):
        return None
    p = (d // grid) * grid
    return p if p > 0 else None


def capture_positions(
    kind: str,
    tree: CheckpointTree,
    plans: PlanTable,
    match: MatchResult,
    input_len: int,
    total_len: int,
    *,
    grid: int = DEFAULT_GRID,
    block: int = 32,
    tail: TailPrior | None = None,
    tail_budget: int = 2,
    warmup: int = TAIL_WARMUP,
    fit: int | None = None,
    state_tokens: int = 0,
    branch_grid: int | None = None,
    tail_out: set[int] | None = None,
) -> list[int]:
    """Sorted positions in ``(match.resume_depth, total_len]`` to capture for this request (module
    docstring). ``branch_grid`` (tokens, default ``grid``): the grid the Marconi branch point is
    aligned down to (an engine capturing at any page-aligned depth passes its page size).
    ``tail_out``, if given, receives the positions only the tail prior chose (no edge plan or
    branch point; a subset of the result unless the fit state displaced them)."""
    if kind not in ADMISSIONS:
        raise ValueError(f"unknown admission {kind!r}; valid: {', '.join(ADMISSIONS)}")
    if total_len < input_len:
        raise ValueError(f"total_len ({total_len}) < input_len ({input_len})")
    lo = match.resume_depth
    bgrid = grid if branch_grid is None else branch_grid
    pos: set[int] = set()
    if kind == "block":
        pos.update(range((lo // block + 1) * block, total_len + 1, block))
    elif kind == "sparse":
        if tail is None:
            raise ValueError("the sparse admission needs a TailPrior")
        b = marconi_branch_point(match, input_len, bgrid)
        if b is not None and b >= grid:  # a branch in a shared header saves too little per state
            pos.add(b)
        learned = set(plans.planned_captures(tree, match))
        if tail.observations < warmup:
            pos.add(total_len)
        else:
            from_tail = set(tail.positions(match.kv_depth, total_len, tail_budget))
            if tail_out is not None:
                tail_out.update(from_tail - learned - pos)
            learned.update(from_tail)
        pos.update(p for p in learned if p >= grid or p == total_len)
        if fit is not None and total_len > fit:
            # Room for the fit state: the prefix, this state and the branch point's. The learned
            # positions below it give way: they could not all stay next to it.
            keep = [b] if b is not None and lo < b <= fit else []
            p = ((fit - len(keep) * state_tokens) // grid) * grid
            if p >= grid and p > lo:
                pos.difference_update([q for q in pos if lo < q <= fit and q not in keep])
                pos.add(p)
    else:
        if total_len > 0:
            pos.add(total_len)
        if kind == "marconi":
            b = marconi_branch_point(match, input_len, bgrid)
            if b is not None:
                pos.add(b)
        if kind == "dp":
            pos.update(plans.planned_captures(tree, match))
    return sorted(p for p in pos if lo < p <= total_len)

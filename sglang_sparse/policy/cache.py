"""The policy-driven hybrid prefix cache: one object the simulator and the SGLang adapter drive.

Per request (SGLang mapping in brackets)::

    m = cache.match(input_ids)                 # pure; may be called many times [match_prefix]
    cache.observe(m)                           # once, when the request is admitted
    cache.lock(m.node)                         # [inc_lock_ref]
    plan = cache.capture_plan(m, len(input_ids), len(input_ids) + n_output)
    ... prefill from m.resume_depth, capturing states at plan positions ...
    res = cache.insert(tokens, kv, {p: state}, kv_offset=m.resume_depth)   # [cache_finished_req]
    free(res.unused_kv); free(res.unused_states)
    cache.unlock(m.node)                       # [dec_lock_ref]
    freed = cache.evict_to_budget()            # or cache.evict(num_bytes) [evict]
    free(freed.kv); free(freed.states)

``observe`` also recognises a session's next turn and ``insert`` hangs the new sequence on that
session (:mod:`.choose`; see :meth:`HybridCache.end_sequence`). Units: tokens, bytes
(``budget_bytes`` is shared by KV and states), FLOPs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_sparse.placement import DEFAULT_GRID
from sglang_sparse.tree import (
    CheckpointTree,
    Freed,
    InsertResult,
    KVOps,
    MatchResult,
    Node,
    RadixTree,
    TreeSnapshot,
    sequence_leaf,
)
from sglang_sparse.tree.lcp import Tokens

from .choose import (
    DEFAULT_PROBATION_BUDGET,
    ChainTracker,
    LawProvider,
    PlanTable,
    ProbationPlanner,
    TailPrior,
    capture_positions,
    marconi_branch_point,
)
from .cost_model import ModelCostModel
from .evict import PROBATION, SPARE, CandidateTerms, Evictor
from .registry import PolicySpec, get_policy


@dataclass(frozen=True)
class CapturePlan:
    """What one request captures: ``positions`` (sorted absolute depths, tokens) and the subset of
    them kept on ``probation`` (evicted before every other state until a request resumes from it;
    see :mod:`.choose`)."""

    positions: tuple[int, ...]
    probation: frozenset[int] = frozenset()
    #: the positions only the tail prior placed on the new leaf (on probation too while it is not
    #: :meth:`~.TailPrior.trusted`); their states' outcomes feed :attr:`~.TailPrior.hit_rate`
    tail: frozenset[int] = frozenset()


@dataclass
class CacheSnapshot:
    """Flat, picklable state of a :class:`HybridCache` (no node objects, nothing recursive in depth).

    ``tree``: :class:`~sglang_sparse.tree.TreeSnapshot` (also carrying ``kv_bytes_per_token`` /
    ``state_bytes``, bytes; the nodes' chain ids); ``plans``: a :meth:`~.choose.PlanTable.snapshot`
    (also carrying ``gamma``/``refresh``/``plan_budget``/``grid``); ``budget_bytes``: KV + states;
    ``cost``: ``None`` for policies that are not FLOP-aware; ``alpha``: the eviction weight in use;
    ``min_cut_gain``, ``branch_grid`` (``None``: the grid) and ``fit_tokens`` (``None``: from the
    budget): as :class:`HybridCache`'s (tokens); ``probation``: state handle -> tier. ``None`` for
    ``plans`` (default configuration), ``tail``, ``prober`` or ``chains`` means a fresh one. Engines
    that keep their own tree build ``tree`` with :class:`~sglang_sparse.tree.TreeSnapshotBuilder`.
    """

    tree: TreeSnapshot
    policy: str | PolicySpec
    budget_bytes: int
    cost: ModelCostModel | None = None
    alpha: float = 0.0
    min_cut_gain: int = 0
    branch_grid: int | None = None
    tail: TailPrior | None = None
    fit_tokens: int | None = None
    probation: Mapping[Any, int] = field(default_factory=dict)
    tail_states: Mapping[Any, None] = field(default_factory=dict)
    prober: ProbationPlanner | None = None
    chains: ChainTracker | None = None
    plans: PlanTable | None = None


class HybridCache:
    """Radix tree + named policy + global byte budget.

    Copies (``copy.deepcopy``, ``pickle``) go through the tree's flat snapshot (see
    :meth:`RadixTree.to_snapshot`): never recursive in tree depth, and the copy takes the same
    future decisions. :meth:`snapshot` / :meth:`from_snapshot` expose the flat form (alpha tuner)."""

    def __init__(
        self,
        policy: str | PolicySpec,
        *,
        budget_bytes: int,
        cost: ModelCostModel | None = None,
        kv_bytes_per_token: int | None = None,
        state_bytes: int | None = None,
        alpha: float = 0.0,
        kv_ops: KVOps | None = None,
        law_provider: LawProvider | None = None,
        gamma: float = 0.99,
        refresh: int = 10,
        plan_budget: int = 4,
        grid: int = DEFAULT_GRID,
        min_cut_gain: int = 0,
        fit_tokens: int | None = None,
        probation_budget: int = DEFAULT_PROBATION_BUDGET,
        branch_grid: int | None = None,
        tail_grid: int | None = None,
        tree: CheckpointTree | None = None,
        plans: PlanTable | None = None,
        evictor: type[CandidateTerms] = Evictor,
    ) -> None:
        self.spec = get_policy(policy)
        if tree is not None:  # its sizes are the sizes
            kv_bytes_per_token = tree.kv_bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token
            state_bytes = tree.state_bytes if state_bytes is None else state_bytes
            if (kv_bytes_per_token, state_bytes) != (tree.kv_bytes_per_token, tree.state_bytes):
                raise ValueError(
                    f"the tree holds {tree.kv_bytes_per_token} KV bytes per token and "
                    f"{tree.state_bytes}-byte states, not {kv_bytes_per_token} and {state_bytes}"
                )
        if cost is not None:
            kv_bytes_per_token = cost.kv_bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token
            state_bytes = cost.state_bytes if state_bytes is None else state_bytes
        if kv_bytes_per_token is None or state_bytes is None:
            raise ValueError("give a cost model or both kv_bytes_per_token and state_bytes")
        if state_bytes <= 0:
            raise ValueError(f"state_bytes must be > 0, got {state_bytes}")
        if budget_bytes < state_bytes:
            raise ValueError(
                f"budget_bytes={budget_bytes} is smaller than one recurrent state ({state_bytes} bytes)"
            )
        if self.spec.needs_law_provider and law_provider is None:
            raise ValueError(f"policy {self.spec.name!r} needs a law_provider (simulator oracle)")
        if self.spec.flop_aware and cost is None:
            raise ValueError(f"policy {self.spec.name!r} is FLOP-aware and needs a cost model")
        self.budget_bytes = int(budget_bytes)
        self.cost = cost
        #: the tree: a new :class:`RadixTree` (the simulator's), or the given one (an engine's mirror,
        #: a tree rebuilt from a snapshot)
        self.tree: CheckpointTree = tree or RadixTree(kv_bytes_per_token, state_bytes, kv_ops=kv_ops)
        #: the per-edge depth histograms and DP plans, by node uid (the given table, or a new one
        #: from ``gamma``/``refresh``/``plan_budget``/``grid``/``law_provider``); it listens to the tree
        self.plans = plans or PlanTable(
            gamma=gamma, refresh=refresh, plan_budget=plan_budget, grid=grid, law_provider=law_provider
        )
        self.tree.listener = self.plans
        self.grid = grid
        if branch_grid is not None and branch_grid < 1:
            raise ValueError(f"branch_grid must be >= 1, got {branch_grid}")
        #: grid of the Marconi branch point (tokens): ``grid`` unless the engine captures states at
        #: any page-aligned depth inside a prefill (see :func:`~.choose.capture_positions`)
        self.branch_grid = int(grid if branch_grid is None else branch_grid)
        if min_cut_gain < 0:
            raise ValueError(f"min_cut_gain must be >= 0, got {min_cut_gain}")
        #: engine cost model of captures inside a prefill (tokens); see :meth:`capture_plan`
        self.min_cut_gain = int(min_cut_gain)
        if tail_grid is not None and tail_grid < 1:
            raise ValueError(f"tail_grid must be >= 1, got {tail_grid}")
        #: the tail prior's candidates: ``grid`` points, or the predicted depths aligned to a finer
        #: ``tail_grid`` (an engine that captures anywhere in a prefill; see :class:`.TailPrior`)
        self.tail = TailPrior(gamma, grid=grid, exact_grid=tail_grid)
        if fit_tokens is not None and fit_tokens < 0:
            raise ValueError(f"fit_tokens must be >= 0, got {fit_tokens}")
        #: the most KV tokens the cache can hold next to one state, default ``(budget_bytes -
        #: state_bytes) // kv_bytes_per_token`` (a longer sequence gets a *fit state*, :mod:`.choose`);
        #: an engine whose KV pool is smaller (SGLang: separate KV and state pools) passes its size
        self.fit_tokens: int | None = (
            int(fit_tokens)
            if fit_tokens is not None
            else ((self.budget_bytes - state_bytes) // kv_bytes_per_token if kv_bytes_per_token else None)
        )
        #: KV tokens one state's bytes would hold (room a fit state leaves per extra state)
        self._state_tokens = -(-state_bytes // kv_bytes_per_token) if kv_bytes_per_token else 0
        #: state handles on probation -> tier (:data:`~.evict.PROBATION` / :data:`~.evict.SPARE`)
        self.probation: dict[Any, int] = {}
        self.prober = ProbationPlanner(gamma, grid=grid, budget=probation_budget)
        #: handles of states the tail prior placed that no request has resumed from yet
        self.tail_states: dict[Any, None] = {}
        #: online sessions (:mod:`.choose`), tracked for every policy, scored only with ``chain_recency``
        self.chains = ChainTracker(grid=grid)
        #: the eviction rounds (:class:`Evictor`, or the tests' reference of the same terms)
        self.evictor = evictor(
            self.tree,
            self.spec.eviction,
            self.cost,
            alpha if self.spec.flop_aware else 0.0,
            capacity_bytes=self.budget_bytes,
            probation=self.probation,
            chains=self.chains,
        )

    # ------------------------------------------------------------------ flat snapshot

    def snapshot(self) -> CacheSnapshot:
        """The cache's state as flat data (tree handles shared, the tail prior copied)."""
        return CacheSnapshot(
            tree=self.tree.to_snapshot(),
            policy=self.spec,
            budget_bytes=self.budget_bytes,
            cost=self.cost,
            alpha=self.alpha,
            min_cut_gain=self.min_cut_gain,
            branch_grid=self.branch_grid,
            tail=copy.deepcopy(self.tail),
            fit_tokens=self.fit_tokens,
            probation=dict(self.probation),
            tail_states=dict(self.tail_states),
            prober=copy.deepcopy(self.prober),
            chains=copy.deepcopy(self.chains),
            plans=self.plans.snapshot(),
        )

    @classmethod
    def from_snapshot(
        cls,
        snap: CacheSnapshot,
        *,
        kv_ops: KVOps | None = None,
        law_provider: LawProvider | None = None,
    ) -> HybridCache:
        """A cache equal to the one ``snap`` describes (same future decisions); ``snap`` is not
        modified and can be reused (each call builds an independent cache)."""
        t = snap.tree
        p = snap.plans if snap.plans is not None else PlanTable()
        cache = cls(
            snap.policy,
            budget_bytes=snap.budget_bytes,
            cost=snap.cost,
            kv_bytes_per_token=t.kv_bytes_per_token,
            state_bytes=t.state_bytes,
            alpha=snap.alpha,
            kv_ops=kv_ops,
            law_provider=law_provider,
            gamma=p.gamma,
            refresh=p.refresh,
            plan_budget=p.plan_budget,
            grid=p.grid,
            min_cut_gain=snap.min_cut_gain,
            fit_tokens=snap.fit_tokens,
            branch_grid=snap.branch_grid,
            tree=RadixTree.from_snapshot(t, kv_ops=kv_ops),
            plans=p.with_law(law_provider),
        )
        if snap.tail is not None:
            cache.tail = copy.deepcopy(snap.tail)
        cache.probation.update(snap.probation)
        cache.tail_states.update(snap.tail_states)
        if snap.prober is not None:
            cache.prober = copy.deepcopy(snap.prober)
        if snap.chains is not None:
            cache.chains = copy.deepcopy(snap.chains)
            cache.evictor.chains = cache.chains
        elif t.chain is not None and len(t.chain) and int(t.chain.max()) >= 0:
            # chain ids without their statistics: they score as chain-less; new ids must not reuse them
            cache.chains.next_id = int(t.chain.max()) + 1
        return cache

    # ------------------------------------------------------------------ knobs

    @property
    def alpha(self) -> float:
        return self.evictor.alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if not self.spec.flop_aware and value != 0:
            raise ValueError(f"policy {self.spec.name!r} is not FLOP-aware; alpha must stay 0")
        if value < 0:
            raise ValueError(f"alpha must be >= 0, got {value}")
        self.evictor.alpha = float(value)

    @property
    def bytes_used(self) -> int:
        return self.tree.bytes_used

    # ------------------------------------------------------------------ per-request API

    def match(self, tokens: Tokens) -> MatchResult:
        """Pure longest-prefix match (see :meth:`RadixTree.match`)."""
        return self.tree.match(tokens)

    def observe(self, match: MatchResult) -> None:
        """Record the admitted request's match (clock, recency, depth law, re-plans, tail prior,
        and an arrival of the online session it continues, if any: :mod:`.choose`)."""
        node = match.node
        leaf = sequence_leaf(node) if match.kv_depth >= self.grid and node.parent is not None else None
        if leaf is not None:
            # Divergences above the first grid step are not evidence (no checkpoint serves them);
            # nor is a leaf cut back to a state (``seq_end`` False: no sequence ended there). The match
            # may end one split above the leaf (an engine that splits where a match ends).
            self.tail.observe_suffix(leaf.end + leaf.seq_tail - match.kv_depth)
        if self.spec.admission == "sparse":
            self.prober.observe(match.kv_depth)
        if match.ckpt_handle in self.tail_states:
            del self.tail_states[match.ckpt_handle]
            self.tail.observe_outcome(True)
        self.promote(match)
        cont = self.chains.continuation(match)
        before = cont.last_access if cont is not None else 0
        self.plans.observe(self.tree, match)
        if cont is not None:
            known = cont.chain >= 0
            self.chains.arrive(cont, self.tree.clock, before)
            if not known:
                self.chains.collect(self.tree.nodes())

    def end_sequence(self, node: Node) -> None:
        """A sequence (a request's input + output) ended at ``node``'s end: it joins the chain it
        continued, if any (:meth:`~.choose.ChainTracker.end_sequence`). :meth:`insert` calls it; an
        engine mirror calls it on a request's final insert."""
        self.chains.end_sequence(node)

    def promote(self, match: MatchResult) -> bool:
        """A request resumes from ``match``'s checkpoint: if it was on probation it becomes a normal
        state (True)."""
        h = match.ckpt_handle
        if h is None or h not in self.probation:
            return False
        del self.probation[h]
        self.evictor.touch(match.ckpt_node)
        return True

    def supersede(self, match: MatchResult) -> bool:
        """A request resumed from a first-sight guess (a probation state, promoted by
        :meth:`observe`) and its plan captures the exact point where it diverges
        (``match.kv_depth``): the guess, above that point, now serves only requests that would
        diverge between the two depths, none seen yet, so it becomes a *spare* state (evicted first
        of all) instead of a normal one. Returns whether it was demoted. Call after :meth:`observe`
        and :meth:`plan`."""
        h = match.ckpt_handle
        if h is None or match.ckpt_node is None or h in self.probation:
            return False
        self.probation[h] = SPARE
        self.evictor.touch(match.ckpt_node)
        return True

    def capture_plan(self, match: MatchResult, input_len: int, total_len: int | None = None) -> list[int]:
        """Positions in ``(match.resume_depth, total_len]`` whose recurrent state the engine should
        capture (:meth:`plan`'s positions, probation ones included)."""
        return list(self.plan(match, input_len, total_len).positions)

    def plan(
        self,
        match: MatchResult,
        input_len: int,
        total_len: int | None = None,
        named: Sequence[int] = (),
    ) -> CapturePlan:
        """The states this request captures: positions in ``(match.resume_depth, total_len]``,
        ``<= input_len`` during prefill, deeper ones during decode (``total_len`` defaults to
        ``input_len``), and which of them are kept on probation.

        ``sparse`` admission: its planned positions (:func:`~.choose.capture_positions`) and the
        positions the request ``named`` itself (where an application knows divergences are), plus
        on probation up to ``probation_budget`` first-sight positions on the new part of the prompt
        (:class:`~.choose.ProbationPlanner`), the last-token state when it is not planned, and the
        tail prior's positions while it is not :meth:`~.choose.TailPrior.trusted`.

        ``min_cut_gain`` (engine cost, tokens; 0 = captures are free): a position inside the prefill
        (``< input_len``) is dropped when it lies fewer than ``min_cut_gain`` tokens after the
        resume depth or the previous kept position (an engine capturing only at prefill-chunk ends
        pays one extra forward per position)."""
        total = input_len if total_len is None else total_len
        from_tail: set[int] = set()
        pos = capture_positions(
            self.spec.admission,
            self.tree,
            self.plans,
            match,
            input_len,
            total,
            grid=self.grid,
            block=self.spec.block,
            tail=self.tail,
            fit=self.fit_tokens,
            state_tokens=self._state_tokens,
            branch_grid=self.branch_grid,
            tail_out=from_tail,
        )
        probation: set[int] = set()
        if self.spec.admission == "sparse":
            pos = sorted(set(pos).union(p for p in named if match.resume_depth < p <= input_len))
            lo = max(match.kv_depth, match.resume_depth)
            fits = self.fit_tokens is None or total <= self.fit_tokens
            if fits:
                probation.update(self.prober.positions(lo, input_len, exclude=pos))
            if total > match.resume_depth and total not in pos and fits:
                probation.add(total)
            if self.branch_grid < self.grid:
                fb = marconi_branch_point(match, input_len, self.grid)
                if fb is not None and fb > match.resume_depth and fb not in pos:
                    probation.add(fb)
            if not self.tail.trusted():  # its positions become first-sight guesses (:mod:`.choose`)
                probation.update(from_tail.intersection(pos))  # not what the fit state displaced
            pos = sorted(set(pos) | probation)
        if self.min_cut_gain > 0:
            kept, prev = [], match.resume_depth
            for p in pos:
                if p < input_len and p - prev < self.min_cut_gain:
                    continue
                kept.append(p)
                prev = p
            pos = kept
        return CapturePlan(
            tuple(pos), frozenset(probation.intersection(pos)), frozenset(from_tail.intersection(pos))
        )

    def insert(
        self,
        tokens: Tokens,
        kv: Any = None,
        checkpoints: Mapping[int, Any] | None = None,
        *,
        kv_offset: int = 0,
        probation: frozenset[int] | set[int] = frozenset(),
        tail: frozenset[int] | set[int] = frozenset(),
    ) -> InsertResult:
        """Insert (see :meth:`RadixTree.insert`); the caller frees ``unused_kv`` / ``unused_states``.
        The new states at ``probation`` positions go on probation (a position that already held a
        state keeps it, as it was); new states at ``tail`` positions are followed until a request
        resumes from them or they are freed (:meth:`TailPrior.observe_outcome`)."""
        res = self.tree.insert(tokens, kv, checkpoints, kv_offset=kv_offset)
        self.end_sequence(res.node)
        if (probation or tail) and checkpoints:
            unused = set(res.unused_states)
            for p in probation:
                h = checkpoints.get(p)
                if h is not None and h not in unused:
                    self.probation[h] = PROBATION
            for p in tail:
                h = checkpoints.get(p)
                if h is not None and h not in unused:
                    self.tail_states[h] = None
        return res

    def lock(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    def evict(self, num_bytes: int) -> Freed:
        """Free at least ``num_bytes`` if possible (locked items are never evicted)."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        return self.forget(self.evictor.evict(self.tree.bytes_used - num_bytes))

    def evict_to_budget(self) -> Freed:
        """Evict until ``bytes_used <= budget_bytes`` (or only locked items remain)."""
        return self.forget(self.evictor.evict(self.budget_bytes))

    def forget(self, freed: Freed) -> Freed:
        """Drop freed state handles from the probation set and resolve the tail prior's among them
        (freed unused); returns ``freed``."""
        for h in freed.states:
            self.state_freed(h)
        return freed

    def state_freed(self, handle: Any) -> None:
        """The state ``handle`` is gone: it leaves the probation set, and if the tail prior placed it
        and no request resumed from it, that is a miss."""
        self.probation.pop(handle, None)
        if handle in self.tail_states:
            del self.tail_states[handle]
            self.tail.observe_outcome(False)

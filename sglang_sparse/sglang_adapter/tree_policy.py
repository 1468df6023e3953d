"""The policy side of the ``sparse`` backend, on a mirror of SGLang's own tree (no SGLang import).

SGLang's ``UnifiedRadixCache`` is the one authority on what is cached (tokens, KV indices, Mamba
pool slots, locks). The policy keeps, next to it, a :class:`~sglang_sparse.tree.MirrorTree`: one
token-free node per SGLang node, keyed by SGLang's node id and changed only by SGLang's structural
events (new node, split, leaf removed, state attached, state freed, reset). On it runs the very
code the simulator runs, through :class:`~sglang_sparse.policy.HybridCache`: **capture**
(:meth:`TreePolicy.plan`: once per request, from SGLang's own match, no token re-matched), **keep**
(:meth:`TreePolicy.admit`), **evict** (:meth:`TreePolicy.eviction_order`,
:meth:`TreePolicy.scored_states`: the :class:`~sglang_sparse.policy.Evictor`'s candidates and score,
read lazily from its incremental candidate index) and **alpha** (:meth:`TreePolicy.finish`: each
tuning window is replayed in a worker process, :mod:`sglang_sparse.sim.replay_worker`, from a flat
copy of SGLang's tree taken when the window began; its alpha applies ``tune_window // 4`` finished
requests after the window closed, so every TP rank switches at the same request). Online sessions come
from the same events: a match ending at a leaf's end continues one (``plan``), a request's final
insert (``on_insert`` with ``finished``) hangs its sequence on it.

Memory: O(nodes) for the mirror; the tuning window holds the token ids of its requests (the
replay's input) and the snapshot of the tree it replays from, while a window is open.
Everything is a deterministic function of the request stream: logical clocks, no wall time.

Positions a request names itself (planned, not on probation, from the first request on; the request
format is in ``docs/sparse_backend.md``, "Positions the request names"): they travel in SGLang's
``sampling_params.custom_params`` (JSON-safe, it reaches the scheduler with the request on every
path) under :data:`CHECKPOINTS_KEY`. Chat message boundaries (:func:`add_chat_boundaries`) are
computed in the HTTP server process, one template render and tokenization per boundary, never in
the scheduler, where :func:`request_checkpoints` reads them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from sglang_sparse.placement import DEFAULT_GRID
from sglang_sparse.policy import AlphaTuner, CacheSnapshot, HybridCache, ModelCostModel, get_policy
from sglang_sparse.policy.choose import TAIL_WARMUP, extends_leaf
from sglang_sparse.policy.evict import PROBATION, SPARE
from sglang_sparse.policy.host_tier import HostCost, HostTierConfig
from sglang_sparse.sim.replay_worker import ReplayWorker
from sglang_sparse.tree import MirrorError, MirrorTree, Node, TreeSnapshotBuilder

from .config import SparseConfig

logger = logging.getLogger("sglang_sparse")

#: Plans kept for requests that were never released (aborted while waiting): bounded.
_MAX_PLANS = 65536

#: ``(node_id, parent_id, edge token ids, holds a state)`` of every non-root engine node, parents
#: before children: how the engine describes its tree for checks and tuning snapshots.
EngineNode = tuple[int, int, Any, bool]


@dataclass
class RequestPlan:
    """Capture plan of one request (absolute token positions)."""

    input_len: int
    positions: tuple[int, ...]  # the policy's plan, (resume, total]
    cuts: tuple[int, ...]  # planned positions strictly inside the prompt (after the resume point)
    engine_prefix: int = 0
    engine_kv: int = 0
    probation: frozenset[int] = frozenset()  # the positions kept on probation (evicted first)
    exact_finish: bool = False  # keep the finish state at the end of its key (see wants_exact_finish)
    tail: frozenset[int] = frozenset()  # the positions the tail prior placed (outcomes followed)


@dataclass
class PolicyStats:
    """Counters (plain ints) of the backend; see :meth:`TreePolicy.snapshot`."""

    requests: int = 0
    finished: int = 0
    hit_requests: int = 0
    input_tokens: int = 0
    resume_tokens: int = 0  # SGLang device_prefix_len (state-aligned, what is really skipped)
    kv_hit_tokens: int = 0  # SGLang full_kv_hit_length (KV match, needs a state to be usable)
    planned_positions: int = 0
    cuts_applied: int = 0
    ckpt_admitted: int = 0
    ckpt_rejected: int = 0
    ckpt_final: int = 0
    #: offered states kept on probation (first-sight positions, an unplanned finish; evicted first)
    ckpt_probation: int = 0
    #: engine-offered states no plan asked for, kept as spare (a free slot; evicted first of all)
    ckpt_spare: int = 0
    #: requests that resumed from a probation or spare state (which then became a normal one)
    probation_hits: int = 0
    #: first-sight guesses a request resumed from and then captured its exact divergence below:
    #: demoted to spare (:meth:`~sglang_sparse.policy.cache.HybridCache.supersede`)
    superseded: int = 0
    states_inserted: int = 0
    #: states the mirror learnt of from a HiCache transfer (load back / prefetch) it did not hold
    states_restored: int = 0
    states_evicted: int = 0
    kv_leaves_evicted: int = 0
    eviction_walks: int = 0
    kv_eviction_walks: int = 0
    #: states SGLang evicted that the policy offered no score for (SGLang LRU fallback)
    unscored_evictions: int = 0
    #: HiCache write-back, ``SGLANG_SPARSE_DEMOTE=policy``: nodes SGLang handed back to the device
    #: state walk after backing them up (they became leaves or lost their device KV), re-selected
    backups_reselected: int = 0
    #: HiCache: host-only states dropped in the policy's order (``drive_host_eviction``)
    host_state_drops: int = 0
    #: HiCache: host leaves (KV, and the state a leaf holds) dropped in the policy's order
    host_kv_drops: int = 0
    #: engine events that did not fit the mirror (must stay 0; each one is logged)
    mirror_errors: int = 0
    alpha_tunes: list[tuple[int, float]] = field(default_factory=list)
    #: tuning windows closed (each took a snapshot of SGLang's tree when it began)
    tune_windows: int = 0
    #: tuning replays started (a window whose hit rate drifted, or the first one)
    tune_runs: int = 0
    tune_failures: int = 0
    #: CPU seconds the replay worker process has used (read when a tuning run is applied)
    tune_worker_cpu_s: float = 0.0
    #: wall seconds the scheduler waited for a replay late at its logical time (the worker runs in
    #: the idle scheduling class). Neither reading is ever an input to a decision
    tune_wait_s: float = 0.0


class TreePolicy:
    """Policy state and decisions of the ``sparse`` backend (see the module docstring). ``root_id``:
    SGLang's root node id (the mirror's root). Events come from the SGLang adapter (:mod:`.cache`):
    :meth:`on_node_added`, :meth:`on_node_split`, :meth:`on_leaf_removed`, :meth:`on_state_set`,
    :meth:`on_state_freed`, :meth:`on_insert`, :meth:`reset`."""

    def __init__(
        self,
        config: SparseConfig,
        *,
        budget_bytes: int,
        cost: ModelCostModel | None = None,
        kv_bytes_per_token: int | None = None,
        state_bytes: int | None = None,
        fit_tokens: int | None = None,
        root_id: int = 0,
    ) -> None:
        if config.grid is None:  # auto outside the backend factory: the 64-token chunk grid
            config = dataclasses.replace(config, grid=DEFAULT_GRID)
        self.config = config
        #: KV tokens the engine's pool holds (the fit-state limit of :class:`HybridCache`)
        self.fit_tokens = None if fit_tokens is None else int(fit_tokens)
        self.spec = get_policy(config.policy)
        self.cost = cost
        self._kv_bytes = int(
            kv_bytes_per_token if kv_bytes_per_token is not None else cost.kv_bytes_per_token
        )
        self._state_bytes = int(state_bytes if state_bytes is not None else cost.state_bytes)
        self.budget_bytes = max(int(budget_bytes), self._state_bytes)
        self.tuner: AlphaTuner | None = None
        self.tuning = self.spec.flop_aware and config.alpha_auto
        self.stats = PolicyStats()
        #: the child process that replays tuning windows (started at the first tuning run)
        self._worker: ReplayWorker | None = None
        self._alpha = 0.0 if not self.spec.flop_aware or config.alpha is None else float(config.alpha)
        #: HiCache: the host tier below the device (:meth:`set_host_tier`; None without one)
        self.host: HostTierConfig | None = None
        #: the device's bytes (KV + states) the host tier sits below
        self.device_bytes = self.budget_bytes
        self.reset(root_id)

    def set_host_tier(self, host: HostTierConfig) -> None:
        """Score two tiers as the simulator does (:mod:`~sglang_sparse.policy.host_tier`): the
        policy's cache becomes the logical cache (``host.logical_bytes`` of the device's
        ``budget_bytes``) and, for a FLOP-aware policy with ``config.host_cost``, a state's FLOPs
        saved are net of its expected load (:class:`HostCost`). ``fit_tokens`` stays the device's
        (the forward runs there). Call before anything is cached (the backend factory, right after
        SGLang attached its host pools)."""
        if self.mirror.num_nodes or self._plans:
            raise RuntimeError("set_host_tier: the cache already holds requests")
        self.host = host
        if self.cost is not None and self.spec.flop_aware and self.config.host_cost:
            self.cost = HostCost(
                self.cost,
                host,
                host.host_share(self.device_bytes),
                kv_bytes_per_token=self._kv_bytes,
                state_bytes=self._state_bytes,
            )
        if self.fit_tokens is None and self._kv_bytes:  # the device's, not the logical cache's
            self.fit_tokens = (self.device_bytes - self._state_bytes) // self._kv_bytes
        self.budget_bytes = host.logical_bytes(self.device_bytes)
        self.reset(self.mirror.root.uid)

    # ------------------------------------------------------------------ lifecycle

    def _hybrid_cache(self, tree: MirrorTree) -> HybridCache:
        """A :class:`HybridCache` with this backend's options over ``tree``."""
        cache = HybridCache(
            self.spec,
            budget_bytes=self.budget_bytes,
            cost=self.cost,
            kv_bytes_per_token=self._kv_bytes,
            state_bytes=self._state_bytes,
            gamma=self.config.gamma,
            refresh=self.config.refresh,
            plan_budget=self.config.edge_budget,
            grid=self.config.grid,
            min_cut_gain=self.config.min_cut_gain or 0,  # None (auto) outside the factory: 0
            fit_tokens=self.fit_tokens,
            probation_budget=self.config.probation,
            branch_grid=self.config.branch_grid,  # None (auto) outside the factory: the grid
            tail_grid=self.config.tail_grid,  # None (auto) outside the factory: the grid
            tree=tree,
        )
        if self.spec.flop_aware:
            cache.alpha = self._alpha
        return cache

    def reset(self, root_id: int) -> None:
        """Forget everything cached (SGLang ``reset`` / ``flush_cache``); counters and alpha stay."""
        mirror = MirrorTree(self._kv_bytes, self._state_bytes, root_id=root_id)
        self.mirror = mirror
        self.cache = self._hybrid_cache(mirror)
        mirror.on_change = self.cache.evictor.touch
        self._plans: OrderedDict[str, RequestPlan] = OrderedDict()
        self._window: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.config.tune_window)
        self._window_hits: deque[float] = deque(maxlen=self.config.tune_window)
        self._since_tune = 0
        self._snapshot: CacheSnapshot | None = None
        #: (apply at finished count, scores future, window end, alpha in use when it started)
        self._pending_tune: tuple[int, Future, int, float | None] | None = None
        self._rounds = 0  # eviction rounds computed (a walk's frozen keys stay valid while unchanged)
        #: the probation tier of the next state SGLang attaches (:meth:`admit` said so; 0: none)
        self._probation_next = 0
        #: the request whose plan admitted the next state SGLang attaches (None: a spare or no plan)
        self._owner_next: str | None = None
        #: whether the next state SGLang attaches is one the tail prior placed (its outcome followed)
        self._tail_next = False
        #: rid -> SGLang node ids of the states its plan stored (while the request runs)
        self._own: dict[str, set[int]] = {}
        #: state handles an eviction walk skips (:meth:`protecting`)
        self.protected: frozenset[int] = frozenset()

    @property
    def alpha(self) -> float:
        return self.cache.alpha

    def close(self) -> None:
        """Stop the tuning worker (pending results are dropped)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # ------------------------------------------------------------------ engine events

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a mirror event; a misfit is counted and logged (loud), never raised into SGLang."""
        try:
            return fn(*args)
        except MirrorError as e:
            self.stats.mirror_errors += 1
            logger.error("sparse cache: mirror drift on %s: %s", what, e)
            return None

    def on_node_added(self, node_id: int, parent_id: int, length: int, first: int) -> None:
        self._guard("add", self.mirror.add_node, node_id, parent_id, length, first)

    def on_node_split(self, child_id: int, upper_id: int, k: int, lower_first: int) -> None:
        self._guard("split", self.mirror.split_node, child_id, upper_id, k, lower_first)

    def on_leaf_removed(self, node_id: int) -> None:
        self.stats.kv_leaves_evicted += 1
        self.cache.state_freed(node_id)
        self._guard("remove", self.mirror.remove_leaf, node_id)

    def on_state_set(self, node_id: int) -> None:
        if self._guard("state", self.mirror.set_state, node_id):
            self.stats.states_inserted += 1
            if self._probation_next:
                self.cache.probation[node_id] = self._probation_next
            if self._tail_next:
                self.cache.tail_states[node_id] = None
            if self._owner_next is not None:
                self._own.setdefault(self._owner_next, set()).add(node_id)
        self._clear_next()

    def _clear_next(self) -> None:
        """Forget what :meth:`admit` said about the next state SGLang attaches."""
        self._probation_next = 0
        self._owner_next = None
        self._tail_next = False

    def on_state_restored(self, node_id: int) -> None:
        """SGLang holds a state at ``node_id`` that reached it through a HiCache transfer (a load
        back from the host, a prefetch from storage), not an admitted checkpoint: the mirror gets it
        if it lacks it; no admission's probation tier or owner is consumed."""
        n = self.mirror.get(node_id)
        if n is None or n.end in n.checkpoints:
            return
        if self._guard("restore", self.mirror.set_state, node_id):
            self.stats.states_restored += 1

    def on_state_freed(self, node_id: int) -> None:
        self.cache.state_freed(node_id)
        if self.mirror.drop_state(node_id):
            self.stats.states_evicted += 1

    def on_insert(self, node_id: int, *, finished: bool = False, seq_len: int | None = None) -> None:
        """A checkpoint inserted through ``node_id`` (its path's recency, as the simulator's insert);
        ``finished``: the request's final insert, so a sequence ended at ``node_id``'s end and joins
        the online session it continued (``HybridCache.end_sequence``); ``seq_len``: that
        sequence's cache key length (tokens), when SGLang kept less of it."""
        node = self._guard(
            "insert", functools.partial(self.mirror.touch_path, seq_len=seq_len), node_id, finished
        )
        if node is not None and finished:
            self.cache.end_sequence(node)

    def node_end(self, node_id: int) -> int | None:
        """Depth (tokens) at which the mirror's node ``node_id`` ends, ``None`` if unknown."""
        n = self.mirror.get(node_id)
        return None if n is None else int(n.end)

    def check(self, engine_nodes: Iterable[EngineNode]) -> None:
        """Assert that the mirror equals the engine's tree (:class:`MirrorError` otherwise)."""
        self.mirror.check_against((nid, pid, len(key), bool(st)) for nid, pid, key, st in engine_nodes)

    # ------------------------------------------------------------------ capture

    def plan(
        self,
        rid: str,
        input_len: int,
        max_new_tokens: int,
        *,
        kv_node_id: int | None,
        engine_kv: int,
        engine_prefix: int,
        named: Sequence[int] = (),
    ) -> RequestPlan:
        """The request's capture plan from SGLang's match of its prompt (``kv_node_id``: the node
        its KV match ends on, at depth ``engine_kv``; ``engine_prefix``: the state-aligned depth it
        resumes from; ``named``: :func:`request_checkpoints`). The first call per ``rid`` observes
        the match; later calls return the plan."""
        p = self._plans.get(rid)
        if p is not None:
            return p
        n = int(input_len)
        m = self._guard("match", self.mirror.match_result, kv_node_id, int(engine_kv), int(engine_prefix))
        if m is None:
            m = self.mirror.match_result(None, 0, 0)
        tier = self.cache.probation.get(m.ckpt_handle) if m.ckpt_handle is not None else None
        if tier is not None:
            self.stats.probation_hits += 1  # observe() promotes it: a normal state from now on
        self.cache.observe(m)
        cp = self.cache.plan(m, n, n + max(int(max_new_tokens) - 1, 0), named=named)
        positions = cp.positions
        exact_branch = m.kv_depth < n and m.kv_depth in positions and m.kv_depth not in cp.probation
        if tier == PROBATION and exact_branch:
            # It resumed from a first-sight guess and now captures where it really diverges.
            self.stats.superseded += int(self.cache.supersede(m))
        cuts = tuple(q for q in positions if engine_prefix < q < n)
        # exact_finish: see wants_exact_finish
        past = [q for q in positions if q > n]
        planned_past = any(q not in cp.probation for q in past)
        warm = self.cache.tail.observations >= TAIL_WARMUP
        exact = bool(past) and (extends_leaf(m) or (planned_past and warm))
        p = RequestPlan(n, positions, cuts, int(engine_prefix), int(engine_kv), cp.probation, exact, cp.tail)
        self._plans[rid] = p
        if len(self._plans) > _MAX_PLANS:
            self._own.pop(self._plans.popitem(last=False)[0], None)
        s = self.stats
        s.requests += 1
        s.hit_requests += int(engine_prefix > 0)
        s.input_tokens += n
        s.resume_tokens += int(engine_prefix)
        s.kv_hit_tokens += int(engine_kv)
        s.planned_positions += len(positions)
        return p

    def wants_final_state(self, rid: str) -> bool:
        """Does the plan of ``rid`` hold a position past its prompt (a decode-time or last-token
        state)? A request without a plan keeps the engine's behaviour (True)."""
        p = self._plans.get(rid)
        return p is None or (bool(p.positions) and p.positions[-1] > p.input_len)

    def wants_exact_finish(self, rid: str) -> bool:
        """Should the engine keep ``rid``'s finish state at the end of its key rather than on its
        grid (a later request is expected to continue it exactly)? Yes when the plan holds a
        position past the prompt from evidence: ``rid`` continues a sequence's end itself (a session
        turn, even on probation), or that position is a normal one and the tail prior is warm. The
        cold start's last-token guess does not count. No plan: no (engine behaviour)."""
        p = self._plans.get(rid)
        return p is not None and p.exact_finish

    def get_plan(self, rid: str) -> RequestPlan | None:
        return self._plans.get(rid)

    def has_plan(self, rid: str) -> bool:
        return rid in self._plans

    def next_cut(self, rid: str, prefix_len: int) -> int | None:
        """Smallest planned cut strictly after ``prefix_len`` (``None``: no cut)."""
        p = self._plans.get(rid)
        if p is None:
            return None
        for c in p.cuts:
            if c > prefix_len:
                return c
        return None

    # ------------------------------------------------------------------ keep

    def admit(self, rid: str, position: int, *, finished: bool, free_slots: int = 0) -> bool:
        """Keep the state SGLang offers for ``rid`` at ``position`` (tokens)? Admission decides
        every state, whatever the engine offers it for (chunk end, prompt end, finish, capture):

        * a request without a plan (not admitted through our adder) keeps SGLang's behaviour;
        * a planned position, whatever offers it (a finish too: on extra_buffer a request that
          finishes in its last extend offers SGLang's grid snapshot inside the prompt): kept, on
          probation if the plan keeps it there (the state :meth:`on_state_set` attaches next is
          evicted before every normal state until a request resumes from it);
        * the finish at any other depth (wherever the engine stops, at most ``total_len``): kept if
          the plan wants a state past the prompt, on probation if only a probation one;
        * anything else (an unplanned chunk end or prompt end, which the engine computed anyway):
          a *spare* state, kept (lower still than probation) only while probation is on
          (``SGLANG_SPARSE_PROBATION`` > 0) and it takes a free slot (``free_slots`` > 0, before
          this one is allocated) or an older spare state's; else rejected. So chunk ends never
          displace a planned or first-sight state, whatever the chunk size."""
        self._clear_next()
        p = self._plans.get(rid)
        if p is None:
            self.stats.ckpt_final += int(finished)
            self.stats.ckpt_admitted += int(not finished)
            return True
        if position in p.positions:
            self._owner_next = rid
            self.stats.ckpt_final += int(finished)
            self._tail_next = position in p.tail
            if position in p.probation:
                self._probation_next = PROBATION
                self.stats.ckpt_probation += 1
            else:
                self.stats.ckpt_admitted += 1
            return True
        if finished:
            past = [q for q in p.positions if q > p.input_len]
            if not past:
                self.stats.ckpt_rejected += 1
                return False
            self.stats.ckpt_final += 1
            self._owner_next = rid
            if all(q in p.probation for q in past):
                self._probation_next = PROBATION
                self.stats.ckpt_probation += 1
            return True
        if self.config.probation > 0 and (free_slots > 0 or SPARE in self.cache.probation.values()):
            self._probation_next = SPARE
            self.stats.ckpt_spare += 1
            return True
        self.stats.ckpt_rejected += 1
        return False

    def end_checkpoint(self) -> None:
        """The engine finished one checkpoint (whether or not a state was attached)."""
        self._clear_next()

    def own_states(self, rids: Iterable[str]) -> frozenset[int]:
        """SGLang node ids of the states the plans of ``rids`` stored while they run (planned and
        probation positions, finishes; not spare states)."""
        out: set[int] = set()
        for rid in rids:
            out |= self._own.get(rid, set())
        return frozenset(out)

    @contextlib.contextmanager
    def protecting(self, handles: frozenset[int]) -> Iterator[None]:
        """State eviction walks inside the block skip ``handles`` (see :mod:`.capture`: a
        request's captures never evict the states its own plan stored earlier)."""
        prev, self.protected = self.protected, frozenset(handles)
        try:
            yield
        finally:
            self.protected = prev

    def is_speculative(self, node_id: int) -> bool:
        """Whether the state at ``node_id`` is on probation (evicted before every other state)."""
        return node_id in self.cache.probation

    # ------------------------------------------------------------------ evict

    def _round(self) -> tuple[np.ndarray, list[Node], np.ndarray, np.ndarray, np.ndarray]:
        """The eviction round a walk starting now would use: a private copy of every candidate's
        key (``-inf`` for unservable ones; lowest evicted first), and the index's node, uid, kind
        and position columns (views: valid while ``self._rounds`` is unchanged, i.e. until the
        next round syncs the index)."""
        idx = self.cache.evictor.index
        idx.sync()
        self._rounds += 1
        n = idx.n
        if n == 0:
            e = np.empty(0, dtype=np.int64)
            return np.empty(0), [], e, e, e
        _, key, _ = idx.round_scores(self.cache.evictor.alpha)
        return key.copy(), idx.node, idx.uid[:n], idx.kind[:n], idx.pos[:n]

    def eviction_order(self) -> Iterator[int]:
        """State handles (SGLang node ids) in the policy's eviction order, lazily (the first costs
        one vectorised pass over the candidates, later ones come in chunks of growing size): a
        handle covered by several candidates at its lowest key, states on probation first (oldest
        first), handles in :attr:`protected` never. The caller skips locked or gone handles and
        falls back to its own order when this runs out (also when another eviction round starts
        before this one is consumed: its rows are then stale)."""
        self.stats.eviction_walks += 1
        seen: set[int] = set(self.protected)
        key, nodes, _, _, _ = self._round()
        at = self._rounds
        for i in self.cache.evictor.index.order(key):
            if self._rounds != at:  # another round re-synced the index: its rows are not ours
                return
            for h in nodes[i].checkpoints.values():
                if h not in seen:
                    seen.add(h)
                    yield h

    def scored_states(
        self, only: np.ndarray | None = None
    ) -> tuple[Iterator[tuple[float, int]], Callable[[int], float | None]]:
        """One eviction round starting now, for a walk that merges it with its own candidates:
        ``(stream, key_of)``. ``stream`` yields ``(key, handle)`` in ascending key order (lowest
        evicted first; ``-inf`` unservable), lazily (see :meth:`CandidateIndex.order`), equal keys
        adjacent; a handle covered by several candidates comes once per candidate. ``key_of(h)`` is
        the key of handle ``h`` in the same round (its lowest candidate's), ``None`` if the policy
        offers no candidate for it: O(1) while no other round ran, after one the rows are mapped
        once. The stream stops early if another round re-syncs the index. ``only`` (SGLang node
        ids): the stream skips every other candidate (one vectorised mask; ``key_of`` is not
        restricted)."""
        key, nodes, uid, _, _ = self._round()
        at = self._rounds
        idx = self.cache.evictor.index
        by_id = self.mirror.by_id
        rows: dict[int, list[int]] | None = None

        exclude = None if only is None else ~np.isin(uid, only)

        def stream() -> Iterator[tuple[float, int]]:
            for i in idx.order(key, exclude=exclude):
                if self._rounds != at:  # another round re-synced the index: its rows are not ours
                    return
                k = float(key[i])
                for h in nodes[i].checkpoints.values():
                    yield k, h

        def key_of(node_id: int) -> float | None:
            nonlocal rows
            if rows is None and self._rounds == at:  # the index's rows are still this round's
                m = by_id.get(node_id)
                info = idx.nodes.get(m) if m is not None else None
                r = info.slots if info is not None else None
            else:
                if rows is None:  # another round reordered the index: map this round's rows once
                    rows = {}
                    for i, nd in enumerate(nodes):
                        rows.setdefault(nd.uid, []).append(i)
                r = rows.get(node_id)
            if not r:
                return None
            return float(min(key[i] for i in r))

        return stream(), key_of

    def state_key_fn(self) -> Callable[[int], float | None]:
        """A function: SGLang node id -> the policy key of the state it holds (lowest evicted
        first; ``-inf`` unservable), ``None`` if the policy offers no candidate for it. The keys are
        those of a round starting now, frozen for one eviction walk (see :meth:`scored_states`)."""
        return self.scored_states()[1]

    def speculative_ids(self) -> Collection[int]:
        """SGLang node ids of the states on probation (see :meth:`admit`); a live view."""
        return self.cache.probation

    # ------------------------------------------------------------------ finish / alpha

    def finish(
        self,
        rid: str,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        export_tree: Callable[[], Iterable[EngineNode]] | None = None,
    ) -> None:
        """A request left the engine: drop its plan, feed the alpha tuner's window. ``export_tree``
        describes SGLang's tree (parents first) for the tuning snapshot; it is called once per window,
        when the window begins. Never raises: a tuning failure is logged and the alpha in use is
        kept."""
        p = self._plans.pop(rid, None)
        self._own.pop(rid, None)
        self.stats.finished += 1
        if not self.tuning:
            return
        try:
            self._apply_due_tune()
            if self.stats.alpha_tunes and not self.config.retune:
                return  # tuned once and for all: no more windows, snapshots or replays
            if p is None or export_tree is None:
                return
            if self._since_tune == 0:  # a window begins: it replays from this state (warm)
                self._snapshot = self.engine_snapshot(export_tree())
            inp = np.asarray(input_ids, dtype=np.int32)
            self._window.append((inp, np.concatenate([inp, np.asarray(output_ids, dtype=np.int32)])))
            self._window_hits.append(p.engine_prefix / max(p.input_len, 1))
            self._since_tune += 1
            if self._since_tune < self.config.tune_window:
                return
            hr = float(np.mean(self._window_hits))
            self.stats.tune_windows += 1
            if self.tuner is not None and self.stats.alpha_tunes and not self.tuner.should_retune(hr):
                self._since_tune = 0
                self._snapshot = None
                return
            self._start_tune()
        except Exception:  # noqa: BLE001 - tuning must never take the scheduler down
            self.stats.tune_failures += 1
            logger.exception("sparse cache: alpha tuning failed; keeping alpha=%s", self.alpha)
            self._since_tune = 0
            self._snapshot = None

    def _start_tune(self) -> None:
        if self.tuner is None:
            self.tuner = AlphaTuner(window=self.config.tune_window, workers=1, retune=self.config.retune)
        current = self.cache.alpha if self.stats.alpha_tunes else None
        at = self.stats.finished
        apply_at = at + max(1, self.config.tune_window // 4)
        if self._worker is None:
            self._worker = ReplayWorker()
        # The replay runs in the worker process; the choice and its logical time stay here.
        fut = self._worker.submit(self._snapshot, list(self._window), self.cost, self.tuner.grid)
        self.stats.tune_runs += 1
        self._pending_tune = (apply_at, fut, at, current)
        self._since_tune = 0
        self._snapshot = None

    def _apply_due_tune(self) -> None:
        """Apply a finished tuning run's alpha at its logical time (waits for the worker if needed)."""
        if self._pending_tune is None or self.stats.finished < self._pending_tune[0]:
            return
        _, fut, at, current = self._pending_tune
        self._pending_tune = None
        waited = time.perf_counter()
        try:
            scores = fut.result()
        except Exception:  # noqa: BLE001
            self.stats.tune_failures += 1
            logger.exception("sparse cache: alpha tuning run failed; keeping alpha=%s", self.alpha)
            return
        finally:
            self.stats.tune_wait_s += time.perf_counter() - waited
            cpu = self._worker.cpu_seconds() if self._worker is not None else None
            if cpu is not None:
                self.stats.tune_worker_cpu_s = cpu
        assert self.tuner is not None
        a = self.tuner.choose(scores, at_request=at, current=current)
        self.cache.alpha = a
        self._alpha = a
        self.stats.alpha_tunes.append((self.stats.finished, a))

    def engine_snapshot(self, engine_nodes: Iterable[EngineNode]) -> CacheSnapshot:
        """A flat :class:`~sglang_sparse.policy.CacheSnapshot`, taken now, of the engine's tree
        (each edge's tokens, copied once) plus this policy's per-node state, tail prior, online
        sessions and alpha: what a warm tuning replay starts from (``HybridCache.from_snapshot``
        builds an independent cache per replay). Iterative; the engine lists parents first."""
        src = self.mirror
        b = TreeSnapshotBuilder(self._kv_bytes, self._state_bytes, root_uid=src.root.uid)
        index = {src.root.uid: 0}
        for nid, pid, key, _ in engine_nodes:
            m = src.get(nid)
            if m is None or pid not in index:
                raise MirrorError(f"engine node {nid} (parent {pid}) is not in the mirror")
            index[nid] = b.add_node(
                index[pid],
                np.asarray(key, dtype=np.int32),
                checkpoints=dict(m.checkpoints.items()),
                ckpt_access=dict(m.ckpt_access),
                last_access=m.last_access,
                uid=nid,
                seq_end=m.seq_end,
                chain=m.chain,
            )
        return CacheSnapshot(
            b.build(clock=src.clock, uid_counter=max(src._uid, max(index))),  # noqa: SLF001
            self.spec,
            self.budget_bytes,
            cost=self.cost,
            alpha=self.cache.alpha,
            min_cut_gain=self.cache.min_cut_gain,
            branch_grid=self.cache.branch_grid,
            tail=copy.deepcopy(self.cache.tail),
            fit_tokens=self.fit_tokens,
            chains=copy.deepcopy(self.cache.chains),
            probation=dict(self.cache.probation),
            prober=copy.deepcopy(self.cache.prober),
            plans=self.cache.plans.snapshot(index),
        )

    # ------------------------------------------------------------------ stats

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        tree = self.mirror
        out: dict[str, Any] = {"policy": self.spec.name, "alpha": self.cache.alpha}
        for f in fields(PolicyStats):
            v = getattr(s, f.name)
            out[f.name] = [list(x) for x in v] if f.name == "alpha_tunes" else v
        out.update(
            policy_states=tree.num_states,
            policy_kv_tokens=tree.kv_tokens,
            policy_nodes=tree.num_nodes,
            pending_plans=len(self._plans),
            tuning_pending=self._pending_tune is not None,
            tail_hit_rate=self.cache.tail.hit_rate,
            tail_observations=self.cache.tail.observations,
            tail_states_open=len(self.cache.tail_states),
        )
        if self.host is not None:
            out.update(
                host_budget_bytes=self.host.budget_bytes,
                host_write_policy=self.host.write_policy,
                host_load_bandwidth=self.host.load_bandwidth,
                host_device_flops=self.host.device_flops,
                host_share=self.host.host_share(self.device_bytes),
                host_cost=isinstance(self.cost, HostCost),
                device_budget_bytes=self.device_bytes,
            )
        return out


__all__ = ["EngineNode", "PolicyStats", "RequestPlan", "TreePolicy"]


#: ``custom_params`` key with token positions (ints) to plan states at
CHECKPOINTS_KEY = "sparse_checkpoints"
#: ``custom_params`` key (chat only) with message counts: a state after the first ``j`` messages
MESSAGES_KEY = "sparse_checkpoint_messages"
#: at most this many named positions per request are planned
MAX_CHECKPOINTS = 8


def request_checkpoints(custom_params: Any, prompt_len: int) -> tuple[int, ...]:
    """The valid named positions of a request (sorted, unique, in ``(0, prompt_len)``)."""
    if not isinstance(custom_params, dict):
        return ()
    raw = custom_params.get(CHECKPOINTS_KEY)
    if not isinstance(raw, (list, tuple)):
        return ()
    ok = (p for p in raw if isinstance(p, int) and not isinstance(p, bool))
    out = sorted({int(p) for p in ok if 0 < p < prompt_len})
    return tuple(out[:MAX_CHECKPOINTS])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def boundary_message_counts(roles: Sequence[str], named: Sequence[int] = ()) -> list[int]:
    """Message counts ``j`` (``0 < j < len(roles)``) whose end is a chat boundary: the leading
    system messages, the messages before the last one, and the ``named`` ones."""
    n = len(roles)
    js: set[int] = set()
    n_sys = 0
    while n_sys < n and roles[n_sys] in ("system", "developer"):
        n_sys += 1
    if 0 < n_sys < n:
        js.add(n_sys)
    if n >= 2:
        js.add(n - 1)
    js.update(j for j in named if isinstance(j, int) and not isinstance(j, bool) and 0 < j < n)
    return sorted(js)


def chat_boundaries(serving: Any, request: Any, full_ids: Sequence[int], is_multimodal: bool) -> list[int]:
    """Token positions of the chat boundaries of ``request`` (a ``ChatCompletionRequest``) in its
    prompt ``full_ids``: for each message count ``j`` of :func:`boundary_message_counts`, the
    common prefix of the prompt of the first ``j`` messages (SGLang's ``_process_messages`` on a
    copy of the request) with ``full_ids``. A prefix the template refuses is skipped."""
    messages = list(getattr(request, "messages", None) or [])
    roles = [str(getattr(m, "role", "")) for m in messages]
    named = (getattr(request, "custom_params", None) or {}).get(MESSAGES_KEY) or ()
    out: set[int] = set()
    tok = serving.tokenizer_manager.tokenizer
    for j in boundary_message_counts(roles, named if isinstance(named, (list, tuple)) else ()):
        try:
            part = request.model_copy(deep=True, update={"messages": messages[:j]})
            ids = serving._process_messages(part, is_multimodal).prompt_ids  # noqa: SLF001
            if isinstance(ids, str):
                ids = tok.encode(ids)
        except Exception:  # noqa: BLE001 - a template may refuse a partial conversation: no boundary
            continue
        k = common_prefix(ids, full_ids)
        if 0 < k < len(full_ids):
            out.add(k)
    return sorted(out)


def add_chat_boundaries(serving: Any, adapted: Any, request: Any) -> None:
    """Add the chat boundaries of ``request`` to ``adapted`` (its ``GenerateReqInput``) under
    :data:`CHECKPOINTS_KEY`, merged with positions the request named itself. Never raises."""
    try:
        mm = bool(serving.tokenizer_manager.model_config.is_multimodal)
        if mm or getattr(adapted, "image_data", None) or getattr(adapted, "audio_data", None):
            return
        full = getattr(adapted, "input_ids", None)
        if full is None:
            text = getattr(adapted, "text", None)
            if not isinstance(text, str):
                return
            full = serving.tokenizer_manager.tokenizer.encode(text)
        if not full or not isinstance(full[0], int):
            return
        found = chat_boundaries(serving, request, full, mm)
        if not found:
            return
        sp = adapted.sampling_params if isinstance(adapted.sampling_params, dict) else None
        if sp is None:
            return
        custom = dict(sp.get("custom_params") or {})
        mine = custom.get(CHECKPOINTS_KEY)
        given = [p for p in mine if isinstance(p, int)] if isinstance(mine, list) else []
        custom[CHECKPOINTS_KEY] = sorted(set(given) | set(found))[:MAX_CHECKPOINTS]
        sp["custom_params"] = custom
    except Exception:  # noqa: BLE001 - a hint must never fail the request
        logger.exception("sparse cache: chat message boundaries could not be computed")

"""Policy shadow: the project's :class:`HybridCache` driven next to SGLang's tree (no SGLang import).

SGLang's ``UnifiedRadixCache`` stays the authority on what is cached (KV indices, Mamba pool
slots, locks). The shadow is a :class:`~sglang_sparse.policy.HybridCache` over the same token
stream that holds **no tensors**: its checkpoint handles are SGLang node ids and its KV handles are
``None``. The serving backend asks it the same questions the simulator asks, through the same
functions:

* **capture** -- ``HybridCache.match`` + ``observe`` + ``capture_plan`` once per request (the first
  time the scheduler tries to admit it): the positions whose recurrent state should be captured;
  the backend cuts prefill chunks there (:meth:`next_cut`).
* **keep** -- :meth:`admit`: a mid-request checkpoint is kept iff its position is planned; the
  final (finish) state is always kept (every policy's "last token" state).
* **evict** -- :meth:`eviction_order`: SGLang's Mamba eviction walks the states in the order of the
  policy's :class:`~sglang_sparse.policy.Evictor` scores (same candidates, same normalised
  ``recency + alpha * FLOPs/byte`` score, lowest first).

The shadow follows SGLang's tree through callbacks: :meth:`on_state_inserted` (a checkpoint was
published), :meth:`on_state_evicted` (a Mamba state was freed) and :meth:`on_kv_leaf_evicted` (a KV
leaf was dropped). Everything is a deterministic function of the request stream: logical clocks
only, no wall time, no randomness.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_sparse.policy import AlphaTuner, HybridCache, ModelCostModel, get_policy
from sglang_sparse.policy.eviction import CKPT, LEAF, NODE_STATES
from sglang_sparse.tree import Node, as_tokens

from .config import SparseConfig

logger = logging.getLogger("sglang_sparse")

#: Plans kept for requests that were never released (aborted while waiting): bounded.
_MAX_PLANS = 65536


@dataclass
class RequestPlan:
    """Capture plan of one request (absolute token positions)."""

    input_len: int
    positions: tuple[int, ...]  # the policy's plan, (resume, total]
    cuts: tuple[int, ...]  # planned positions strictly inside the prompt: chunk cuts
    engine_prefix: int = 0
    engine_kv: int = 0


@dataclass
class ShadowStats:
    """Counters (plain ints) of the backend; see :meth:`PolicyShadow.stats`."""

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
    states_inserted: int = 0
    states_evicted: int = 0
    kv_leaves_evicted: int = 0
    eviction_walks: int = 0
    kv_eviction_walks: int = 0
    unscored_evictions: int = 0
    alpha_tunes: list[tuple[int, float]] = field(default_factory=list)


class PolicyShadow:
    """The policy side of the ``sparse`` backend (see the module docstring)."""

    def __init__(
        self,
        config: SparseConfig,
        *,
        budget_bytes: int,
        cost: ModelCostModel | None = None,
        kv_bytes_per_token: int | None = None,
        state_bytes: int | None = None,
    ) -> None:
        self.config = config
        self.spec = get_policy(config.policy)
        self.cost = cost
        self._kv_bytes = kv_bytes_per_token if kv_bytes_per_token is not None else cost.kv_bytes_per_token
        self._state_bytes = state_bytes if state_bytes is not None else cost.state_bytes
        self.budget_bytes = max(int(budget_bytes), int(self._state_bytes))
        self.tuner: AlphaTuner | None = None
        self.tuning = self.spec.flop_aware and config.alpha_auto
        self.stats = ShadowStats()
        self.reset()

    # ------------------------------------------------------------------ lifecycle

    def _new_cache(self) -> HybridCache:
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
            min_cut_gain=self.config.min_cut_gain,
        )
        if self.spec.flop_aware:
            cache.alpha = self.config.alpha if self.config.alpha is not None else 0.0
        return cache

    def reset(self) -> None:
        """Forget everything cached (SGLang ``reset`` / ``flush_cache``); counters are kept."""
        alpha = getattr(self, "cache", None) and self.cache.alpha
        self.cache = self._new_cache()
        if alpha and self.spec.flop_aware:
            self.cache.alpha = alpha
        self._plans: OrderedDict[str, RequestPlan] = OrderedDict()
        self._state_tokens: dict[Any, np.ndarray] = {}
        self._window: deque[tuple[tuple[int, ...], tuple[int, ...]]] = deque(maxlen=self.config.tune_window)
        self._window_hits: deque[float] = deque(maxlen=self.config.tune_window)
        self._since_tune = 0
        self._snapshot: HybridCache | None = None

    @property
    def alpha(self) -> float:
        return self.cache.alpha

    # ------------------------------------------------------------------ capture

    def plan(
        self,
        rid: str,
        input_ids: Sequence[int],
        max_new_tokens: int,
        *,
        engine_prefix: int = 0,
        engine_kv: int = 0,
    ) -> RequestPlan:
        """The request's capture plan; the first call per ``rid`` observes the match (clock,
        recency, depth histograms, re-plans), later calls return the stored plan."""
        p = self._plans.get(rid)
        if p is not None:
            return p
        t = as_tokens(input_ids)
        n = len(t)
        m = self.cache.match(t)
        self.cache.observe(m)
        positions = tuple(self.cache.capture_plan(m, n, n + max(int(max_new_tokens), 0)))
        cuts = tuple(q for q in positions if engine_prefix < q < n)
        p = RequestPlan(n, positions, cuts, int(engine_prefix), int(engine_kv))
        self._plans[rid] = p
        if len(self._plans) > _MAX_PLANS:
            self._plans.popitem(last=False)
        s = self.stats
        s.requests += 1
        s.hit_requests += int(engine_prefix > 0)
        s.input_tokens += n
        s.resume_tokens += int(engine_prefix)
        s.kv_hit_tokens += int(engine_kv)
        s.planned_positions += len(positions)
        return p

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

    def admit(self, rid: str, position: int, *, finished: bool) -> bool:
        """Keep the checkpoint of ``rid`` at ``position``? Final states always; others iff planned.
        A request without a plan (not admitted through our adder) keeps SGLang's behaviour."""
        if finished:
            self.stats.ckpt_final += 1
            return True
        p = self._plans.get(rid)
        ok = p is None or position in p.positions
        if ok:
            self.stats.ckpt_admitted += 1
        else:
            self.stats.ckpt_rejected += 1
        return ok

    # ------------------------------------------------------------------ mirror SGLang's tree

    def on_state_inserted(self, tokens: Sequence[int], handle: Any) -> None:
        """SGLang now holds a state after ``tokens`` (all of them), with KV, under ``handle``."""
        t = as_tokens(tokens).copy()
        if len(t) == 0:
            return
        res = self.cache.insert(t, None, {len(t): handle})
        if not res.unused_states:
            self.stats.states_inserted += 1
            self._state_tokens[handle] = t

    def _find_ckpt(self, tokens: np.ndarray) -> Node | None:
        m = self.cache.match(tokens)
        if m.kv_depth != len(tokens) or not m.path:
            return None
        return m.path[-1]

    def on_state_evicted(self, handle: Any) -> None:
        """SGLang freed the state ``handle`` (tombstone or leaf eviction)."""
        t = self._state_tokens.pop(handle, None)
        if t is None:
            return
        self.stats.states_evicted += 1
        node = self._find_ckpt(t)
        p = len(t)
        if node is not None and node.checkpoints.get(p) == handle:
            self.cache.tree.drop_checkpoint(node, p)

    def on_kv_leaf_evicted(self, prefix: Sequence[int], first_token: int) -> None:
        """SGLang dropped a KV leaf whose edge starts after ``prefix`` with ``first_token``:
        nothing below ``prefix + [first_token]`` is cached any more; drop it from the shadow."""
        self.stats.kv_leaves_evicted += 1
        tree = self.cache.tree
        t = as_tokens(prefix)
        start = len(t)
        m = self.cache.match(t)
        if m.kv_depth != start:
            return
        node = m.path[-1] if m.path else tree.root
        if node.end == start:
            child = node.children.get(int(first_token))
        elif int(node.key[start - node.start]) == int(first_token):
            tree.split_at(node, start)
            child = node  # the lower half keeps the object
        else:
            child = None
        if child is None:
            return
        self._drop_subtree(child)

    def _drop_subtree(self, top: Node) -> None:
        tree = self.cache.tree
        order: list[Node] = []
        stack = [top]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children before parents
            if not n.alive or n.children:
                continue
            n.lock_ref = 0  # the shadow never locks; defensive
            freed = tree.drop_leaf(n)
            for h in freed.states:
                self._state_tokens.pop(h, None)

    # ------------------------------------------------------------------ evict

    def state_scores(self) -> dict[Any, float]:
        """Eviction score of every shadow checkpoint handle (lowest evicted first).

        Exactly the policy's :class:`Evictor` scoring: its candidates (leaf, single-child node
        states, single checkpoints per its config), ``recency + alpha * efficiency`` min-max
        normalised over the candidates present now; ``-inf`` for a candidate the policy evicts
        before every servable one (``drop_unservable``). A checkpoint covered by several candidates
        gets the lowest score. Checkpoints the policy does not offer (e.g. states at branch points
        under Marconi) get no score.
        """
        out: dict[Any, float] = {}
        for kind, node, pos, s, unservable in self.cache.evictor.scores():
            if unservable:
                s = -math.inf
            if kind in (LEAF, NODE_STATES):
                handles: Iterable[Any] = node.checkpoints.values()
            elif kind == CKPT:
                handles = (node.checkpoints[pos],)
            else:  # pragma: no cover - future candidate kinds
                continue
            for h in handles:
                if h not in out or s < out[h]:
                    out[h] = s
        return out

    def eviction_order(self, handles_lru_first: Sequence[Any]) -> list[Any]:
        """Order SGLang's evictable states: policy-scored ones by score (ties: SGLang LRU order),
        then the unscored ones in SGLang's LRU order (so an allocation can always be satisfied)."""
        self.stats.eviction_walks += 1
        scores = self.state_scores()
        scored = [(scores[h], i, h) for i, h in enumerate(handles_lru_first) if h in scores]
        scored.sort(key=lambda x: (x[0], x[1]))
        rest = [h for h in handles_lru_first if h not in scores]
        return [h for *_, h in scored] + rest

    # ------------------------------------------------------------------ finish / alpha

    def finish(self, rid: str, input_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A request left the engine: drop its plan, feed the alpha tuner's window."""
        p = self._plans.pop(rid, None)
        self.stats.finished += 1
        if not self.tuning or p is None:
            return
        if self._since_tune == 0:  # a window begins: the tuner replays it from this state (warm)
            self._snapshot = copy.deepcopy(self.cache)
        self._window.append((tuple(int(x) for x in input_ids), tuple(int(x) for x in output_ids)))
        self._window_hits.append(p.engine_prefix / max(p.input_len, 1))
        self._since_tune += 1
        if self._since_tune < self.config.tune_window:
            return
        hr = float(np.mean(self._window_hits))
        if self.tuner is not None and self.stats.alpha_tunes and not self.tuner.should_retune(hr):
            self._since_tune = 0
            return
        self._tune()

    def _tune(self) -> None:
        """Replay the window over the policy's tuning grid (the simulator's tuner and replay).
        A failure is logged and disables tuning: it must never take the scheduler down."""
        try:
            self._tune_unsafe()
        except Exception:  # noqa: BLE001
            logger.exception(
                "sparse cache: alpha tuning failed; keeping alpha=%s, tuning disabled", self.alpha
            )
            self.tuning = False
            self._since_tune = 0

    def _tune_unsafe(self) -> None:
        from sglang_sparse.sim.simulator import warm_replay_score

        if self.tuner is None:
            self.tuner = AlphaTuner(window=self.config.tune_window, workers=1)
        window = []
        for inp, out in self._window:
            a = np.asarray(inp, dtype=np.int32)
            window.append((a, np.concatenate([a, np.asarray(out, dtype=np.int32)])))
        evaluate = functools.partial(warm_replay_score, self._snapshot, window, self.cost)
        a = self.tuner.tune(
            evaluate,
            at_request=self.stats.finished,
            current=self.cache.alpha if self.stats.alpha_tunes else None,
        )
        self.cache.alpha = a
        self.stats.alpha_tunes.append((self.stats.finished, a))
        self._since_tune = 0

    # ------------------------------------------------------------------ stats

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        tree = self.cache.tree
        return {
            "policy": self.spec.name,
            "alpha": self.cache.alpha,
            "alpha_tunes": [list(x) for x in s.alpha_tunes],
            "requests": s.requests,
            "finished": s.finished,
            "hit_requests": s.hit_requests,
            "input_tokens": s.input_tokens,
            "resume_tokens": s.resume_tokens,
            "kv_hit_tokens": s.kv_hit_tokens,
            "planned_positions": s.planned_positions,
            "cuts_applied": s.cuts_applied,
            "ckpt_admitted": s.ckpt_admitted,
            "ckpt_rejected": s.ckpt_rejected,
            "ckpt_final": s.ckpt_final,
            "states_inserted": s.states_inserted,
            "states_evicted": s.states_evicted,
            "kv_leaves_evicted": s.kv_leaves_evicted,
            "eviction_walks": s.eviction_walks,
            "kv_eviction_walks": s.kv_eviction_walks,
            "unscored_evictions": s.unscored_evictions,
            "shadow_states": tree.num_states,
            "shadow_kv_tokens": tree.kv_tokens,
            "shadow_nodes": tree.num_nodes,
            "pending_plans": len(self._plans),
        }

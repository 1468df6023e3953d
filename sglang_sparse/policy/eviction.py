"""Eviction: candidate enumeration, scoring and the evict-to-budget loop.

Candidate kinds (what one eviction step removes):

* ``leaf``: an unlocked leaf edge with its KV and all its checkpoints.
* ``node_states``: all checkpoints of an unlocked single-child node, which is then merged into its
  child (Marconi's treatment of intermediate nodes).
* ``ckpt``: one checkpoint (thins an edge, keeps its KV). ``ckpt_scope`` says which ones are
  candidates: ``"all"`` or ``"interior"`` (all but the deepest checkpoint of each edge, which the
  ``leaf``/``node_states`` candidates cover).

Score (lowest evicted first), over the candidates present when the eviction round starts, with
the efficiency ``e`` min-max normalised to ``[0, 1]`` and ``t`` a candidate's clock (below):

* Marconi (``recency_scale=None``): ``S = t' + alpha * e`` with ``t'`` min-max normalised too.
* Decayed recency (``recency_scale=tau``, logical ticks): ``S = (t - t_min) / tau + ln(1 + alpha *
  e)``, the log of ``exp(-age / tau) * (1 + alpha * e)``: a reuse chance that decays with age times
  the value of a hit. Invariant (servable candidates of one round): a candidate is evicted before
  every candidate whose clock is more than ``tau * ln(1 + alpha)`` ticks newer, whatever their
  efficiencies. Min-max recency has no such
  bound: with few candidates it is a rank, and ``alpha > 1`` then keeps an efficient item forever
  while every new one is evicted as soon as it is inserted (doc_qa at 10% of the footprint: an old
  24.8k-token document prefix kept while the next 41 requests, on other documents, all missed).

``alpha = 0`` is pure LRU in both forms. Recency is a logical clock: ``node.last_access`` for
leaf/node candidates; for checkpoints either their own clock (``ckpt_recency="own"``: created or last
used as resume point; SGLang's per-component LRU) or the edge's (``"node"``).

Online sessions (``chain_recency``; :mod:`.chains`): a candidate on a node of a chain (a session
identified from structure: leaves continued from their end) is scored with the clock ``t = now -
w`` instead, ``w`` the ticks until the session is predicted back (its due tick: last arrival +
its mean gap; ``2 + ticks overdue`` once overdue), so a session due soon ranks as just used, the
slowest sessions go first and sessions that stopped coming back age out; a sequence-end leaf no
chain holds (a first turn, or a session whose chain was evicted) is predicted back after the
tracker's prior gap (the mean of all sessions' gaps) while most requests reaching a leaf continue
it. A *superseded* chain state (a state of an older turn: on a node whose only child continues its
chain, or above a deeper state on its node) is not what the session's return resumes from, so it
keeps its own clock (its last use as a resume point), set back ``superseded_demotion`` ticks: it
is only a fallback for when the session's newest state is evicted, or for a request that resumes
there (a fork from that turn, a fit state below a tip the device cannot hold). Ranking it at its
session's due tick instead (set back the same) tied every old turn of a live session to that
session's next return: with the logical cache of a host tier 1.5x agent's KV footprint, 60-odd old
turns of six live sessions outranked the newest state of a session 24 requests late, which went
first (issue 22; agent 0.944 vs native HiCache's 0.948). Measured on the agent trace (token
hit rate at 5 / 10 / 20 / 30 / 50% of the footprint, alpha tuned): 0.104 / 0.241 / 0.586 / 0.743 /
0.932 (0.576 / 0.741 at 20 / 30% with the due tick for superseded states), against 0.093 / 0.235
/ 0.506 / 0.617 / 0.857 with the candidates' own clocks (sglang_native 0.035 / 0.135 / 0.418 /
0.617 / 0.857; offline, future known, 0.239 / 0.398 / 0.693 / 0.835 / 0.939); no chain forms on
the other three traces at these sizes, whose decisions are unchanged (with a host tier, a logical
cache several times larger, a few form on doc_qa).

Efficiency is FLOPs saved per byte:

* ``value="marconi"``: each checkpoint at ``c`` saves ``prefill_flops(c - f, past=f)`` per hit, ``f``
  the next checkpoint up the path (the cost model's :meth:`node_flops_saved`).
* ``value="law"``: that, multiplied by ``1 + w`` where ``w`` is the edge-law mass the checkpoint
  serves (depths in ``[c, next checkpoint)`` on its edge): an observed-frequency estimate.

Candidates exposed during a round (a parent becoming a leaf) are scored with the round's
normalisation constants (and its ``now``). Single-child checkpoint-free unlocked nodes left
behind are merged into their child. Everything is deterministic (ties broken by node uid and
position).

Implementation. ``ReferenceEvictor`` (tests/eviction_reference.py) is the specification: it
re-enumerates and re-scores every candidate each round (tens to hundreds of ms at 10k nodes).
:class:`Evictor` makes the same decisions (same items freed in the same order, same tree
afterwards; checked by ``tests/test_policy_eviction.py``) from an incremental
:class:`~.eviction_index.CandidateIndex`: the raw terms of every candidate are cached in numpy
columns and refreshed only for nodes that changed, a round computes the normalised scores
vectorised and pops rows in ``(score, uid, pos, kind)`` order through a lazy partial sort, merged
with a heap of the candidates exposed during the round -- exactly the reference heap's order.
Measured at ~12k nodes / ~20k candidates (the ``benchmarks/cache_ops.py`` tree, 2 shared cores):
a single-leaf eviction takes 0.1-0.6 ms whether or not the tree changed since the previous one
(reference: 100-300 ms); after an eviction primitive called from outside the evictor, ~2 ms (an
O(n) rescan); the first round after construction or a copy builds the index (one reference round).
The sessions' terms (due tick, superseded, provisional) are row columns like the others; the
round turns them into clocks vectorised (a few passes: +0.15 ms per round at 20k rows with 2k
session rows, 1.4x the round's scoring alone, ``benchmarks/cache_ops.py``); the tracker's
bookkeeping costs ~15 us per request (agent trace). :meth:`Evictor.scores` exposes the scores a
round starting now would use.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sglang_sparse.tree import CheckpointTree, Freed, Node

from .eviction_index import CKPT, LEAF, NODE_STATES, CandidateIndex, ChainClock, Terms, candidate_score
from .plan_table import PlanTable

if TYPE_CHECKING:
    from sglang_sparse.policy.cost_model import ModelCostModel

    from .chains import ChainTracker

__all__ = ["CKPT", "LEAF", "NODE_STATES", "EvictionConfig", "Evictor", "ScoredCandidate"]


@dataclass(frozen=True)
class EvictionConfig:
    """Which candidates exist and how they are scored (see module docstring)."""

    node_states: bool = True
    ckpt_scope: str = "none"  # "none" | "interior" | "all"
    ckpt_recency: str = "node"  # "node" | "own"
    value: str = "marconi"  # "marconi" | "law"
    drop_unservable: bool = False  # evict candidates no request can ever resume from first
    recency_scale: float | None = None  # decayed recency time scale (ticks); None = min-max (Marconi)
    chain_recency: bool = False  # candidates on an online session: recency from its due tick
    superseded_demotion: float = 0.0  # ticks a superseded chain state's recency is set back

    def __post_init__(self) -> None:
        if self.recency_scale is not None and not self.recency_scale > 0:
            raise ValueError(f"recency_scale must be > 0 ticks or None, got {self.recency_scale!r}")
        if not 0.0 <= self.superseded_demotion < float("inf"):
            raise ValueError(
                f"superseded_demotion must be finite and >= 0 ticks, got {self.superseded_demotion!r}"
            )
        if self.ckpt_scope not in ("none", "interior", "all"):
            raise ValueError(f"ckpt_scope must be none|interior|all, got {self.ckpt_scope!r}")
        if self.ckpt_recency not in ("node", "own"):
            raise ValueError(f"ckpt_recency must be node|own, got {self.ckpt_recency!r}")
        if self.value not in ("marconi", "law"):
            raise ValueError(f"value must be marconi|law, got {self.value!r}")


class ScoredCandidate(NamedTuple):
    """One eviction candidate and the score a round starting now gives it (see :meth:`Evictor.scores`).

    ``kind``: :data:`LEAF` / :data:`NODE_STATES` / :data:`CKPT`; ``pos``: the checkpoint depth
    (tokens) for ``CKPT``, -1 otherwise. ``score``: the round's score (module docstring; dimensionless,
    in ``[0, 1 + alpha]`` with min-max recency). ``unservable``:
    under ``drop_unservable`` the candidate is evicted before every servable one whatever its score
    (the round orders it with key ``-inf``).
    """

    kind: int
    node: Node
    pos: int
    score: float
    unservable: bool


_Entry = tuple[float, int, int, int, Node, int]  # (score, uid, pos, kind, node, version): the heap key


class CandidateTerms:
    """Candidate enumeration and raw terms (:data:`~.eviction_index.Terms`: recency, FLOPs/byte,
    bytes, unservable, probation, chain due tick, superseded, provisional) shared by
    :class:`Evictor` and its specification ``ReferenceEvictor`` in tests/eviction_reference.py (which
    differ only in how a round finds the lowest scores)."""

    def __init__(
        self,
        tree: CheckpointTree,
        config: EvictionConfig,
        cost: ModelCostModel | None,
        alpha: float = 0.0,
        capacity_bytes: int | None = None,
        probation: Mapping[Any, int] | None = None,
        chains: ChainTracker | None = None,
        plans: PlanTable | None = None,
    ):
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if alpha > 0 and cost is None:
            raise ValueError("a FLOP-aware eviction (alpha > 0) needs a cost model")
        self.tree, self.config, self.cost, self.alpha = tree, config, cost, float(alpha)
        #: cache capacity (bytes); with ``config.drop_unservable`` a checkpoint at depth ``p`` whose
        #: path needs more (``p * kv_bytes_per_token + state_bytes > capacity_bytes``) is evicted first
        self.capacity_bytes = capacity_bytes
        #: state handles on probation -> their tier (shared with the owner, e.g.
        #: :class:`~.cache.HybridCache`, which adds and removes them): :data:`PROBATION` (a plan's
        #: first-sight guess) or :data:`SPARE` (a state the engine offered that no plan asked for).
        #: A candidate all of whose states are on probation is evicted before every servable one,
        #: spare ones first, oldest first (key ``SPARE_KEY`` / ``PROBATION_KEY + recency``). The
        #: owner must :meth:`Evictor.touch` a node whose handles enter or leave it other than by an
        #: insert.
        self.probation: Mapping[Any, int] = {} if probation is None else probation
        #: online sessions (shared with the owner): with ``config.chain_recency`` a candidate on a
        #: chain takes its recency from the chain's due tick (:func:`~.eviction_index.effective_recency`)
        self.chains = chains
        #: the per-edge depth laws (shared with the owner; read by ``value='law'``; ``None``: empty)
        self.plans = PlanTable() if plans is None else plans

    def _unservable(self, pos: int) -> bool:
        """Whether a checkpoint at depth ``pos`` can never be resumed from: its path KV plus the
        state exceed the whole cache, so it cannot stay cached together with its prefix."""
        cap = self.capacity_bytes
        if cap is None or not self.config.drop_unservable:
            return False
        return pos * self.tree.kv_bytes_per_token + self.tree.state_bytes > cap

    # ------------------------------------------------------------------ values

    def _ckpt_flops(self, node: Node, pos: int, fb: int | None = None) -> float:
        """FLOPs saved by the checkpoint at ``pos`` per hit (times ``1 + law mass`` for ``value='law'``).
        ``fb``: the fallback depth (``tree.fallback_depth(node, pos)``) when the caller knows it."""
        if fb is None:
            fb = self.tree.fallback_depth(node, pos)
        per_hit = self.cost.node_flops_saved(pos, fb)
        if self.config.value == "marconi":
            return per_hit
        d, w = self.plans.edge_law(node, self.tree)
        ck = node.checkpoints
        i = ck.bisect_right(pos)
        nxt = ck.peekitem(i)[0] if i < len(ck) else None
        served = float(w[(d >= pos) & ((d < nxt) if nxt is not None else True)].sum()) if d.size else 0.0
        return per_hit * (1.0 + served)

    def chain_clock(self) -> ChainClock | None:
        """The chain part of a round starting now (``None`` without ``config.chain_recency``)."""
        cfg = self.config
        if not cfg.chain_recency:
            return None
        prior = self.chains.prior_gap() if self.chains is not None else None
        return ChainClock(float(self.tree.clock), float(cfg.superseded_demotion), prior)

    def chain_terms(self, node: Node) -> tuple[float | None, bool, bool]:
        """``(due, continued, provisional)`` of ``node`` (whatever ``config.chain_recency``: a
        round decides whether to use them, :meth:`chain_clock`): its chain's due tick (``None``: not
        on a chain, or no tracker), whether its only child is on the same chain (the session moved
        past this node: all its states are superseded), and whether it is a leaf where a sequence
        ended that no chain holds (a session's first turn, or one whose chain was evicted: scored
        with the tracker's prior gap, :meth:`~.chains.ChainTracker.prior_gap`)."""
        ch = self.chains
        if ch is None:
            return None, False, False
        due = ch.due(node.chain)
        children = node.children
        if due is None:
            return None, False, node.seq_end and not children
        if len(children) != 1:
            return due, False, False
        for c in children.values():
            return due, c.chain == node.chain, False
        return due, False, False  # pragma: no cover - one child

    def node_terms(
        self,
        node: Node,
        inherited: int | None = None,
        *,
        need_value: bool | None = None,
        chain: tuple[float | None, bool, bool] | None = None,
        leaf_only: bool = False,
    ) -> list[tuple[int, int, Terms]]:
        """The eviction candidates of ``node``, ``(kind, pos, terms)`` each (``pos`` -1 for the node
        kinds): the one definition the index's rows, :meth:`candidates` and the rounds read. None if
        ``node`` is the root, dead or locked. Per ``config``: the whole leaf (``LEAF``, its KV and
        states); the states of a single-child node together (``NODE_STATES``, with ``node_states``); each
        checkpoint (``CKPT``; ``ckpt_scope`` ``all`` or ``interior``, the deepest one of a leaf also
        frees the KV below the one above it).

        ``terms`` (:data:`~.eviction_index.Terms`): recency (``ckpt_recency`` own: the checkpoint's),
        FLOPs saved per byte (computed iff ``need_value``, default ``alpha > 0``, else 0.0), bytes
        freed, unservable (every checkpoint it holds is: evicted first), probation tier (the lowest
        of its states: evicted next), its chain's due tick (``None`` off a chain), superseded (a
        checkpoint on a chain with a deeper state on its node or a continued node), provisional (a
        sequence-end leaf no chain holds; see :meth:`chain_terms`). ``inherited``: the fallback of
        the node's first checkpoint (``tree.fallback_depth(node, node.start + 1)``, walked when
        ``None``); ``chain``: ``chain_terms(node)`` when the caller has it; ``leaf_only``: just the
        ``LEAF`` candidate (a round exposing a new leaf)."""
        tree = self.tree
        if node.parent is None or not node.alive or node.lock_ref > 0:
            return []
        ck = node.checkpoints
        children = node.children
        if children and not ck:
            return []
        if need_value is None:
            need_value = self.alpha > 0
        keys = ck.keys()
        if need_value and keys:
            if inherited is None:
                inherited = tree.fallback_depth(node, node.start + 1)
            fbs = [inherited, *keys[:-1]]
            flops = [self._ckpt_flops(node, p, fb) for p, fb in zip(keys, fbs, strict=True)]
        else:
            flops = [0.0] * len(keys)
        prob = self.probation
        tiers = [prob.get(h, 0) for h in ck.values()] if prob else [0] * len(keys)
        lowest = min(tiers) if tiers else 0
        due, continued, prv = self.chain_terms(node) if chain is None else chain
        rec = float(node.last_access)
        out: list[tuple[int, int, Terms]] = []
        cfg = self.config
        if not children:
            nbytes = tree.node_bytes(node)
            dead = bool(ck) and self._unservable(keys[0])
            out.append((LEAF, -1, (rec, sum(flops) / max(nbytes, 1), nbytes, dead, lowest, due, False, prv)))
            if leaf_only:
                return out
        elif cfg.node_states and len(children) == 1:
            nbytes = len(ck) * tree.state_bytes
            dead = self._unservable(keys[0])
            out.append((NODE_STATES, -1, (rec, sum(flops) / nbytes, nbytes, dead, lowest, due, False, prv)))
        if cfg.ckpt_scope == "none" or not ck or leaf_only:
            return out
        own = cfg.ckpt_recency == "own"
        last = keys[-1]
        for i in range(len(keys) if cfg.ckpt_scope == "all" else len(keys) - 1):
            p = keys[i]
            nbytes = tree.state_bytes
            if not children and p == last:  # frees the dead KV tail as well
                above = keys[i - 1] if i > 0 else node.start
                nbytes += (node.end - above) * tree.kv_bytes_per_token
            sup = due is not None and (continued or p != last)
            r = float(node.ckpt_access[p]) if own else rec
            out.append(
                (CKPT, p, (r, flops[i] / nbytes, nbytes, self._unservable(p), tiers[i], due, sup, prv))
            )
        return out

    def _candidate(self, kind: int, node: Node, pos: int, *, need_value: bool | None = None) -> Terms | None:
        """The terms of one candidate of :meth:`node_terms` (``None``: not a candidate now)."""
        for k, p, terms in self.node_terms(node, need_value=need_value, leaf_only=kind == LEAF):
            if k == kind and p == pos:
                return terms
        return None

    def evict(self, target_bytes: int) -> Freed:
        """Evict until ``tree.bytes_used <= target_bytes`` or nothing evictable remains."""
        tree = self.tree
        freed = Freed()
        while tree.bytes_used > target_bytes:
            progressed = self._round(target_bytes, freed)
            if not progressed:
                break
        return freed

    def _round(self, target_bytes: int, freed: Freed) -> bool:
        """One eviction round (subclasses); ``False`` when nothing could be evicted."""
        raise NotImplementedError

    def candidates(self) -> list[tuple[int, Node, int]]:
        """Eligible candidates ``(kind, node, pos)`` in deterministic order (pos -1 for node kinds).

        Enumerates the tree's eviction index (O(n)); :class:`Evictor`'s rounds do not call it (see
        :meth:`Evictor.scores` for the scored candidates), the reference rounds do."""
        tree = self.tree
        # only unlocked leaves and unlocked nodes holding checkpoints can be candidates (tree indexes)
        pool = sorted(tree.evictable_leaves | tree.evictable_ckpt_nodes, key=lambda n: n.uid)
        return [(k, node, p) for node in pool for k, p, _ in self.node_terms(node, need_value=False)]


class Evictor(CandidateTerms):
    """Scores candidates and evicts until a byte target is met.

    Decisions are those of ``ReferenceEvictor`` in tests/eviction_reference.py (the module docstring);
    the candidate terms live in an incremental :class:`~.eviction_index.CandidateIndex`. The index
    notices every change made through :class:`~sglang_sparse.tree.RadixTree` methods; after writing
    node fields directly, call :meth:`invalidate`. Copies (``copy.deepcopy``, pickling) drop the
    index; it is rebuilt at the copy's first round.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Arguments of :class:`CandidateTerms`."""
        super().__init__(*args, **kwargs)
        self._index = CandidateIndex(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_index"]  # rebuilt on demand: cheaper than copying it, and never stale
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index = CandidateIndex(self)

    def invalidate(self) -> None:
        """Drop the candidate index (rebuilt at the next round): needed only after changing the tree
        other than through :class:`~sglang_sparse.tree.RadixTree` methods."""
        self._index.invalidate()

    def touch(self, node: Node) -> None:
        """Record that ``node`` changed other than through the tree's clocked operations (an
        engine-driven mirror's structural events): its candidates are refreshed at the next round
        without an O(n) rescan. Cheaper than :meth:`invalidate`, and exact when every changed node
        is touched."""
        self._index.touch(node)

    @property
    def index(self) -> CandidateIndex:
        """The incremental candidate index (read-only use: ``sync``, ``round_scores``, rows)."""
        return self._index

    def scores(self) -> list[ScoredCandidate]:
        """Every current candidate with the score an eviction round starting now would give it, in
        the order that round would pop them (ascending ``(score, uid, pos, kind)``, unservable ones
        first). Same candidates and normalisation as :meth:`evict`; does not change the tree.
        Cost: O(n) numpy + one Python object per candidate."""
        idx = self._index
        idx.sync()
        if idx.n == 0:
            return []
        score, key, _ = idx.round_scores(self.alpha)
        n = idx.n
        order = np.lexsort((idx.kind[:n], idx.pos[:n], idx.uid[:n], key))
        nodes = idx.node
        return [
            ScoredCandidate(k, nodes[i], p, s, d)
            for i, k, p, s, d in zip(
                order.tolist(),
                idx.kind[order].tolist(),
                idx.pos[order].tolist(),
                score[order].tolist(),
                idx.dead[:n][order].tolist(),
                strict=True,
            )
        ]

    # ------------------------------------------------------------------ loop

    def _round(self, target_bytes: int, freed: Freed) -> bool:
        """One round of the reference: candidates present now, scored with this round's min-max
        constants, popped lowest first; candidates exposed during the round join with the same
        constants. Rows come from the index in key order, merged with a heap of the exposed ones."""
        tree = self.tree
        idx = self._index
        idx.sync()
        if idx.n == 0:
            return False
        _, key, consts = idx.round_scores(self.alpha)
        alpha, decayed = self.alpha, self.config.recency_scale is not None

        def score(c: Terms) -> float:
            return candidate_score(c, consts, alpha, decayed)

        # The index is not refreshed during the round: its rows stay the round-start snapshot.
        rows = idx.order(key)
        keys, uid, pos_, kind_, nodes, vers = key, idx.uid, idx.pos, idx.kind, idx.node, idx.ver

        def row_entry(i: int | None) -> _Entry | None:
            if i is None:
                return None
            return (float(keys[i]), int(uid[i]), int(pos_[i]), int(kind_[i]), nodes[i], vers[i])

        nxt = row_entry(next(rows, None))
        heap: list[_Entry] = []  # candidates exposed during the round
        touch = idx.touch
        progressed = False
        while (nxt is not None or heap) and tree.bytes_used > target_bytes:
            if nxt is not None and not (heap and heap[0] < nxt):
                entry = nxt
                nxt = row_entry(next(rows, None))
            else:
                entry = heapq.heappop(heap)
            _, _, pos, kind, node, version = entry
            if not node.alive or node.version != version or node.lock_ref > 0:
                continue
            if kind == LEAF:
                if node.children:
                    continue
                parent = node.parent
                freed.extend(tree.drop_leaf(node))
                touch(node)
                touch(parent)
                progressed = True
                self._after_change(parent, heap, score)
            elif kind == NODE_STATES:
                if len(node.children) != 1 or not node.checkpoints:
                    continue
                for p in list(node.checkpoints.keys()):
                    freed.extend(tree.drop_checkpoint(node, p))
                touch(node)
                progressed = True
                self._after_change(node, heap, score)
            else:
                if pos not in node.checkpoints:
                    continue
                deepest = pos == node.checkpoints.peekitem(-1)[0]
                freed.extend(tree.drop_checkpoint(node, pos))
                touch(node)
                progressed = True
                if deepest and not node.children:
                    self._drop_dead_tail(node, freed, heap, score)
                else:
                    self._after_change(node, heap, score)
        return progressed

    def _drop_dead_tail(
        self, leaf: Node, freed: Freed, heap: list[_Entry], score: Callable[[tuple], float]
    ) -> None:
        """After the deepest checkpoint of ``leaf`` was evicted, drop the leaf's KV below its new
        deepest checkpoint (all of the leaf if none is left): no request can resume there, so it
        is dead weight. SGLang's MambaComponent does the same: evicting a leaf's state evicts the
        leaf (``_evict_device_next_node``)."""
        tree = self.tree
        ck = leaf.checkpoints
        if ck:
            last = ck.peekitem(-1)[0]
            if last >= leaf.end:
                return
            dropped, up = tree.truncate(leaf, last)
            freed.extend(dropped)
            self._index.touch(up)
            self._after_change(up, heap, score)
            return
        parent = leaf.parent
        freed.extend(tree.drop_leaf(leaf))
        self._index.touch(parent)
        self._after_change(parent, heap, score)

    def _after_change(self, node: Node, heap: list[_Entry], score: Callable[[tuple], float]) -> None:
        """Merge a checkpoint-free single-child node; expose a new leaf as a candidate."""
        if node.parent is None or not node.alive or node.lock_ref > 0:
            return
        if len(node.children) == 1 and not node.checkpoints:
            child = self.tree.merge_with_child(node)
            self._index.touch(node)
            self._index.touch(child)
            c = self._candidate(LEAF, child, -1) if not child.children else None
            if c is not None:
                heapq.heappush(heap, (score(c), child.uid, -1, LEAF, child, child.version))
            return
        if not node.children:
            c = self._candidate(LEAF, node, -1)
            if c is not None:
                heapq.heappush(heap, (score(c), node.uid, -1, LEAF, node, node.version))

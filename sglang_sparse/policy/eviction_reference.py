"""Reference evictor: the straightforward implementation that :class:`~.eviction.Evictor` must match.

Kept verbatim from before the incremental candidate index (:mod:`.eviction_index`) was introduced:
each round enumerates every candidate (``candidates()``), scores it from scratch (``_candidate()``,
which walks ``tree.fallback_depth`` and calls the cost model), min-max normalises over all of them
and pops a heap. Tests run it side by side with :class:`~.eviction.Evictor` on deep copies of the
same cache and assert identical freed handles and identical trees; the benchmark uses it as the
"before" timing. Not used by the product code.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from sglang_sparse.tree import Freed, Node, RadixTree

from .eviction import CKPT, LEAF, NODE_STATES, EvictionConfig

if TYPE_CHECKING:
    from sglang_sparse.policy.cost_model import ModelCostModel

__all__ = ["CKPT", "LEAF", "NODE_STATES", "ReferenceEvictor"]


class ReferenceEvictor:
    """The pre-index evictor, kept verbatim as the specification of :class:`~.eviction.Evictor`:
    every round re-enumerates and re-scores every candidate (O(n) Python per round). Same
    constructor and decisions; used by the differential tests and the benchmark only."""

    def __init__(
        self,
        tree: RadixTree,
        config: EvictionConfig,
        cost: ModelCostModel | None,
        alpha: float = 0.0,
        capacity_bytes: int | None = None,
    ):
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if alpha > 0 and cost is None:
            raise ValueError("a FLOP-aware eviction (alpha > 0) needs a cost model")
        self.tree, self.config, self.cost, self.alpha = tree, config, cost, float(alpha)
        #: cache capacity (bytes); with ``config.drop_unservable`` a checkpoint at depth ``p`` whose
        #: path needs more (``p * kv_bytes_per_token + state_bytes > capacity_bytes``) is evicted first
        self.capacity_bytes = capacity_bytes

    def _unservable(self, pos: int) -> bool:
        """Whether a checkpoint at depth ``pos`` can never be resumed from: its path KV plus the
        state exceed the whole cache, so it cannot stay cached together with its prefix."""
        cap = self.capacity_bytes
        if cap is None or not self.config.drop_unservable:
            return False
        return pos * self.tree.kv_bytes_per_token + self.tree.state_bytes > cap

    # ------------------------------------------------------------------ values

    def _ckpt_flops(self, node: Node, pos: int) -> float:
        """FLOPs saved by the checkpoint at ``pos`` per hit (times ``1 + law mass`` for ``value='law'``)."""
        fb = self.tree.fallback_depth(node, pos)
        per_hit = self.cost.node_flops_saved(pos, fb)
        if self.config.value == "marconi":
            return per_hit
        d, w = self.tree.edge_law(node)
        ck = node.checkpoints
        i = ck.bisect_right(pos)
        nxt = ck.peekitem(i)[0] if i < len(ck) else None
        served = float(w[(d >= pos) & ((d < nxt) if nxt is not None else True)].sum()) if d.size else 0.0
        return per_hit * (1.0 + served)

    def _candidate(self, kind: int, node: Node, pos: int) -> tuple[float, float, int, bool] | None:
        """(recency, efficiency FLOPs/byte, bytes, unservable) of a candidate; ``None`` if not
        eligible. ``unservable``: every checkpoint it holds is unservable (evicted first)."""
        tree = self.tree
        if not node.alive or node.lock_ref > 0:
            return None
        need_value = self.alpha > 0
        if kind == LEAF:
            if node.children:
                return None
            nbytes = tree.node_bytes(node)
            val = sum(self._ckpt_flops(node, p) for p in node.checkpoints) if need_value else 0.0
            ck = node.checkpoints
            dead = bool(ck) and self._unservable(ck.peekitem(0)[0])
            return float(node.last_access), val / max(nbytes, 1), nbytes, dead
        if kind == NODE_STATES:
            if len(node.children) != 1 or not node.checkpoints:
                return None
            nbytes = len(node.checkpoints) * tree.state_bytes
            val = sum(self._ckpt_flops(node, p) for p in node.checkpoints) if need_value else 0.0
            dead = self._unservable(node.checkpoints.peekitem(0)[0])
            return float(node.last_access), val / nbytes, nbytes, dead
        if pos not in node.checkpoints:
            return None
        rec = node.ckpt_access[pos] if self.config.ckpt_recency == "own" else node.last_access
        val = self._ckpt_flops(node, pos) if need_value else 0.0
        nbytes = tree.state_bytes
        ck = node.checkpoints
        if not node.children and pos == ck.peekitem(-1)[0]:  # frees the dead KV tail as well
            i = ck.index(pos)
            above = ck.peekitem(i - 1)[0] if i > 0 else node.start
            nbytes += (node.end - above) * tree.kv_bytes_per_token
        return float(rec), val / nbytes, nbytes, self._unservable(pos)

    def candidates(self) -> list[tuple[int, Node, int]]:
        """Eligible candidates ``(kind, node, pos)`` in deterministic order (pos -1 for node kinds)."""
        cfg = self.config
        out: list[tuple[int, Node, int]] = []
        tree = self.tree
        # only unlocked leaves and unlocked nodes holding checkpoints can be candidates (tree indexes)
        pool = sorted(tree.evictable_leaves | tree.evictable_ckpt_nodes, key=lambda n: n.uid)
        for node in pool:
            if node.lock_ref > 0:
                continue
            if not node.children:
                out.append((LEAF, node, -1))
            elif cfg.node_states and len(node.children) == 1 and node.checkpoints:
                out.append((NODE_STATES, node, -1))
            if cfg.ckpt_scope != "none" and node.checkpoints:
                keys = list(node.checkpoints.keys())
                if cfg.ckpt_scope == "interior":
                    keys = keys[:-1]
                out.extend((CKPT, node, p) for p in keys)
        return out

    # ------------------------------------------------------------------ loop

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
        tree = self.tree
        raw = []
        for kind, node, pos in self.candidates():
            c = self._candidate(kind, node, pos)
            if c is not None:
                raw.append((kind, node, pos, c))
        if not raw:
            return False
        rs = [c[0] for *_, c in raw]
        vs = [c[1] for *_, c in raw]
        rmin, rspan = min(rs), (max(rs) - min(rs)) or 1.0
        vmin, vspan = min(vs), (max(vs) - min(vs)) or 1.0

        def score(c: tuple[float, float, int, bool]) -> float:
            if c[3]:
                return -math.inf
            return (c[0] - rmin) / rspan + self.alpha * (c[1] - vmin) / vspan

        heap = [(score(c), node.uid, pos, kind, node, node.version) for kind, node, pos, c in raw]
        heapq.heapify(heap)
        progressed = False
        while heap and tree.bytes_used > target_bytes:
            _, _, pos, kind, node, version = heapq.heappop(heap)
            if not node.alive or node.version != version or node.lock_ref > 0:
                continue
            if kind == LEAF:
                if node.children:
                    continue
                parent = node.parent
                freed.extend(tree.drop_leaf(node))
                progressed = True
                self._after_change(parent, heap, score)
            elif kind == NODE_STATES:
                if len(node.children) != 1 or not node.checkpoints:
                    continue
                for p in list(node.checkpoints.keys()):
                    freed.extend(tree.drop_checkpoint(node, p))
                progressed = True
                self._after_change(node, heap, score)
            else:
                if pos not in node.checkpoints:
                    continue
                deepest = pos == node.checkpoints.peekitem(-1)[0]
                freed.extend(tree.drop_checkpoint(node, pos))
                progressed = True
                if deepest and not node.children:
                    self._drop_dead_tail(node, freed, heap, score)
                else:
                    self._after_change(node, heap, score)
        return progressed

    def _drop_dead_tail(self, leaf: Node, freed: Freed, heap: list, score) -> None:
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
            up = tree._split(leaf, last - leaf.start)  # noqa: SLF001 - truncation (moved to the tree later)
            freed.extend(tree.drop_leaf(leaf))
            self._after_change(up, heap, score)
            return
        parent = leaf.parent
        freed.extend(tree.drop_leaf(leaf))
        self._after_change(parent, heap, score)

    def _after_change(self, node: Node, heap: list, score) -> None:
        """Merge a checkpoint-free single-child node; expose a new leaf as a candidate."""
        if node.parent is None or not node.alive or node.lock_ref > 0:
            return
        if len(node.children) == 1 and not node.checkpoints:
            child = self.tree.merge_with_child(node)
            c = self._candidate(LEAF, child, -1) if not child.children else None
            if c is not None:
                heapq.heappush(heap, (score(c), child.uid, -1, LEAF, child, child.version))
            return
        if not node.children:
            c = self._candidate(LEAF, node, -1)
            if c is not None:
                heapq.heappush(heap, (score(c), node.uid, -1, LEAF, node, node.version))

"""Reference evictor: the straightforward implementation that
:class:`sglang_sparse.policy.evict.Evictor` must match (a test helper, not part of the package).

The rounds are kept verbatim from before the incremental candidate index (:mod:`.evict`)
was introduced: each round enumerates every candidate (``candidates()``), scores it from scratch
(``_candidate()``, which walks ``tree.fallback_depth`` and calls the cost model), min-max
normalises over all of them and pops a heap. Tests run it side by side with
:class:`~.evict.Evictor` on deep copies of the same cache and assert identical freed handles and
identical trees. It lives in tests/ (like sortedcontainers' reference implementations): the
package never imports it.
"""

from __future__ import annotations

import heapq

from sglang_sparse.policy.evict import (
    CKPT,
    LEAF,
    NODE_STATES,
    CandidateTerms,
    Terms,
    candidate_score,
    effective_recency,
    round_constants,
)
from sglang_sparse.tree import Freed, Node

__all__ = ["CKPT", "LEAF", "NODE_STATES", "ReferenceEvictor"]


class ReferenceEvictor(CandidateTerms):
    """The pre-index evictor, the specification of :class:`~.evict.Evictor`: every round
    re-enumerates (``candidates()``) and re-scores (``_candidate()``) every candidate, O(n) Python
    per round. Same constructor and decisions; used by the differential tests only. The candidate
    terms are shared with :class:`~.evict.Evictor`
    (:class:`~.evict.CandidateTerms`); what this class pins down is the round."""

    def touch(self, node: Node) -> None:
        """No-op (:meth:`Evictor.touch`'s interface): every round re-scores every candidate."""
        del node

    def invalidate(self) -> None:
        """No-op (:meth:`Evictor.invalidate`'s interface): nothing is cached between rounds."""

    # ------------------------------------------------------------------ loop

    def _round(self, target_bytes: int, freed: Freed) -> bool:
        tree = self.tree
        raw = []
        for kind, node, pos in self.candidates():
            c = self._candidate(kind, node, pos)
            if c is not None:
                raw.append((kind, node, pos, c))
        if not raw:
            return False
        clock = self.chain_clock()
        rs = [effective_recency(c[0], c[5], c[6], c[7], clock) for *_, c in raw]
        vs = [c[1] for *_, c in raw]
        consts = round_constants(min(rs), max(rs), min(vs), max(vs), self.config.recency_scale, clock)
        decayed = self.config.recency_scale is not None

        def score(c: Terms) -> float:
            return candidate_score(c, consts, self.alpha, decayed)

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

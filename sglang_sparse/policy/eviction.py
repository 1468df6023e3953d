"""Eviction: candidate enumeration, scoring and the evict-to-budget loop.

Candidate kinds (what one eviction step removes):

* ``leaf``: an unlocked leaf edge with its KV and all its checkpoints.
* ``node_states``: all checkpoints of an unlocked single-child node, which is then merged into its
  child (Marconi's treatment of intermediate nodes).
* ``ckpt``: one checkpoint (thins an edge, keeps its KV). ``ckpt_scope`` says which ones are
  candidates: ``"all"`` or ``"interior"`` (all but the deepest checkpoint of each edge, which the
  ``leaf``/``node_states`` candidates cover).

Score (lowest evicted first): ``S = recency + alpha * efficiency`` with both terms min-max normalised
over the candidates present when the eviction round starts (``alpha = 0`` is pure LRU). Recency is a
logical clock: ``node.last_access`` for leaf/node candidates; for checkpoints either their own clock
(``ckpt_recency="own"``: created or last used as resume point; SGLang's per-component LRU) or the
edge's (``"node"``). Efficiency is FLOPs saved per byte:

* ``value="marconi"``: each checkpoint at ``c`` saves ``prefill_flops(c - f, past=f)`` per hit, ``f``
  the next checkpoint up the path (the cost model's :meth:`node_flops_saved`).
* ``value="law"``: that, multiplied by ``1 + w`` where ``w`` is the edge-law mass the checkpoint
  serves (depths in ``[c, next checkpoint)`` on its edge): an observed-frequency estimate.

Candidates exposed during a round (a parent becoming a leaf) are scored with the round's
normalisation constants. Single-child checkpoint-free unlocked nodes left behind are merged into
their child. Everything is deterministic (ties broken by node uid and position).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang_sparse.tree import Freed, Node, RadixTree

if TYPE_CHECKING:
    from sglang_sparse.policy.cost_model import ModelCostModel

LEAF, NODE_STATES, CKPT = 0, 1, 2


@dataclass(frozen=True)
class EvictionConfig:
    """Which candidates exist and how they are scored (see module docstring)."""

    node_states: bool = True
    ckpt_scope: str = "none"  # "none" | "interior" | "all"
    ckpt_recency: str = "node"  # "node" | "own"
    value: str = "marconi"  # "marconi" | "law"

    def __post_init__(self) -> None:
        if self.ckpt_scope not in ("none", "interior", "all"):
            raise ValueError(f"ckpt_scope must be none|interior|all, got {self.ckpt_scope!r}")
        if self.ckpt_recency not in ("node", "own"):
            raise ValueError(f"ckpt_recency must be node|own, got {self.ckpt_recency!r}")
        if self.value not in ("marconi", "law"):
            raise ValueError(f"value must be marconi|law, got {self.value!r}")


class Evictor:
    """Scores candidates and evicts until a byte target is met."""

    def __init__(
        self, tree: RadixTree, config: EvictionConfig, cost: ModelCostModel | None, alpha: float = 0.0
    ):
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if alpha > 0 and cost is None:
            raise ValueError("a FLOP-aware eviction (alpha > 0) needs a cost model")
        self.tree, self.config, self.cost, self.alpha = tree, config, cost, float(alpha)

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

    def _candidate(self, kind: int, node: Node, pos: int) -> tuple[float, float, int] | None:
        """(recency, efficiency FLOPs/byte, bytes) of a candidate; ``None`` if not eligible."""
        tree = self.tree
        if not node.alive or node.lock_ref > 0:
            return None
        need_value = self.alpha > 0
        if kind == LEAF:
            if node.children:
                return None
            nbytes = tree.node_bytes(node)
            val = sum(self._ckpt_flops(node, p) for p in node.checkpoints) if need_value else 0.0
            return float(node.last_access), val / max(nbytes, 1), nbytes
        if kind == NODE_STATES:
            if len(node.children) != 1 or not node.checkpoints:
                return None
            nbytes = len(node.checkpoints) * tree.state_bytes
            val = sum(self._ckpt_flops(node, p) for p in node.checkpoints) if need_value else 0.0
            return float(node.last_access), val / nbytes, nbytes
        if pos not in node.checkpoints:
            return None
        rec = node.ckpt_access[pos] if self.config.ckpt_recency == "own" else node.last_access
        val = self._ckpt_flops(node, pos) if need_value else 0.0
        return float(rec), val / tree.state_bytes, tree.state_bytes

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

        def score(c: tuple[float, float, int]) -> float:
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
                freed.extend(tree.drop_checkpoint(node, pos))
                progressed = True
                self._after_change(node, heap, score)
        return progressed

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

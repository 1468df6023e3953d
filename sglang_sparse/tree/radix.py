"""Radix tree over token ids with sparse recurrent-state checkpoints (no tensors, opaque handles).

The simulator's tree: structure, locks, eviction primitives and the eviction index are
:class:`~.core.CheckpointTree`'s, this module adds the tokens; which checkpoints to capture and what
to evict is decided by :mod:`sglang_sparse.policy`. Its API follows SGLang's radix cache:

* :meth:`RadixTree.match` is **pure** (no splits, no clock, no recency update) so the scheduler may
  call it any number of times per request.
* :meth:`RadixTree.touch` is the separate, explicit "this request was admitted with this match"
  call: it advances the logical clock and refreshes recency.
* :meth:`RadixTree.insert` returns the KV slices and state handles it did *not* take (duplicates of
  what is already cached) so the caller frees them (SGLang ``cache_finished_req`` semantics).
* :meth:`RadixTree.lock` / :meth:`RadixTree.unlock` mirror ``inc_lock_ref`` / ``dec_lock_ref``.

Hot paths (a 32k-token prompt in a ~10k-node tree): :meth:`match` is one call of the descent
:func:`~.lcp.walk` (C in ``_lcp_native`` when built at install time, else :func:`~.lcp.walk_py`),
which compares each edge once with a longest-common-prefix routine (:func:`~.lcp.lcp`: C ``memcmp``
blocks, else the chunked numpy :func:`~.lcp.lcp_numpy`; every token is compared exactly, no
hashing). :meth:`insert` accepts the :class:`MatchResult` of the same request as ``hint`` and
resumes from its end instead of re-walking the path (validated by node versions, so a stale hint
silently falls back to a full walk).

Units: depths/positions/lengths in **tokens** (absolute from the root), memory in **bytes**.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .core import EMPTY_KEY, CheckpointTree, InsertResult, KVOps, MatchResult, Node, _make_match
from .lcp import Tokens, as_tokens, lcp_near, same_prefix, walk
from .snapshot import TreeSnapshot, tree_from_snapshot, tree_to_snapshot


class RadixTree(CheckpointTree):
    """Radix tree of cached token prefixes with KV handles and sparse recurrent checkpoints: a
    :class:`CheckpointTree` whose edges hold their token ids (``node.key``), so it can :meth:`match`
    and :meth:`insert` token sequences (the simulator's tree; an engine's is mirrored instead)."""

    # ------------------------------------------------------------------ flat snapshot / copies

    def to_snapshot(self) -> TreeSnapshot:
        """The tree as a flat :class:`~sglang_sparse.tree.snapshot.TreeSnapshot` (iterative; handles
        shared, arrays fresh). ``RadixTree.from_snapshot(t.to_snapshot())`` takes the same future
        decisions as ``t``."""
        return tree_to_snapshot(self)

    @classmethod
    def from_snapshot(
        cls,
        snap: TreeSnapshot,
        *,
        kv_ops: KVOps | None = None,
    ) -> RadixTree:
        """Rebuild a tree from ``snap`` (validated: raises ``SnapshotError``, a ``ValueError``, naming
        the broken invariant). Derived indexes (leaves, evictable sets, LRU heap, totals) are rebuilt."""
        return tree_from_snapshot(snap, cls=cls, kv_ops=kv_ops)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle through the flat snapshot (never recursive in tree depth). Other attributes (the
        ``listener``) are pickled as they are. (``MirrorTree`` keeps the default object protocol.)"""
        extra = {k: v for k, v in self.__dict__.items() if k not in _TREE_ATTRS}
        return (_rebuild_tree, (self.to_snapshot(), self.kv_ops, extra))

    def __deepcopy__(self, memo: dict[int, Any]) -> RadixTree:
        """Deep copy through the flat snapshot: handles, ``kv_ops`` and other attributes (the
        ``listener``) go through ``copy.deepcopy`` with ``memo`` (so a caller can share one by
        seeding it)."""
        import copy

        snap = self.to_snapshot()
        snap.kv = copy.deepcopy(snap.kv, memo)
        snap.ckpt_handle = copy.deepcopy(snap.ckpt_handle, memo)
        extra = {k: v for k, v in self.__dict__.items() if k not in _TREE_ATTRS}
        out = _rebuild_tree(
            snap,
            copy.deepcopy(self.kv_ops, memo),
            copy.deepcopy(extra, memo),
        )
        memo[id(self)] = out
        return out

    # ------------------------------------------------------------------ match (pure) and insert

    def match(self, tokens: Tokens) -> MatchResult:
        """Longest cached prefix of ``tokens`` and the deepest checkpoint at or before it. Pure.

        Cost: one descent :func:`~.lcp.walk` comparing each token of the matched prefix exactly once
        (a 32k-token prompt reads ~256 KB, memory-bound when cold) plus O(path) Python."""
        t = as_tokens(tokens)
        d, path, versions = walk(self.root.children, t, 0)
        # Deepest checkpoint <= d: on the last edge one at or before d; on any earlier edge (fully
        # matched, so all its checkpoints are <= d) its deepest one; the last such edge wins.
        ck_node, ck_pos, ck_handle = None, 0, None
        if path:
            last = path[-1]
            if last.checkpoints:
                hit = last.deepest_checkpoint_at_or_before(d)
                if hit is not None:
                    ck_node, (ck_pos, ck_handle) = last, hit
            if ck_node is None:
                for i in range(len(path) - 2, -1, -1):
                    ck = path[i].checkpoints
                    if ck:
                        ck_node = path[i]
                        ck_pos, ck_handle = ck.peekitem(-1)
                        break
        else:
            last = self.root
        return _make_match(d, ck_pos, last, ck_node, ck_handle, path, t, versions)

    def insert(
        self,
        tokens: Tokens,
        kv: Any = None,
        checkpoints: Mapping[int, Any] | None = None,
        *,
        kv_offset: int = 0,
        hint: MatchResult | None = None,
    ) -> InsertResult:
        """Cache ``tokens`` with KV handle ``kv`` covering ``tokens[kv_offset:]`` and checkpoints
        ``{position: state handle}`` (``0 < position <= len(tokens)``).

        Tokens before ``kv_offset`` must already be cached (the caller holds them locked, as SGLang
        does for ``req.prefix_indices``). Edges are split where ``tokens`` diverge. Returns the KV
        slices of tokens that were already cached from ``kv_offset`` on and the state handles whose
        position already had a checkpoint: the caller frees both.

        ``hint``: a :class:`MatchResult` of an earlier :meth:`match` of a sequence with the same first
        ``hint.kv_depth`` tokens (typically this request's prompt; ``tokens`` may be longer). The walk
        resumes from the hint's end instead of re-comparing the matched prefix. The hint is used only
        if every path node is alive with an unchanged ``version`` and its tokens equal ``tokens`` on
        the matched prefix (free when both are the same int32 array, one vectorised compare
        otherwise); otherwise the full walk runs. Either way the result is identical."""
        t = as_tokens(tokens)
        n = len(t)
        if n == 0:
            raise ValueError("cannot insert an empty token sequence")
        if not 0 <= kv_offset <= n:
            raise ValueError(f"kv_offset must be in [0, {n}], got {kv_offset}")
        checkpoints = dict(checkpoints) if checkpoints else {}
        for p in checkpoints:
            if not 0 < p <= n:
                raise ValueError(f"checkpoint position {p} outside (0, {n}]")
        self.clock = now = self.clock + 1  # self.tick(), inlined
        node, d = self.root, 0
        path: list[Node] = []
        split: Node | None = None
        if hint is not None and self._hint_valid(hint, t):
            d = hint.kv_depth
            if hint.path:
                path = list(hint.path)
                node = path[-1]
                for p in path[:-1]:
                    p.last_access = now
                k0 = d - node.start
                if k0 < len(node.key):  # the match ended inside this edge
                    # It diverged at d, so t does too if it agrees with the matched tokens there;
                    # otherwise (the matched sequence ended at d, or t differs) compare on.
                    ht = hint.tokens
                    if d < n and (ht is t or (d < len(ht) and ht.item(d) == t.item(d))):
                        k = k0
                    else:
                        k = k0 + lcp_near(node.key, t, d, k0)
                    d = node.start + k
                    if k < len(node.key):  # split: the lower part keeps its recency (as in the walk)
                        node = split = self._split(node, k)
                        path[-1] = node
                node.last_access = now
        # Descend below ``node`` (the whole walk without a hint), except after a split of the hinted
        # edge: its lower part starts with ``key[k] != t[d]``, so the walk would stop at once.
        if d < n and split is None:
            d, below, _ = walk(node.children, t, d)
            if below:
                node = below[-1]
                k = d - node.start
                if k < len(node.key):  # split: the lower part keeps its recency
                    node = split = self._split(node, k)
                for p in below[:-1]:
                    p.last_access = now
                node.last_access = now
                path.extend(below)
                path[-1] = node
        children = node.children
        if split is not None:
            self._sync_evictable(split)
            self._sync_evictable(next(iter(split.children.values())))
        prefix_len = d
        if prefix_len < kv_offset:
            raise ValueError(
                f"tokens[:kv_offset={kv_offset}] must already be cached, only {prefix_len} are (lock them)"
            )
        res = InsertResult(prefix_len, node)
        if prefix_len > kv_offset:
            dup, kv = self.kv_ops.split(kv, prefix_len - kv_offset)
            res.unused_kv.append(dup)
        if prefix_len < n:
            self._uid = uid = self._uid + 1
            leaf = Node(uid, t[prefix_len:].copy(), prefix_len, node, kv, now)
            children[t.item(prefix_len)] = leaf
            leaves = self.leaves
            leaves.discard(node)
            leaves.add(leaf)
            self.kv_tokens += n - prefix_len
            self.num_nodes += 1
            path.append(leaf)
            res.node = leaf
            if not node.checkpoints:  # ``node`` stopped being a leaf (cheap path of _sync_evictable)
                self.evictable_leaves.discard(node)
            else:
                self._sync_evictable(node)
            self.evictable_leaves.add(leaf)  # a fresh leaf is unlocked: index it directly
            self.leaf_heap.push(leaf, len(self.evictable_leaves))
        else:
            self._sync_evictable(node)  # an existing node whose recency changed
        res.node.seq_end = True  # ends at n: the leaf just made, the split's upper part, or a node end
        if checkpoints:
            # The holder of position p is the path node with start < p <= end (path edges are
            # contiguous from 0 to n); checkpoints sit near the end, so scan from the deepest node.
            last = len(path) - 1
            for p, h in sorted(checkpoints.items()) if len(checkpoints) > 1 else checkpoints.items():
                i = last
                while path[i].start >= p:
                    i -= 1
                holder = path[i]
                ck = holder.checkpoints
                if p in ck:
                    res.unused_states.append(h)
                else:
                    ck[p] = h
                    holder.ckpt_access[p] = now
                    self.num_states += 1
                    if holder.children and holder.lock_ref == 0:
                        self.evictable_ckpt_nodes.add(holder)
        return res

    def _hint_valid(self, hint: MatchResult, t: np.ndarray) -> bool:
        """Whether ``hint`` still describes the path of ``t[:hint.kv_depth]`` in this tree."""
        path, d, versions = hint.path, hint.kv_depth, hint.versions
        ht = hint.tokens
        if ht is None or d > len(t) or d > len(ht) or len(versions) != len(path):
            return False
        if path:
            if path[0].parent is not self.root:
                return False
            for node, v in zip(path, versions, strict=True):
                if node.version != v or not node.alive:
                    return False
        elif hint.node is not self.root or d:
            return False
        return ht is t or same_prefix(ht, t, d)

    def path_tokens(self, node: Node) -> np.ndarray:
        """Tokens from the root to the end of ``node``'s edge."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return np.concatenate(keys[::-1]) if keys else EMPTY_KEY


#: ``RadixTree.__dict__`` entries captured by :class:`TreeSnapshot` or rebuilt from it.
_TREE_ATTRS = frozenset(
    {
        "kv_bytes_per_token",
        "state_bytes",
        "kv_ops",
        "clock",
        "_uid",
        "root",
        "kv_tokens",
        "num_states",
        "num_nodes",
        "leaves",
        "evictable_leaves",
        "evictable_ckpt_nodes",
        "leaf_heap",
    }
)


def _rebuild_tree(snap: TreeSnapshot, kv_ops: KVOps | None, extra: dict[str, Any]) -> RadixTree:
    """Unpickling helper: :meth:`RadixTree.from_snapshot` plus any extra instance attributes."""
    tree = RadixTree.from_snapshot(snap, kv_ops=kv_ops)
    tree.__dict__.update(extra)
    return tree

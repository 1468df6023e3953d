"""Radix tree over token ids with sparse recurrent-state checkpoints (no tensors, opaque handles).

The tree is the *mechanism*; which checkpoints to capture and what to evict is decided by
:mod:`sglang_sparse.policy`. It is designed to be driven by an SGLang ``UnifiedRadixCache`` subclass:

* :meth:`RadixTree.match` is **pure** (no splits, no clock, no recency update) so the scheduler may
  call it any number of times per request.
* :meth:`RadixTree.touch` is the separate, explicit "this request was admitted with this match"
  call: it advances the logical clock and refreshes recency (the policy's plan table then feeds the
  per-edge depth histograms: :mod:`sglang_sparse.policy.plan_table`).
* :meth:`RadixTree.insert` returns the KV slices and state handles it did *not* take (duplicates of
  what is already cached) so the caller frees them (SGLang ``cache_finished_req`` semantics).
* :meth:`RadixTree.lock` / :meth:`RadixTree.unlock` mirror ``inc_lock_ref`` / ``dec_lock_ref``.
* Eviction primitives (:meth:`drop_checkpoint`, :meth:`drop_leaf`, :meth:`merge_with_child`) return
  the freed handles; the policy layer orders them.

Hot paths (a 32k-token prompt in a ~10k-node tree): :meth:`match` is one call of the descent
:func:`~.lcp.walk` (C in ``_lcp_native`` when built at install time, else :func:`~.lcp.walk_py`),
which compares each edge once with a longest-common-prefix routine (:func:`~.lcp.lcp`: C ``memcmp``
blocks, else the chunked numpy :func:`~.lcp.lcp_numpy`; every token is compared exactly, no
hashing). :meth:`insert` accepts the :class:`MatchResult` of the same request as ``hint`` and
resumes from its end instead of re-walking the path (validated by node versions, so a stale hint
silently falls back to a full walk). An LRU-ordered heap of evictable leaves
(:class:`~.lru.LeafHeap`) and the sets :attr:`RadixTree.evictable_leaves` /
:attr:`RadixTree.evictable_ckpt_nodes` are maintained incrementally (O(log n) per change) so an
evictor does not enumerate every node.

Units: depths/positions/lengths in **tokens** (absolute from the root), memory in **bytes**. The tree
holds ``kv_tokens * kv_bytes_per_token + num_states * state_bytes`` bytes (:attr:`bytes_used`).

Per-node policy state (depth histograms, plans) is not here: a :class:`TreeListener` (the
policy's plan table) hears every split, merge and removal and keeps it by node ``uid``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from .lcp import Tokens, as_tokens, lcp_near, same_prefix, walk
from .lru import LeafHeap
from .node import EMPTY_KEY, Node
from .snapshot import TreeSnapshot, tree_from_snapshot, tree_to_snapshot


class KVOps:
    """How to split and join opaque KV handles. Default: sequence slicing; ``np.concatenate`` for
    numpy arrays, ``+`` for lists/tuples; ``None`` handles stay ``None`` (simulation without a pool).
    An engine adapter passes its own (e.g. torch slicing / ``torch.cat``)."""

    def split(self, handle: Any, k: int) -> tuple[Any, Any]:
        if handle is None:
            return None, None
        return handle[:k], handle[k:]

    def concat(self, left: Any, right: Any) -> Any:
        if left is None and right is None:
            return None
        if isinstance(left, np.ndarray):
            return np.concatenate([left, right])
        return left + right


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Result of :meth:`RadixTree.match` (pure).

    ``kv_depth``: tokens whose KV is cached (longest common prefix with the tree).
    ``resume_depth``: deepest checkpoint position ``<= kv_depth`` (0 if none) -- the usable prefix.
    ``node``: node whose edge contains ``kv_depth`` (the root when ``kv_depth == 0``).
    ``ckpt_node`` / ``ckpt_handle``: where that checkpoint lives (``None`` when ``resume_depth == 0``).
    ``path``: nodes from the root's child down to ``node`` (empty when nothing matched).
    ``tokens``: the int32 token array that was matched (not copied; do not mutate it while the result
    is used as an insert ``hint``). ``versions``: ``node.version`` of each ``path`` node at match time.
    Both are excluded from ``==``/``repr`` and only serve :meth:`RadixTree.insert`'s ``hint``.
    """

    kv_depth: int
    resume_depth: int
    node: Node
    ckpt_node: Node | None
    ckpt_handle: Any
    path: tuple[Node, ...]
    tokens: np.ndarray | None = field(default=None, compare=False, repr=False)
    versions: tuple[int, ...] = field(default=(), compare=False, repr=False)


# The frozen dataclass __init__ goes through object.__setattr__ per field (~3 us for 8 fields on a
# slow core); match() builds its result through the slot descriptors instead (~1 us, same object).
_MR_FIELDS = ("kv_depth", "resume_depth", "node", "ckpt_node", "ckpt_handle", "path", "tokens", "versions")
if {f.name for f in fields(MatchResult)} != set(_MR_FIELDS):  # a new field must be set below too
    raise RuntimeError("update _MR_FIELDS / _make_match for the new MatchResult fields")
_MR_SET = tuple(getattr(MatchResult, name).__set__ for name in _MR_FIELDS)


def _make_match(
    kv_depth: int,
    resume_depth: int,
    node: Node,
    ckpt_node: Node | None,
    ckpt_handle: Any,
    path: tuple[Node, ...],
    tokens: np.ndarray,
    versions: tuple[int, ...],
) -> MatchResult:
    """``MatchResult(...)`` without the frozen-dataclass ``__init__`` overhead."""
    r = object.__new__(MatchResult)
    s0, s1, s2, s3, s4, s5, s6, s7 = _MR_SET
    s0(r, kv_depth)
    s1(r, resume_depth)
    s2(r, node)
    s3(r, ckpt_node)
    s4(r, ckpt_handle)
    s5(r, path)
    s6(r, tokens)
    s7(r, versions)
    return r


@dataclass(slots=True)
class InsertResult:
    """Result of :meth:`RadixTree.insert`.

    ``prefix_len``: tokens already cached before this insert. ``node``: node holding the last token.
    ``unused_kv``: KV slices the tree did not take (the caller frees them); ``unused_states``: state
    handles not taken because a checkpoint already existed at that position.
    """

    prefix_len: int
    node: Node
    unused_kv: list[Any] = field(default_factory=list)
    unused_states: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Freed:
    """Handles released by eviction (the caller returns them to its pools) and bytes freed."""

    kv: list[Any] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    kv_tokens: int = 0
    bytes: int = 0

    def extend(self, other: Freed) -> None:
        self.kv.extend(other.kv)
        self.states.extend(other.states)
        self.kv_tokens += other.kv_tokens
        self.bytes += other.bytes


class TreeListener(Protocol):
    """What a tree tells the owner of per-node policy state (the policy's plan table) about its
    structure; every mutation of a node's identity is one of these events, for every tree class."""

    def on_split(self, lower: Node, upper: Node, at: int) -> None:
        """``upper`` (new) took the part of ``lower``'s edge up to depth ``at`` (tokens)."""

    def on_merge(self, upper: Node, child: Node) -> None:
        """``upper`` is about to be merged into its only ``child`` (which survives)."""

    def on_remove(self, node: Node) -> None:
        """``node`` left the tree (evicted, or removed by the engine)."""

    def on_reset(self) -> None:
        """The tree forgot every node."""


class CheckpointTree:
    """The structure of a prefix tree with sparse recurrent checkpoints, without tokens: nodes and
    their edges' lengths, checkpoint sets, byte accounting, locks, recency and the eviction index.
    :class:`RadixTree` adds the tokens (match and insert);
    :class:`~sglang_sparse.tree.mirror.MirrorTree` follows an engine's tree by its events. Policy
    state per node (depth histograms, plans) lives outside, in the ``listener``
    (:class:`TreeListener`) that every split, merge and removal is reported to.

    Parameters: ``kv_bytes_per_token`` and ``state_bytes`` (one checkpoint, all recurrent layers)
    size the byte accounting; ``kv_ops`` splits and joins KV handles.

    Eviction index (for :mod:`sglang_sparse.policy.eviction`; maintained by every mutating method,
    checked by :meth:`check`): :attr:`evictable_leaves` (unlocked leaves), :attr:`evictable_ckpt_nodes`
    (unlocked interior nodes with checkpoints), :meth:`lru_leaf` (min ``(last_access, uid)`` evictable
    leaf, amortised O(log n)) and :meth:`iter_lru_leaves` (them in that order, lazily). An LRU leaf
    evictor is ``while over budget: leaf = tree.lru_leaf(); freed.extend(tree.drop_leaf(leaf))``
    (plus its merge step), never enumerating all nodes. :meth:`node_bytes` is O(1).
    """

    #: Whether every edge end is a divergence point (a branch point or where a sequence ended):
    #: true where edges are split only there (this token tree); an engine's tree keeps old split
    #: points (:class:`~sglang_sparse.tree.mirror.MirrorTree`).
    edge_ends_diverge = True

    def __init__(self, kv_bytes_per_token: int, state_bytes: int, *, kv_ops: KVOps | None = None) -> None:
        if kv_bytes_per_token < 0 or state_bytes <= 0:
            raise ValueError(
                f"need kv_bytes_per_token >= 0 and state_bytes > 0, got {kv_bytes_per_token}, {state_bytes}"
            )
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        self.state_bytes = int(state_bytes)
        self.kv_ops = kv_ops or KVOps()
        #: told of every structural change (``None``: nobody keeps per-node state)
        self.listener: TreeListener | None = None
        self.clock = 0
        self._uid = 0
        self.root = Node(self._next_uid(), EMPTY_KEY, 0, None, None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.kv_tokens = 0
        self.num_states = 0
        self.num_nodes = 0
        self.leaves: set[Node] = set()
        # Eviction index (exact sets + lazy LRU heap), maintained by _sync_evictable():
        #: unlocked leaves (no children, ``lock_ref == 0``): the ``leaf`` candidates.
        self.evictable_leaves: set[Node] = set()
        #: unlocked interior nodes holding >= 1 checkpoint (``node_states`` / ``ckpt`` candidates).
        self.evictable_ckpt_nodes: set[Node] = set()
        # (last_access, uid, node) for evictable leaves; stale entries are skipped lazily.
        self.leaf_heap = LeafHeap()

    # ------------------------------------------------------------------ accounting

    def _next_uid(self) -> int:
        self._uid += 1
        return self._uid

    @property
    def bytes_used(self) -> int:
        """KV bytes of all cached tokens + bytes of all checkpoints."""
        return self.kv_tokens * self.kv_bytes_per_token + self.num_states * self.state_bytes

    def node_bytes(self, node: Node) -> int:
        """Bytes freed by dropping ``node`` as a leaf (its own KV + its checkpoints)."""
        return node.num_tokens * self.kv_bytes_per_token + len(node.checkpoints) * self.state_bytes

    def tick(self) -> int:
        """Advance and return the logical clock (one tick per request/operation)."""
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ admitted request

    def touch(self, match: MatchResult) -> bool:
        """An admitted request's match: advance the clock; if it matched anything, refresh the
        recency of its path and of the checkpoint it resumes from. Returns whether it matched
        (``kv_depth > 0``). Call once per request (not per match call); the policy's
        ``PlanTable.observe`` calls it before feeding the path's histograms."""
        now = self.tick()
        if match.kv_depth == 0 or not match.path:
            return False
        for node in match.path:
            if not node.alive:
                raise ValueError("stale MatchResult: the tree changed since match(); match again")
            node.last_access = now
            if not node.children:
                self._sync_evictable(node)
        if match.ckpt_node is not None and match.resume_depth in match.ckpt_node.ckpt_access:
            match.ckpt_node.ckpt_access[match.resume_depth] = now
        return True

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors (their KV and checkpoints) from eviction."""
        while node is not None:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self._sync_evictable(node)
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one :meth:`lock` of ``node``."""
        n = node
        while n is not None:
            if n.lock_ref <= (1 if n.parent is None else 0):
                raise ValueError(f"unlock without matching lock on {node!r}")
            n = n.parent
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._sync_evictable(node)
            node = node.parent

    # ------------------------------------------------------------------ edge split (insert, eviction)

    def _split(self, node: Node, k: int) -> Node:
        """Split ``node``'s edge after ``k`` tokens (0 < k < len); return the new upper node.
        Checkpoints at positions ``<= start + k`` move to the upper node, deeper ones stay (right side)."""
        at = node.start + k
        kv_up, kv_down = self.kv_ops.split(node.kv, k)
        up = Node(self._next_uid(), node.key[:k], node.start, node.parent, kv_up, node.last_access)
        up.lock_ref = node.lock_ref
        parent = node.parent
        parent.children[node.key.item(0)] = up
        node.key = node.key[k:]
        node.start = at
        node.kv = kv_down
        node.parent = up
        up.children[node.key.item(0)] = node
        self._split_state(node, up, at)
        self.num_nodes += 1
        return up

    def _split_state(self, node: Node, up: Node, at: int) -> None:
        """Move the per-edge state of ``node`` at or above depth ``at`` to ``up``, its new upper half:
        checkpoints (with their clocks) at positions ``<= at``; ``node`` keeps the rest and gets a
        new ``version``; ``up`` joins ``node``'s chain (the same session's prefix; ``seq_end``
        stays below); the listener hears :meth:`TreeListener.on_split`. Shared by every split (the
        token tree's and the engine-driven mirror's)."""
        ck = node.checkpoints
        keys = ck._keys  # noqa: SLF001 - sorted positions
        while keys and keys[0] <= at:
            p, h = ck.popitem(0)
            up.checkpoints[p] = h
            up.ckpt_access[p] = node.ckpt_access.pop(p)
        node.version += 1
        up.chain = node.chain
        if self.listener is not None:
            self.listener.on_split(node, up, at)

    # ------------------------------------------------------------------ eviction primitives

    def drop_checkpoint(self, node: Node, pos: int) -> Freed:
        """Remove one checkpoint (thin the edge, keep its KV). The node must be unlocked."""
        if node.lock_ref > 0:
            raise ValueError(f"cannot drop a checkpoint of locked {node!r}")
        h = node.checkpoints.pop(pos)
        del node.ckpt_access[pos]
        self.num_states -= 1
        if not node.checkpoints:
            self.evictable_ckpt_nodes.discard(node)
        return Freed(states=[h], bytes=self.state_bytes)

    def split_at(self, node: Node, depth: int) -> Node:
        """Split ``node``'s edge at absolute token depth ``depth`` (``node.start < depth < node.end``)
        and return the new upper node; ``node`` keeps the lower part (its identity, children and the
        checkpoints deeper than ``depth``). Frees nothing; bytes are unchanged."""
        if node.parent is None or not node.alive:
            raise ValueError(f"cannot split {node!r}")
        if not node.start < depth < node.end:
            raise ValueError(f"split depth {depth} not strictly inside edge ({node.start}, {node.end})")
        up = self._split(node, depth - node.start)
        self._sync_evictable(up)
        self._sync_evictable(node)
        return up

    def truncate(self, leaf: Node, depth: int) -> tuple[Freed, Node]:
        """Drop the part of unlocked ``leaf`` below absolute depth ``depth``: its KV and the
        checkpoints deeper than ``depth`` (``leaf.start < depth < leaf.end``). Returns what was
        freed and the surviving upper node (a leaf, ending at ``depth``)."""
        if not leaf.alive or leaf.children:
            raise ValueError(f"not a live leaf: {leaf!r}")
        if leaf.lock_ref > 0:
            raise ValueError(f"cannot truncate locked {leaf!r}")
        up = self.split_at(leaf, depth)
        return self.drop_leaf(leaf), up

    def drop_leaf(self, node: Node) -> Freed:
        """Remove an unlocked leaf: its KV and all its checkpoints."""
        if not node.is_leaf or not node.alive:
            raise ValueError(f"not a live leaf: {node!r}")
        if node.lock_ref > 0:
            raise ValueError(f"cannot evict locked {node!r}")
        parent = node.parent
        del parent.children[node.key.item(0)]
        freed = Freed(kv=[node.kv], states=list(node.checkpoints.values()), kv_tokens=node.num_tokens)
        freed.bytes = self.node_bytes(node)
        self.kv_tokens -= node.num_tokens
        self.num_states -= len(node.checkpoints)
        self.num_nodes -= 1
        node.alive = False
        node.version += 1
        self.leaves.discard(node)
        self.evictable_leaves.discard(node)
        if parent.parent is not None and not parent.children:
            self.leaves.add(parent)
            self._sync_evictable(parent)
        if self.listener is not None:
            self.listener.on_remove(node)
        return freed

    def merge_with_child(self, node: Node) -> Node:
        """Merge a single-child, unlocked node into its child (Marconi). Frees nothing; the child
        survives with the concatenated edge, KV and checkpoints (the listener hears
        :meth:`TreeListener.on_merge` first). Returns the child."""
        if node.parent is None or len(node.children) != 1 or node.lock_ref > 0:
            raise ValueError(f"can only merge an unlocked single-child node, got {node!r}")
        (child,) = node.children.values()
        parent = node.parent
        if self.listener is not None:
            self.listener.on_merge(node, child)
        child.key = np.concatenate([node.key, child.key])
        child.kv = self.kv_ops.concat(node.kv, child.kv)
        child.start = node.start
        child.parent = parent
        child.checkpoints.update(node.checkpoints)
        child.ckpt_access.update(node.ckpt_access)
        child.last_access = max(child.last_access, node.last_access)
        parent.children[child.key.item(0)] = child
        node.alive = False
        node.version += 1
        child.version += 1
        self.num_nodes -= 1
        self.evictable_ckpt_nodes.discard(node)
        self._sync_evictable(child)
        return child

    # ------------------------------------------------------------------ eviction index

    def _sync_evictable(self, node: Node) -> None:
        """Recompute ``node``'s membership in the eviction index after a change of its lock count,
        children, checkpoints, recency or liveness. O(1), plus one heap push (O(log n)) when it is an
        evictable leaf whose recency has no heap entry yet."""
        if node.parent is None:
            return
        if not node.alive or node.lock_ref > 0:
            self.evictable_leaves.discard(node)
            self.evictable_ckpt_nodes.discard(node)
            return
        if node.children:
            self.evictable_leaves.discard(node)
            if node.checkpoints:
                self.evictable_ckpt_nodes.add(node)
            else:
                self.evictable_ckpt_nodes.discard(node)
            return
        self.evictable_ckpt_nodes.discard(node)
        self.evictable_leaves.add(node)
        if node.heap_key != node.last_access:
            self.leaf_heap.push(node, len(self.evictable_leaves))

    def lru_leaf(self) -> Node | None:
        """The least recently used evictable leaf (min ``(last_access, uid)``), or ``None``.

        Amortised O(log n): stale heap entries are discarded on the way. Does not remove the leaf;
        evict it with :meth:`drop_leaf` (its parent then enters the index if it became an unlocked
        leaf). This is the whole candidate search of an LRU (``alpha = 0``) leaf evictor.
        """
        return self.leaf_heap.first()

    def iter_lru_leaves(self) -> Iterator[Node]:
        """Evictable leaves in LRU order (``(last_access, uid)`` ascending), lazily: the first ``k``
        cost O(k log k). Do not mutate the tree while iterating (collect first, then drop)."""
        return self.leaf_heap.iter_lru()

    # ------------------------------------------------------------------ inspection

    def nodes(self) -> Iterator[Node]:
        """All nodes except the root, parents before children (deterministic order)."""
        stack = list(reversed(list(self.root.children.values())))
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(list(n.children.values())))

    def fallback_depth(self, node: Node, pos: int) -> int:
        """Deepest checkpoint strictly before ``pos`` on the path to ``node`` (0 if none)."""
        ck = node.checkpoints
        i = ck.bisect_left(pos) - 1
        if i >= 0:
            return ck.peekitem(i)[0]
        n = node.parent
        while n is not None and n.parent is not None:
            if n.checkpoints:
                return n.checkpoints.peekitem(-1)[0]
            n = n.parent
        return 0

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
        """Pickle through the flat snapshot (never recursive in tree depth). Subclasses with their
        own state (``MirrorTree``) keep the default object protocol. Other attributes (the
        ``listener``) are pickled as they are."""
        if type(self) is not RadixTree:
            return object.__reduce_ex__(self, protocol)
        extra = {k: v for k, v in self.__dict__.items() if k not in _TREE_ATTRS}
        return (_rebuild_tree, (self.to_snapshot(), self.kv_ops, extra))

    def __deepcopy__(self, memo: dict[int, Any]) -> RadixTree:
        """Deep copy through the flat snapshot: handles, ``kv_ops`` and other attributes (the
        ``listener``) go through ``copy.deepcopy`` with ``memo`` (so a caller can share one by
        seeding it)."""
        import copy

        if type(self) is not RadixTree:
            rv = object.__reduce_ex__(self, 4)
            return copy._reconstruct(self, memo, *rv)  # noqa: SLF001 - the default deepcopy path
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

    def check(self) -> None:
        """Assert every structural and accounting invariant (tests call this after each step)."""
        kv_tokens = states = count = 0
        leaves = set()
        for n in self.nodes():
            count += 1
            assert n.alive and n.num_tokens > 0
            assert n.start == n.parent.end, n
            assert n.parent.children[n.key.item(0)] is n
            kv_tokens += n.num_tokens
            states += len(n.checkpoints)
            assert set(n.checkpoints) == set(n.ckpt_access)
            for p in n.checkpoints:
                assert n.start < p <= n.end, (n, p)
            lr = sum(c.lock_ref for c in n.children.values())
            assert n.lock_ref >= lr, n
            if not n.children:
                leaves.add(n)
        assert count == self.num_nodes, (count, self.num_nodes)
        assert kv_tokens == self.kv_tokens and states == self.num_states
        assert leaves == self.leaves
        ev_leaves = {n for n in leaves if n.lock_ref == 0}
        assert ev_leaves == self.evictable_leaves, ev_leaves ^ self.evictable_leaves
        ev_ck = {n for n in self.nodes() if n.children and n.checkpoints and n.lock_ref == 0}
        assert ev_ck == self.evictable_ckpt_nodes, ev_ck ^ self.evictable_ckpt_nodes
        in_heap = {(e[2].uid, e[0]) for e in self.leaf_heap.entries}
        for n in ev_leaves:
            assert n.heap_key == n.last_access and (n.uid, n.last_access) in in_heap, n
        assert self.lru_leaf() is min(ev_leaves, key=lambda n: (n.last_access, n.uid), default=None)

    def iter_checkpoints(self) -> Iterable[tuple[Node, int, Any]]:
        for n in self.nodes():
            for p, h in n.checkpoints.items():
                yield n, p, h


class RadixTree(CheckpointTree):
    """Radix tree of cached token prefixes with KV handles and sparse recurrent checkpoints: a
    :class:`CheckpointTree` whose edges hold their token ids (``node.key``), so it can :meth:`match`
    and :meth:`insert` token sequences (the simulator's tree; an engine's is mirrored instead).
    """

    # ------------------------------------------------------------------ match (pure) and insert

    def match(self, tokens: Tokens) -> MatchResult:
        """Longest cached prefix of ``tokens`` and the deepest checkpoint at or before it. Pure.

        Cost: one descent :func:`~.lcp.walk` comparing each token of the matched prefix exactly once (for a
        32k-token prompt ~256 KB of reads, memory-bound when cold) plus ~2 us of Python per call.
        """
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

    def kv_handles(self, match: MatchResult, depth: int | None = None) -> list[Any]:
        """Per-edge KV handles covering tokens ``[0, depth)`` of a match (default ``resume_depth``)."""
        depth = match.resume_depth if depth is None else depth
        if not 0 <= depth <= match.kv_depth:
            raise ValueError(f"depth {depth} outside [0, kv_depth={match.kv_depth}]")
        out = []
        for node in match.path:
            if node.start >= depth:
                break
            if node.end <= depth:
                out.append(node.kv)
            else:
                out.append(self.kv_ops.split(node.kv, depth - node.start)[0])
        return out

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
        otherwise); otherwise the full walk runs. Either way the result is identical.
        """
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

"""The tree mechanism both trees share: :class:`Node` (an edge of tokens, its KV handle and its
recurrent-state checkpoints) and :class:`CheckpointTree` (everything but token comparison);
:class:`~.radix.RadixTree` adds token match/insert, :class:`~.mirror.MirrorTree` follows an engine.

Node invariants
---------------

A node owns the edge from its parent: token depths ``(start, end]`` (``end = start + len(key)``),
i.e. the tokens ``key = seq[start:end]`` (a non-empty 1-D int32 array, owned by the tree: never a
view of a caller's array). Invariants (checked by :meth:`RadixTree.check`):

* ``kv`` is the opaque engine handle of the KV of exactly those ``len(key)`` tokens.
* ``checkpoints`` maps absolute depths ``p`` with ``start < p <= end`` to opaque state handles;
  the state at ``p`` is the recurrent state after the first ``p`` tokens of the path.
* ``ckpt_access[p]`` is the logical clock at which the checkpoint at ``p`` was created or last
  used as a resume point (same keys as ``checkpoints``).
* ``lock_ref > 0`` for every node on the path of a locked node (SGLang ``inc_lock_ref`` semantics);
  a locked node's KV and checkpoints are never evicted.
* ``children`` is keyed by the first token of the child's edge.
* ``version`` is bumped whenever the edge's identity changes (its ``key``/``start``/``parent`` after a
  split or merge, or death): a :class:`~sglang_sparse.tree.MatchResult` recorded with the same
  versions still describes a valid path (used by ``RadixTree.insert(..., hint=match)``).
* ``seq_end``: an inserted sequence ended exactly at ``end`` (the last node of an insert; a node
  that only exists because a split or a cut-back made it end there is not one). The tail prior
  learns suffix distances only from such leaves: a leaf cut back to a state is not where any
  sequence ended, so a request reaching its end need not continue anything.
* ``seq_tail``: tokens of that sequence's cache key past ``end`` (0 in the token tree, which holds
  whole sequences; in an engine's tree, whose KV may stop at the sequence's last kept state, the
  part it dropped), so the tail prior measures divergences from where the sequence really ended.
* ``chain``: the id of the online session (chain of leaves continued from their end) this node
  belongs to, ``-1`` if none; written by :class:`~sglang_sparse.policy.choose.ChainTracker` only,
  kept by the upper part of a split and by the child of a merge.
* ``heap_key`` is the ``last_access`` of this node's newest entry in the tree's LRU leaf heap
  (``-1`` if it has none); maintained by :class:`RadixTree` only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from .lru import LeafHeap

EMPTY_KEY = np.empty(0, dtype=np.int32)


class CheckpointMap(dict):
    """``{position (tokens): state handle}`` with keys kept sorted: a light ``SortedDict`` stand-in.

    A node holds a handful of checkpoints, and a ``SortedDict`` is costly to construct (two per
    insert; ``docs/architecture.md``, "Simulator and tree notes"). Implements the part of its API the
    project uses: mapping operations, sorted iteration, ``keys()``/``values()``/``items()`` (sorted
    **lists**, i.e. snapshots, indexable), ``peekitem``/``popitem(index)``, ``bisect_left``/
    ``bisect_right``. Invariant: ``self._keys == sorted(dict.keys(self))``."""

    __slots__ = ("_keys",)

    def __init__(self, items: Mapping[int, Any] | Iterable[tuple[int, Any]] = ()) -> None:
        super().__init__()
        self._keys: list[int] = []
        if items:
            self.update(items)

    # -- mutation (every path keeps ``_keys`` in sync)
    def __setitem__(self, key: int, value: Any) -> None:
        if not dict.__contains__(self, key):
            bisect.insort(self._keys, key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: int) -> None:
        dict.__delitem__(self, key)
        ks = self._keys
        del ks[bisect.bisect_left(ks, key)]

    _MISSING = object()

    def pop(self, key: int, default: Any = _MISSING) -> Any:
        if dict.__contains__(self, key):
            value = dict.__getitem__(self, key)
            del self[key]
            return value
        if default is CheckpointMap._MISSING:
            raise KeyError(key)
        return default

    def popitem(self, index: int = -1) -> tuple[int, Any]:  # type: ignore[override]
        """Remove and return the item at sorted ``index`` (default: the deepest)."""
        if not self._keys:
            raise KeyError("popitem(): checkpoint map is empty")
        key = self._keys.pop(index)
        return key, dict.pop(self, key)

    def setdefault(self, key: int, default: Any = None) -> Any:
        if not dict.__contains__(self, key):
            self[key] = default
        return dict.__getitem__(self, key)

    def update(self, other: Any = (), **kw: Any) -> None:  # type: ignore[override]
        items = other.items() if isinstance(other, Mapping) else other
        for k, v in items:
            self[k] = v
        for k, v in kw.items():
            self[k] = v

    def __ior__(self, other: Any) -> CheckpointMap:  # type: ignore[override]
        self.update(other)
        return self

    def clear(self) -> None:
        dict.clear(self)
        self._keys.clear()

    def copy(self) -> CheckpointMap:
        return CheckpointMap(self.items())

    def __reduce__(self) -> tuple[Any, ...]:
        return (CheckpointMap, (self.items(),))

    # -- sorted views
    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def keys(self) -> list[int]:  # type: ignore[override]
        return list(self._keys)

    def values(self) -> list[Any]:  # type: ignore[override]
        g = dict.__getitem__
        return [g(self, k) for k in self._keys]

    def items(self) -> list[tuple[int, Any]]:  # type: ignore[override]
        g = dict.__getitem__
        return [(k, g(self, k)) for k in self._keys]

    def peekitem(self, index: int = -1) -> tuple[int, Any]:
        key = self._keys[index]
        return key, dict.__getitem__(self, key)

    def bisect_left(self, key: int) -> int:
        return bisect.bisect_left(self._keys, key)

    def bisect_right(self, key: int) -> int:
        return bisect.bisect_right(self._keys, key)

    def __repr__(self) -> str:
        return f"CheckpointMap({dict(self.items())!r})"


_new_map = dict.__new__


class Node:
    """A radix edge/node. Hold references only through :class:`RadixTree`; handles are opaque."""

    __slots__ = (
        "uid",
        "key",
        "start",
        "parent",
        "children",
        "kv",
        "checkpoints",
        "ckpt_access",
        "lock_ref",
        "last_access",
        "version",
        "alive",
        "heap_key",
        "seq_end",
        "seq_tail",
        "chain",
    )

    def __init__(
        self, uid: int, key: np.ndarray, start: int, parent: Node | None, kv: Any, clock: int
    ) -> None:
        self.uid = uid
        self.key = key
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.kv = kv
        ck = _new_map(CheckpointMap)  # CheckpointMap() without the Python __init__ (hot path)
        ck._keys = []  # noqa: SLF001 - same module
        self.checkpoints: CheckpointMap = ck
        self.ckpt_access: dict[int, int] = {}
        self.lock_ref = 0
        self.last_access = clock
        self.version = 0
        self.alive = True
        self.heap_key = -1
        self.seq_end = False
        self.seq_tail = 0
        self.chain = -1

    @property
    def end(self) -> int:
        """Depth (tokens from the root) after this edge's last token."""
        return self.start + len(self.key)

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children and self.parent is not None

    def deepest_checkpoint_at_or_before(self, depth: int) -> tuple[int, Any] | None:
        """``(position, handle)`` of the deepest checkpoint on this edge with position <= depth."""
        ck = self.checkpoints
        if not ck:
            return None
        i = bisect.bisect_right(ck._keys, depth) - 1  # noqa: SLF001 - same module
        if i < 0:
            return None
        p = ck._keys[i]  # noqa: SLF001
        return p, dict.__getitem__(ck, p)

    def __repr__(self) -> str:
        return (
            f"Node(uid={self.uid}, depths=({self.start}, {self.end}], children={len(self.children)}, "
            f"ckpts={list(self.checkpoints.keys())}, lock={self.lock_ref})"
        )


def sequence_leaf(node: Node, *, chains: bool = False) -> Node | None:
    """The leaf where an inserted sequence ended (:attr:`Node.seq_end`; with ``chains`` also a
    session's leaf, ``chain >= 0``) that ``node`` leads to without a branch: ``node`` itself or the
    end of its single-child path, ``None`` if the path branches or ends elsewhere first.

    A match that ends inside a leaf's edge ends on that leaf in :class:`RadixTree`, but an engine
    that splits the edge where a match ends (SGLang does, in ``match_prefix``) leaves it on the
    upper part, one child above the same leaf: both mean "this request diverged from that
    sequence". O(path length)."""

    def ended(n: Node) -> bool:
        return n.seq_end or (chains and n.chain >= 0)

    while not ended(node) and len(node.children) == 1:
        node = next(iter(node.children.values()))
    return node if ended(node) and not node.children else None


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
    Both are excluded from ``==``/``repr`` and only serve :meth:`RadixTree.insert`'s ``hint``."""

    kv_depth: int
    resume_depth: int
    node: Node
    ckpt_node: Node | None
    ckpt_handle: Any
    path: tuple[Node, ...]
    tokens: np.ndarray | None = field(default=None, compare=False, repr=False)
    versions: tuple[int, ...] = field(default=(), compare=False, repr=False)


# match() builds its result through the slot descriptors, not the frozen dataclass __init__ (one
# object.__setattr__ per field): the same object, cheaper (docs/architecture.md).
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
    """Result of :meth:`RadixTree.insert`. ``prefix_len``: tokens already cached before this insert.
    ``node``: node holding the last token. ``unused_kv``: KV slices the tree did not take (the caller
    frees them); ``unused_states``: state handles not taken because a checkpoint already existed at
    that position."""

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

    Eviction index (for :mod:`sglang_sparse.policy.evict`; maintained by every mutating method,
    checked by :meth:`check`): :attr:`evictable_leaves` (unlocked leaves), :attr:`evictable_ckpt_nodes`
    (unlocked interior nodes with checkpoints), :meth:`lru_leaf` (min ``(last_access, uid)`` evictable
    leaf, amortised O(log n)), so an evictor never enumerates all nodes. :meth:`node_bytes` is O(1)."""

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
        freed = Freed(kv=[node.kv], states=list(node.checkpoints.values()), kv_tokens=node.num_tokens)
        freed.bytes = self.node_bytes(node)
        self._unlink_leaf(node)
        return freed

    def _unlink_leaf(self, node: Node) -> None:
        """Detach leaf ``node``: its KV and checkpoints leave the totals and the eviction index; the
        listener hears :meth:`TreeListener.on_remove`. Shared by every leaf removal (eviction here,
        the engine's in the mirror)."""
        parent = node.parent
        del parent.children[node.key.item(0)]
        self.kv_tokens -= node.num_tokens
        self.num_states -= len(node.checkpoints)
        self.num_nodes -= 1
        node.alive = False
        node.version += 1
        self.leaves.discard(node)
        self.evictable_leaves.discard(node)  # a leaf is never in evictable_ckpt_nodes (check())
        if parent.parent is not None and not parent.children:  # else the parent's membership stands
            self.leaves.add(parent)
            self._sync_evictable(parent)
        if self.listener is not None:
            self.listener.on_remove(node)

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
        """The least recently used evictable leaf (min ``(last_access, uid)``), or ``None``. Amortised
        O(log n): stale heap entries are discarded on the way. Does not remove the leaf; evict it with
        :meth:`drop_leaf` (its parent then enters the index if it became an unlocked leaf). This is the
        whole candidate search of an LRU (``alpha = 0``) leaf evictor."""
        return self.leaf_heap.first()

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

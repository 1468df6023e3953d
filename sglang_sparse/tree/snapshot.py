"""Flat, explicit snapshot of a :class:`~sglang_sparse.tree.RadixTree` (no per-level recursion).

A :class:`TreeSnapshot` holds the whole tree as flat arrays/lists indexed by *node index* ``i``
(``0 .. n-1``) in preorder: index 0 is the root, ``parent[i] < i`` for every other node, and the
children of a node appear in the order of its ``children`` dict (so rebuilding reproduces the
same iteration order, hence the same decisions). Snapshotting, rebuilding, ``copy.deepcopy`` and
``pickle`` of a tree all go through this form and are iterative: a 100,000-level chain (a long
multi-turn session) copies like any other tree, under the default recursion limit.

Fields (units: tokens for depths and lengths, logical clock ticks for clocks, bytes for sizes):

* tree configuration: ``kv_bytes_per_token`` (bytes), ``state_bytes`` (bytes per checkpoint);
* counters: ``clock`` (the tree's logical clock, ``>=`` every access clock below), ``uid_counter``
  (the last uid handed out; ``>=`` every ``uid``);
* per node ``i`` (arrays of length ``n``): ``parent`` (int64, ``-1`` for the root), ``uid``
  (int64, unique), ``start`` (int64, depth before the edge: the parent's end, 0 for the root),
  ``last_access`` (int64 clock), ``lock_ref`` (int64 >= 0; the root's is >= 1 and a node's is >=
  the sum of its children's), ``version`` (int64), ``seq_end`` (bool),
  ``chain`` (int64 online-session id, ``-1`` none; see :mod:`sglang_sparse.policy.choose`), ``kv``
  (list of opaque KV handles, the root's ``None``);
* edge tokens: ``keys`` (int32, every edge's tokens concatenated in node order) and
  ``key_offsets`` (int64, length ``n + 1``, ``key_offsets[0] == 0``): node ``i``'s edge is
  ``keys[key_offsets[i]:key_offsets[i+1]]``, empty for the root and non-empty otherwise; its end
  depth is ``start[i] + len(edge)``; siblings start with different tokens;
* checkpoints (arrays of length ``m``, sorted by node index then position): ``ckpt_node`` (int64
  node index), ``ckpt_pos`` (int64 absolute depth ``p`` with ``start < p <= end`` of that node),
  ``ckpt_access`` (int64 clock of creation / last use as a resume point), ``ckpt_handle`` (list of
  opaque state handles);

Not stored: the policy's per-edge histograms and plans (its plan table keeps them by ``uid``, with a
flat form of its own: ``sglang_sparse.policy.choose``) and the derived indexes (leaf set, evictable
sets, LRU heap, node counts, byte totals, the policy's candidate index), which
:func:`tree_from_snapshot` rebuilds. :class:`TreeSnapshotBuilder` builds a snapshot from another tree
(SGLang's, for the alpha tuner). This module sits below :mod:`.radix` and never imports it (trees are
seen through :class:`FlatTree`; :func:`tree_from_snapshot` builds the class its caller passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from .core import EMPTY_KEY, Node

_I64 = np.int64


class FlatTree(Protocol):
    """The tree state :func:`tree_to_snapshot` reads and :func:`tree_from_snapshot` writes.
    :class:`~sglang_sparse.tree.radix.RadixTree` has it (a structural type: no import of
    :mod:`.radix`). Units: ``kv_bytes_per_token`` and ``state_bytes`` bytes, ``kv_tokens`` tokens,
    ``clock`` logical ticks; ``_uid`` is the last uid handed out, ``num_nodes`` excludes the root.
    ``_sync_evictable(node)`` recomputes ``node``'s membership in the tree's eviction index."""

    kv_bytes_per_token: int
    state_bytes: int
    root: Node
    clock: int
    _uid: int
    num_nodes: int
    kv_tokens: int
    num_states: int
    leaves: set[Node]

    def _sync_evictable(self, node: Node) -> None: ...


TreeT = TypeVar("TreeT", bound=FlatTree)


def _i64(a: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=_I64).reshape(-1))


class SnapshotError(ValueError):
    """A :class:`TreeSnapshot` violates one of its documented invariants (message says which)."""


@dataclass
class TreeSnapshot:
    """The flat form of a radix tree (see the module docstring for every field's meaning). Construct
    it directly (all fields by keyword), with :class:`TreeSnapshotBuilder`, or with
    :meth:`RadixTree.to_snapshot`; :meth:`RadixTree.from_snapshot` validates it."""

    kv_bytes_per_token: int
    state_bytes: int
    parent: np.ndarray
    keys: np.ndarray
    key_offsets: np.ndarray
    start: np.ndarray
    uid: np.ndarray
    last_access: np.ndarray
    lock_ref: np.ndarray
    kv: list[Any]
    clock: int
    uid_counter: int
    version: np.ndarray | None = None
    seq_end: np.ndarray | None = None
    chain: np.ndarray | None = None
    ckpt_node: np.ndarray = field(default_factory=lambda: np.empty(0, _I64))
    ckpt_pos: np.ndarray = field(default_factory=lambda: np.empty(0, _I64))
    ckpt_access: np.ndarray = field(default_factory=lambda: np.empty(0, _I64))
    ckpt_handle: list[Any] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.parent)


class TreeSnapshotBuilder:
    """Builds a :class:`TreeSnapshot` node by node (parents before children), e.g. from an engine's
    own radix tree. Index 0 (the root, empty edge, ``lock_ref`` 1) exists from the start.
    ``add_node(parent, tokens, ...)`` returns the new node's index; ``start`` is derived (the parent's
    end depth). ``checkpoints`` maps absolute depths in ``(start, end]`` to handles; ``ckpt_access``
    their clocks (default ``last_access``). ``build(clock=...)`` defaults the clock to the newest
    access clock seen and the uid counter to the largest uid."""

    def __init__(
        self,
        kv_bytes_per_token: int,
        state_bytes: int,
        *,
        root_uid: int = 1,
    ) -> None:
        self.config = {
            "kv_bytes_per_token": int(kv_bytes_per_token),
            "state_bytes": int(state_bytes),
        }
        self._parent = [-1]
        self._keys: list[np.ndarray] = [EMPTY_KEY]
        self._start = [0]
        self._end = [0]
        self._uid = [int(root_uid)]
        self._last = [0]
        self._lock = [1]
        self._kv: list[Any] = [None]
        self._max_uid = int(root_uid)
        self._seq_end = [False]
        self._chain = [-1]
        self._ck: list[tuple[int, int, int, Any]] = []

    def add_node(
        self,
        parent: int,
        tokens: Any,
        *,
        kv: Any = None,
        checkpoints: dict[int, Any] | None = None,
        ckpt_access: dict[int, int] | None = None,
        last_access: int = 0,
        lock_ref: int = 0,
        uid: int | None = None,
        seq_end: bool = False,
        chain: int = -1,
    ) -> int:
        """Append a child of node index ``parent`` with edge ``tokens``; return its index. ``seq_end``
        and ``chain``: see :class:`~sglang_sparse.tree.core.Node`."""
        if not 0 <= parent < len(self._parent):
            raise SnapshotError(f"parent index {parent} is not an earlier node (have {len(self._parent)})")
        key = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if key.size == 0:
            raise SnapshotError("a non-root node needs a non-empty edge")
        i = len(self._parent)
        start = self._end[parent]
        self._parent.append(int(parent))
        self._keys.append(key)
        self._start.append(start)
        self._end.append(start + int(key.size))
        u = int(uid) if uid is not None else self._max_uid + 1
        self._max_uid = max(self._max_uid, u)
        self._uid.append(u)
        self._last.append(int(last_access))
        self._lock.append(int(lock_ref))
        self._kv.append(kv)
        self._seq_end.append(bool(seq_end))
        self._chain.append(int(chain))
        acc = ckpt_access or {}
        for p in sorted(checkpoints or {}):
            self._ck.append((i, int(p), int(acc.get(p, last_access)), checkpoints[p]))  # type: ignore[index]
        return i

    def build(self, *, clock: int | None = None, uid_counter: int | None = None) -> TreeSnapshot:
        """The snapshot (validated later by :meth:`RadixTree.from_snapshot`)."""
        lens = np.fromiter((len(k) for k in self._keys), dtype=_I64, count=len(self._keys))
        offs = np.zeros(len(lens) + 1, dtype=_I64)
        np.cumsum(lens, out=offs[1:])
        ck = self._ck
        newest = max(max(self._last), max((c[2] for c in ck), default=0))
        return TreeSnapshot(
            version=np.zeros(len(self._parent), dtype=_I64),
            seq_end=np.asarray(self._seq_end, dtype=np.bool_),
            chain=_i64(self._chain),
            parent=_i64(self._parent),
            keys=np.concatenate(self._keys).astype(np.int32, copy=False),
            key_offsets=offs,
            start=_i64(self._start),
            uid=_i64(self._uid),
            last_access=_i64(self._last),
            lock_ref=_i64(self._lock),
            kv=list(self._kv),
            clock=int(newest if clock is None else clock),
            uid_counter=int(self._max_uid if uid_counter is None else uid_counter),
            ckpt_node=_i64([c[0] for c in ck]),
            ckpt_pos=_i64([c[1] for c in ck]),
            ckpt_access=_i64([c[2] for c in ck]),
            ckpt_handle=[c[3] for c in ck],
            **self.config,
        )


def tree_to_snapshot(tree: FlatTree) -> TreeSnapshot:
    """Flatten ``tree`` (iterative preorder; O(nodes + tokens + checkpoints)). Handles are shared,
    not copied; arrays are fresh."""
    order: list[Node] = [tree.root]
    index: dict[int, int] = {id(tree.root): 0}
    parent = [-1]
    stack = list(reversed(tree.root.children.values()))
    while stack:
        n = stack.pop()
        index[id(n)] = len(order)
        parent.append(index[id(n.parent)])
        order.append(n)
        if n.children:
            stack.extend(reversed(n.children.values()))
    nn = len(order)
    lens = np.fromiter((len(n.key) for n in order), dtype=_I64, count=nn)
    offs = np.zeros(nn + 1, dtype=_I64)
    np.cumsum(lens, out=offs[1:])
    keys = np.concatenate([np.asarray(n.key, dtype=np.int32) for n in order])
    ck_node: list[int] = []
    ck_pos: list[int] = []
    ck_acc: list[int] = []
    ck_h: list[Any] = []
    for i, n in enumerate(order):
        if n.checkpoints:
            for p, h in n.checkpoints.items():
                ck_node.append(i)
                ck_pos.append(p)
                ck_acc.append(n.ckpt_access[p])
                ck_h.append(h)
    return TreeSnapshot(
        kv_bytes_per_token=tree.kv_bytes_per_token,
        state_bytes=tree.state_bytes,
        parent=_i64(parent),
        keys=keys,
        key_offsets=offs,
        start=np.fromiter((n.start for n in order), dtype=_I64, count=nn),
        uid=np.fromiter((n.uid for n in order), dtype=_I64, count=nn),
        last_access=np.fromiter((n.last_access for n in order), dtype=_I64, count=nn),
        lock_ref=np.fromiter((n.lock_ref for n in order), dtype=_I64, count=nn),
        kv=[n.kv for n in order],
        clock=int(tree.clock),
        uid_counter=int(tree._uid),  # noqa: SLF001
        version=np.fromiter((n.version for n in order), dtype=_I64, count=nn),
        seq_end=np.fromiter((n.seq_end for n in order), dtype=np.bool_, count=nn),
        chain=np.fromiter((n.chain for n in order), dtype=_I64, count=nn),
        ckpt_node=_i64(ck_node),
        ckpt_pos=_i64(ck_pos),
        ckpt_access=_i64(ck_acc),
        ckpt_handle=ck_h,
    )


def _validate(s: TreeSnapshot) -> None:
    """Raise :class:`SnapshotError` naming the first violated invariant (vectorised, O(n + m))."""
    n = len(s.parent)
    if n < 1:
        raise SnapshotError("a snapshot needs at least the root (node index 0)")
    for name in ("start", "uid", "last_access", "lock_ref"):
        if len(getattr(s, name)) != n:
            raise SnapshotError(f"{name} has {len(getattr(s, name))} entries, expected {n} (one per node)")
    for name in ("version", "seq_end", "chain"):
        a = getattr(s, name)
        if a is not None and len(a) != n:
            raise SnapshotError(f"{name} has {len(a)} entries, expected {n} (one per node)")
    if len(s.kv) != n:
        raise SnapshotError(f"kv has {len(s.kv)} entries, expected {n} (one per node)")
    parent = _i64(s.parent)
    if parent[0] != -1:
        raise SnapshotError("node 0 must be the root (parent[0] == -1)")
    idx = np.arange(n, dtype=_I64)
    if n > 1 and not ((parent[1:] >= 0) & (parent[1:] < idx[1:])).all():
        bad = int(np.flatnonzero((parent[1:] < 0) | (parent[1:] >= idx[1:]))[0]) + 1
        raise SnapshotError(f"node {bad}: parent index {int(parent[bad])} must be in [0, {bad}) (preorder)")
    offs = _i64(s.key_offsets)
    if len(offs) != n + 1 or offs[0] != 0 or offs[-1] != len(s.keys) or (np.diff(offs) < 0).any():
        raise SnapshotError("key_offsets must have n + 1 non-decreasing entries from 0 to len(keys)")
    lens = np.diff(offs)
    if lens[0] != 0:
        raise SnapshotError("the root's edge must be empty")
    if n > 1 and (lens[1:] <= 0).any():
        bad = int(np.flatnonzero(lens[1:] <= 0)[0]) + 1
        raise SnapshotError(f"node {bad}: empty edge (every non-root node holds >= 1 token)")
    start = _i64(s.start)
    end = start + lens
    if start[0] != 0 or (n > 1 and (start[1:] != end[parent[1:]]).any()):
        bad = 0 if start[0] != 0 else int(np.flatnonzero(start[1:] != end[parent[1:]])[0]) + 1
        raise SnapshotError(f"node {bad}: start must equal its parent's end depth (root: 0)")
    if len(np.unique(s.uid)) != n:
        raise SnapshotError("uids must be unique")
    if int(np.max(s.uid)) > s.uid_counter:
        raise SnapshotError(f"uid_counter {s.uid_counter} is below the largest uid {int(np.max(s.uid))}")
    if (s.lock_ref < 0).any() or s.lock_ref[0] < 1:
        raise SnapshotError("lock_ref must be >= 0 (the root's >= 1)")
    if n > 1:
        child_locks = np.bincount(parent[1:], weights=s.lock_ref[1:], minlength=n)
        if (s.lock_ref < child_locks).any():
            bad = int(np.flatnonzero(s.lock_ref < child_locks)[0])
            raise SnapshotError(f"node {bad}: lock_ref below the sum of its children's (locks cover paths)")
        first = s.keys[offs[1:-1]].astype(_I64)
        pairs = parent[1:] * (1 << 32) + (first - np.iinfo(np.int32).min)
        if len(np.unique(pairs)) != n - 1:
            raise SnapshotError("two children of one node start with the same token")
    if (s.last_access > s.clock).any():
        raise SnapshotError("a last_access is newer than clock")
    m = len(s.ckpt_node)
    if not (len(s.ckpt_pos) == len(s.ckpt_access) == len(s.ckpt_handle) == m):
        raise SnapshotError("ckpt_node, ckpt_pos, ckpt_access and ckpt_handle must have equal lengths")
    if m:
        cn, cp = _i64(s.ckpt_node), _i64(s.ckpt_pos)
        if (cn < 1).any() or (cn >= n).any():
            raise SnapshotError("ckpt_node must index non-root nodes")
        if ((cp <= start[cn]) | (cp > end[cn])).any():
            bad = int(np.flatnonzero((cp <= start[cn]) | (cp > end[cn]))[0])
            raise SnapshotError(
                f"checkpoint {bad} at depth {int(cp[bad])} outside its node's edge (start, end]"
            )
        if m > 1 and not ((cn[1:] > cn[:-1]) | ((cn[1:] == cn[:-1]) & (cp[1:] > cp[:-1]))).all():
            raise SnapshotError("checkpoints must be sorted by (node, position) without duplicates")
        if (s.ckpt_access > s.clock).any():
            raise SnapshotError("a ckpt_access is newer than clock")


def tree_from_snapshot(
    snap: TreeSnapshot,
    *,
    cls: Callable[..., TreeT],
    kv_ops: Any = None,
) -> TreeT:
    """A new ``cls`` tree equal to the one ``snap`` describes (validated first); derived indexes rebuilt.

    ``cls``: :class:`~sglang_sparse.tree.radix.RadixTree` or a subclass, called with the snapshot's
    configuration and ``kv_ops`` (``None`` = the default). Iterative, O(nodes + tokens +
    checkpoints). The tree owns a private copy of ``snap.keys``; handles are shared with ``snap``."""
    _validate(snap)
    tree = cls(snap.kv_bytes_per_token, snap.state_bytes, kv_ops=kv_ops)
    n = len(snap.parent)
    keys = np.array(snap.keys, dtype=np.int32, copy=True)
    offs = snap.key_offsets.tolist()
    parent = snap.parent.tolist()
    start = snap.start.tolist()
    uid = snap.uid.tolist()
    last = snap.last_access.tolist()
    lock = snap.lock_ref.tolist()
    version = snap.version.tolist() if snap.version is not None else [0] * n
    seq_end = snap.seq_end.tolist() if snap.seq_end is not None else [False] * n
    chain = snap.chain.tolist() if snap.chain is not None else [-1] * n
    kv = snap.kv
    root = tree.root
    root.uid, root.last_access, root.lock_ref, root.version = uid[0], last[0], lock[0], version[0]
    nodes: list[Node] = [root]
    kv_tokens = 0
    for i in range(1, n):
        par = nodes[parent[i]]
        key = keys[offs[i] : offs[i + 1]]
        node = Node(uid[i], key, start[i], par, kv[i], last[i])
        node.lock_ref = lock[i]
        node.version = version[i]
        node.seq_end = seq_end[i]
        node.chain = chain[i]
        par.children[key.item(0)] = node
        nodes.append(node)
        kv_tokens += offs[i + 1] - offs[i]
    cn, cp, ca, chd = (
        snap.ckpt_node.tolist(),
        snap.ckpt_pos.tolist(),
        snap.ckpt_access.tolist(),
        snap.ckpt_handle,
    )
    for j in range(len(cn)):
        node = nodes[cn[j]]
        node.checkpoints[cp[j]] = chd[j]
        node.ckpt_access[cp[j]] = ca[j]
    tree.clock = int(snap.clock)
    tree._uid = int(snap.uid_counter)  # noqa: SLF001
    tree.num_nodes = n - 1
    tree.kv_tokens = int(kv_tokens)
    tree.num_states = len(cn)
    tree.leaves = {nd for nd in nodes[1:] if not nd.children}
    sync = tree._sync_evictable  # noqa: SLF001 - rebuild the derived eviction index
    for nd in nodes[1:]:
        sync(nd)
    return tree

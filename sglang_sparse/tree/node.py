"""One radix-tree node: an edge of tokens, its KV handle and its recurrent-state checkpoints.

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
  belongs to, ``-1`` if none; written by :class:`~sglang_sparse.policy.chains.ChainTracker` only,
  kept by the upper part of a split and by the child of a merge.
* ``heap_key`` is the ``last_access`` of this node's newest entry in the tree's LRU leaf heap
  (``-1`` if it has none); maintained by :class:`RadixTree` only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

EMPTY_KEY = np.empty(0, dtype=np.int32)


class CheckpointMap(dict):
    """``{position (tokens): state handle}`` with keys kept sorted: a light ``SortedDict`` stand-in.

    A node holds a handful of checkpoints, and ``sortedcontainers.SortedDict()`` costs ~7 us to
    construct (two per insert); this ``dict`` subclass costs ~0.3 us. It implements the part of the
    ``SortedDict`` API the project uses: mapping operations, sorted iteration, ``keys()``/``values()``
    /``items()`` (sorted **lists**, i.e. snapshots, indexable), ``peekitem``/``popitem(index)``,
    ``bisect_left``/``bisect_right``/``bisect``, ``index``, ``irange``. Invariant: ``self._keys ==
    sorted(dict.keys(self))``.
    """

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

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._keys)

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

    bisect = bisect_right

    def index(self, key: int) -> int:
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            raise ValueError(f"{key} is not in checkpoint map")
        return i

    def irange(
        self,
        minimum: int | None = None,
        maximum: int | None = None,
        inclusive: tuple[bool, bool] = (True, True),
    ) -> Iterator[int]:
        """Sorted keys in ``[minimum, maximum]`` (bounds per ``inclusive``; ``None`` = unbounded)."""
        ks = self._keys
        lo, hi = 0, len(ks)
        if minimum is not None:
            lo = (bisect.bisect_left if inclusive[0] else bisect.bisect_right)(ks, minimum)
        if maximum is not None:
            hi = (bisect.bisect_right if inclusive[1] else bisect.bisect_left)(ks, maximum)
        return iter(ks[lo:hi])

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
        ck = _new_map(CheckpointMap)  # CheckpointMap() without the Python __init__ (~0.2 us less)
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
    def is_root(self) -> bool:
        return self.parent is None

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

"""One radix-tree node: an edge of tokens, its KV handle and its recurrent-state checkpoints.

A node owns the edge from its parent: token depths ``(start, end]`` (``end = start + len(key)``),
i.e. the tokens ``key = seq[start:end]``. Invariants (checked by :meth:`RadixTree.check`):

* ``kv`` is the opaque engine handle of the KV of exactly those ``len(key)`` tokens.
* ``checkpoints`` maps absolute depths ``p`` with ``start < p <= end`` to opaque state handles;
  the state at ``p`` is the recurrent state after the first ``p`` tokens of the path.
* ``ckpt_access[p]`` is the logical clock at which the checkpoint at ``p`` was created or last
  used as a resume point (same keys as ``checkpoints``).
* ``lock_ref > 0`` for every node on the path of a locked node (SGLang ``inc_lock_ref`` semantics);
  a locked node's KV and checkpoints are never evicted.
* ``children`` is keyed by the first token of the child's edge.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sortedcontainers import SortedDict

from sglang_sparse.placement import DepthHistogram

EMPTY_KEY = np.empty(0, dtype=np.int32)


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
        "hist",
        "plan",
        "version",
        "alive",
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
        self.checkpoints: SortedDict = SortedDict()
        self.ckpt_access: dict[int, int] = {}
        self.lock_ref = 0
        self.last_access = clock
        self.hist: DepthHistogram | None = None
        self.plan: tuple[int, ...] = ()
        self.version = 0
        self.alive = True

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
        i = ck.bisect_right(depth) - 1
        if i < 0:
            return None
        return ck.peekitem(i)

    def __repr__(self) -> str:
        return (
            f"Node(uid={self.uid}, depths=({self.start}, {self.end}], children={len(self.children)}, "
            f"ckpts={list(self.checkpoints.keys())}, lock={self.lock_ref})"
        )

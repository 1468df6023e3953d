"""The LRU order of a tree's evictable leaves: a lazily cleaned binary heap.

Entries are ``(last_access, uid, node)`` (logical clock ticks, the node's unique id as a tie-break).
A node's ``heap_key`` is the ``last_access`` of its newest entry, so a leaf whose recency has not
changed is never pushed twice; entries of nodes that were touched again, locked, gained children or
died stay in the heap until they surface (:meth:`LeafHeap.first` drops them) or until the heap
outgrows twice the evictable leaves + 64 (:meth:`LeafHeap.compact`). Costs: push O(log n), first
amortised O(log n).
"""

from __future__ import annotations

import heapq
from typing import Any, Protocol


class Node(Protocol):
    """What the heap reads and writes of a tree node (a :class:`~.core.Node`; a structural type, so
    this module, below :mod:`.core`, does not import it)."""

    uid: int
    alive: bool
    lock_ref: int
    children: dict[int, Any]
    last_access: int
    heap_key: int


Entry = tuple[int, int, Node]


class LeafHeap:
    """Evictable leaves in LRU order (``(last_access, uid)`` ascending); see the module docstring."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def __len__(self) -> int:
        return len(self.entries)

    @staticmethod
    def valid(entry: Entry) -> bool:
        """Is ``entry`` current: its node alive, unlocked, childless and not touched since?"""
        node = entry[2]
        return node.alive and node.lock_ref == 0 and not node.children and node.last_access == entry[0]

    def push(self, node: Node, evictable: int) -> None:
        """Index ``node`` (an evictable leaf) at its ``last_access``; ``evictable`` is the number of
        evictable leaves, which bounds the heap's size (compacted past ``2 * evictable + 64``)."""
        node.heap_key = node.last_access
        heapq.heappush(self.entries, (node.last_access, node.uid, node))
        if len(self.entries) > 2 * evictable + 64:
            self.compact()

    def compact(self) -> None:
        """Drop stale entries (O(n))."""
        keep = []
        for e in self.entries:
            if self.valid(e):
                keep.append(e)
            elif e[2].heap_key == e[0]:
                e[2].heap_key = -1
        heapq.heapify(keep)
        self.entries = keep

    def first(self) -> Node | None:
        """The least recently used evictable leaf, or ``None`` (stale entries on top are popped)."""
        heap = self.entries
        while heap:
            e = heap[0]
            if self.valid(e):
                return e[2]
            heapq.heappop(heap)
            if e[2].heap_key == e[0]:
                e[2].heap_key = -1
        return None

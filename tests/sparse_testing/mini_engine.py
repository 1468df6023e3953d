"""A small token radix tree with SGLang's structural-event semantics, for tests and benchmarks.

:class:`MiniEngine` behaves like SGLang's ``UnifiedTreeCore`` where the policy's mirror is concerned:
node ids from a counter, a split keeps the child's id and creates a new upper node, at most one
recurrent state per node (at its end), leaves removed whole, states freed alone ("tombstones"). It
reports every structural change to a :class:`~sglang_sparse.sglang_adapter.tree_policy.TreePolicy`
exactly as the SGLang adapter (``sglang_adapter/cache.py``) does. Pure Python, no SGLang; not fast.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any


class EngineNode:
    def __init__(self, nid: int, key: list[int], parent: EngineNode | None) -> None:
        self.id, self.key, self.parent = nid, key, parent
        self.children: dict[int, EngineNode] = {}
        self.state = False


class MiniEngine:
    def __init__(self, policy: Any) -> None:
        self.ids = itertools.count(100)
        self.root = EngineNode(next(self.ids), [], None)
        self.policy = policy
        policy.reset(self.root.id)

    def _split(self, child: EngineNode, k: int) -> EngineNode:
        up = EngineNode(next(self.ids), child.key[:k], child.parent)
        child.parent.children[child.key[0]] = up
        child.key = child.key[k:]
        child.parent = up
        up.children[child.key[0]] = child
        self.policy.on_node_split(child.id, up.id, k, child.key[0])
        return up

    def match(self, tokens: list[int]) -> tuple[EngineNode, int, int]:
        """(node the KV match ends on, KV depth, deepest state depth); splits like SGLang."""
        node, d, resume = self.root, 0, 0
        while d < len(tokens) and tokens[d] in node.children:
            c = node.children[tokens[d]]
            k = 0
            while k < len(c.key) and d + k < len(tokens) and c.key[k] == tokens[d + k]:
                k += 1
            if k < len(c.key):
                c = self._split(c, k)
            node, d = c, d + k
            if node.state:
                resume = d
        return node, d, resume

    def insert(self, tokens: list[int], *, finished: bool = False) -> EngineNode:
        """Cache ``tokens`` with a state at their end; ``finished``: the request's final insert
        (SGLang's ``cache_finished_req``: a sequence ended there)."""
        node, d, _ = self.match(tokens)
        if d < len(tokens):
            leaf = EngineNode(next(self.ids), tokens[d:], node)
            node.children[tokens[d]] = leaf
            self.policy.on_node_added(leaf.id, node.id, len(leaf.key), leaf.key[0])
            node = leaf
        if not node.state:
            node.state = True
            self.policy.on_state_set(node.id)
        self.policy.on_insert(node.id, finished=finished)
        return node

    def nodes(self) -> Iterator[EngineNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def export(self) -> list[tuple[int, int, list[int], bool]]:
        return [(n.id, n.parent.id, list(n.key), n.state) for n in self.nodes()]

    def free_state(self, n: EngineNode) -> None:
        n.state = False
        self.policy.on_state_freed(n.id)

    def remove_leaf(self, n: EngineNode) -> None:
        assert not n.children
        if n.state:
            self.free_state(n)
        del n.parent.children[n.key[0]]
        self.policy.on_leaf_removed(n.id)

    def by_id(self, nid: int) -> EngineNode | None:
        return next((n for n in self.nodes() if n.id == nid), None)

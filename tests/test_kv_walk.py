"""The sparse backend's KV walk (:class:`_KVWalk`) evicts SGLang's leaves in exactly the order of
SGLang's own walk (a heap over every evictable leaf, parents pushed as they are exposed) keyed by
``(rank, LRU priority, id)``, although it keys only stateless and speculative leaves up front and
pulls scored states lazily from the policy's stream. Random trees with dead leaves, speculative,
scored (many tied keys) and unscored states, leaves exposed during the walk."""

from __future__ import annotations

import heapq
import importlib.util
import random
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang not installed; run tools/setup_env.sh", allow_module_level=True)

from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402

from sglang_sparse.sglang_adapter.cache import _KVWalk, _LeafSet  # noqa: E402

MAMBA = int(ComponentType.MAMBA)


class FakeNode:
    def __init__(self, nid: int, parent: FakeNode | None, has_state: bool, t: float) -> None:
        self.id = nid
        self.parent = parent
        self.children: list[FakeNode] = []
        self.component_data = [SimpleNamespace(value=None) for _ in range(MAMBA + 1)]
        self.component_data[MAMBA].value = object() if has_state else None
        self.last_access_time = t


class FakePolicy:
    """What ``_KVWalk`` reads of ``TreePolicy``: speculative ids, the mirror's state ids, one
    frozen round of scored keys as a sorted stream (ties adjacent) and a lookup."""

    def __init__(self, keys: dict[int, float], spec: list[int], states: set[int]) -> None:
        self.keys = keys
        self.spec = dict.fromkeys(spec)
        self.mirror = SimpleNamespace(state_ids=states)

    def speculative_ids(self):
        return self.spec.keys()

    def scored_states(self, only=None):
        allowed = None if only is None else set(only.tolist())
        rows = sorted((k, h) for h, k in self.keys.items() if allowed is None or h in allowed)
        return iter(rows), self.keys.get


def build(seed: int):
    rng = random.Random(seed)
    root = FakeNode(0, None, False, 0.0)
    nodes = [root]
    for i in range(1, rng.randint(20, 120)):
        parent = rng.choice(nodes)
        n = FakeNode(i, parent, rng.random() < 0.75, float(rng.randint(0, 30)))
        parent.children.append(n)
        nodes.append(n)
    stateful = [n.id for n in nodes[1:] if n.component_data[MAMBA].value is not None]
    keys = {
        h: float(rng.choice([-float("inf"), 0.0, 0.25, 0.5, 0.5, 1.0]))
        for h in stateful
        if rng.random() < 0.8
    }
    spec = [h for h in stateful if rng.random() < 0.1]
    return root, nodes, keys, spec, set(stateful)


def rank(n: FakeNode, keys: dict[int, float], spec) -> tuple:
    if n.component_data[MAMBA].value is None:
        return (0, 0.0)
    if n.id in spec:
        return (0, 1.0)
    k = keys.get(n.id)
    return (2, 0.0) if k is None else (1, k)


def reference_order(root: FakeNode, nodes: list[FakeNode], keys, spec, budget: int) -> list[int]:
    """SGLang's FullComponent walk: heap of every leaf, the last evicted node's parent pushed."""
    children = {n.id: len(n.children) for n in nodes}
    leaves = {n for n in nodes[1:] if not n.children}
    heap = [((rank(n, keys, spec), n.last_access_time, n.id), n.id, n) for n in leaves]
    heapq.heapify(heap)
    out: list[int] = []
    while heap and len(out) < budget:
        _, _, x = heapq.heappop(heap)
        if x not in leaves:
            continue
        out.append(x.id)
        leaves.discard(x)
        p = x.parent
        children[p.id] -= 1
        if p is not root and children[p.id] == 0:
            leaves.add(p)
            heapq.heappush(heap, ((rank(p, keys, spec), p.last_access_time, p.id), p.id, p))
    return out


def walk_order(root: FakeNode, nodes: list[FakeNode], keys, spec, states, budget: int) -> list[int]:
    children = {n.id: len(n.children) for n in nodes}
    leaves = _LeafSet(n for n in nodes[1:] if not n.children)
    policy = FakePolicy(keys, spec, set(states))
    walk = _KVWalk(leaves, policy, lambda n: n.last_access_time)
    out: list[int] = []
    while len(out) < budget:
        x = walk.pop()
        if x is None:
            break
        out.append(x.id)
        leaves.discard(x)  # SGLang evicts the leaf
        policy.mirror.state_ids.discard(x.id)
        p = x.parent
        children[p.id] -= 1
        if p is not root and children[p.id] == 0:
            leaves.add(p)
            walk.push(p)  # what _evict_device_next_node does with the exposed parent
    return out


@pytest.mark.parametrize("seed", range(40))
def test_walk_equals_sglang_heap_order(seed: int) -> None:
    root, nodes, keys, spec, states = build(seed)
    budget = len(nodes) if seed % 2 else max(1, len(nodes) // 5)  # whole tree or a few pops
    want = reference_order(root, nodes, keys, spec, budget)
    got = walk_order(root, nodes, keys, spec, states, budget)
    assert got == want
    if budget == len(nodes):
        assert sorted(got) == list(range(1, len(nodes)))  # every node, each once


def test_leaf_set_keeps_its_id_index_and_refuses_bulk_updates() -> None:
    a, b = FakeNode(1, None, True, 0.0), FakeNode(2, None, False, 0.0)
    s = _LeafSet([a])
    s.add(b)
    s.discard(a)
    s.discard(a)  # absent: no error, as set.discard
    assert set(s.by_id) == {2} and s.by_id[2] is b and b in s
    assert s.pop() is b and not s.by_id
    with pytest.raises(TypeError):
        s.update([a])
    with pytest.raises(TypeError):
        s |= {a}

"""HiCache write-back with ``SGLANG_SPARSE_DEMOTE=policy``: a node SGLang hands back after its backup
is re-selected, not skipped.

SGLang's device state walk returns ``InternalStateBackup`` for an internal state without a host copy;
the cache backs it up and calls ``UnifiedTreeCore._finish_internal_component_eviction``, which, when
the node has meanwhile become an evictable leaf (or lost its device KV), sets the component's
``_evict_device_cursor`` to it so that the walk's next step takes it (``unified_tree_core.py``
~L1750). The policy's walk is an iterator that has already passed that node; it must honour the
cursor. In-process, on the component's own step function with a stand-in tree core (the step reads
the LRU membership, the leaf set and the HiCache flags only); a real server does not reach this
branch on the test workloads (``backups_reselected`` stays 0 on the HiCache storm)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack()

from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import (  # noqa: E402
    BASE_COMPONENT_TYPE,
    InternalStateBackup,
)

from sglang_sparse.sglang_adapter.cache import SparseMambaComponent  # noqa: E402


class _Lru:
    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = set(map(id, nodes))

    def in_list(self, x: Any) -> bool:
        return id(x) in self.nodes


class _Node:
    """What the step reads of a ``TreeNode``: id, backup flag, the Mamba and KV component data
    (hashable by identity, as SGLang's nodes are)."""

    def __init__(self, nid: int) -> None:
        self.id, self.backuped = nid, False
        self.component_data = {
            ComponentType.MAMBA: SimpleNamespace(value=object(), host_value=None, lock_ref=0),
            BASE_COMPONENT_TYPE: SimpleNamespace(value=object()),
        }


def _walk(a: _Node, b: _Node) -> SparseMambaComponent:
    """A Mamba component mid-walk under the policy's order ``[a, b]`` (both scored): ``a`` an internal
    state with no host copy, ``b`` an evictable device leaf."""
    comp = object.__new__(SparseMambaComponent)
    comp.component_type = ComponentType.MAMBA
    comp.tree_core = SimpleNamespace(
        lru_lists={ComponentType.MAMBA: _Lru([a, b])},
        evictable_device_leaves={b},
        enable_hicache=True,
        is_write_back=True,
        enable_session_radix_cache=False,
    )
    stats = SimpleNamespace(unscored_evictions=0, backups_reselected=0)
    comp.cache = SimpleNamespace(policy=SimpleNamespace(stats=stats, config=SimpleNamespace(demote="policy")))
    comp._evict_device_request_cnt = 2
    comp._sparse_order = iter([(a, True), (b, True)])
    comp._evict_device_cursor = None
    return comp


def _step(comp: SparseMambaComponent) -> Any:
    tracker = {ComponentType.MAMBA: 0}
    return comp._evict_device_next_node(tracker, {}, {}, [])


def test_a_node_handed_back_after_its_backup_is_taken_next() -> None:
    a, b = _Node(1), _Node(2)
    comp = _walk(a, b)
    first = _step(comp)
    assert isinstance(first, InternalStateBackup) and first.node_id == a.id
    # SGLang backed ``a`` up; meanwhile it became an evictable leaf: re-select it.
    comp.tree_core.evictable_device_leaves.add(a)
    comp._evict_device_cursor = a
    assert _step(comp) == a.id
    assert comp._evict_device_cursor is None
    assert comp.cache.policy.stats.backups_reselected == 1
    assert _step(comp) == b.id  # the policy's order goes on where it was
    assert comp.cache.policy.stats.unscored_evictions == 0


def test_a_handed_back_node_no_longer_evictable_is_passed_over() -> None:
    a, b = _Node(1), _Node(2)
    comp = _walk(a, b)
    assert isinstance(_step(comp), InternalStateBackup)
    a.component_data[ComponentType.MAMBA].lock_ref = 1  # a request locked it meanwhile
    comp._evict_device_cursor = a
    assert _step(comp) == b.id

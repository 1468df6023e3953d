"""SGLang 0.5.23 classes of the ``sparse`` backend (this module imports SGLang; load it lazily).

One tree: SGLang's. The policy (:class:`~sglang_sparse.sglang_adapter.tree_policy.TreePolicy`)
keeps a token-free mirror of it keyed by SGLang node ids, changed only by SGLang's structural
events, which these classes forward: :class:`SparseTreeCore` (SGLang's Python tree core, registered
as ``sparse_python``: new nodes, splits, removed leaves, resets), :class:`SparseMambaComponent`
(admission, state attach/free, the policy's state eviction order keeping SGLang's leaf-vs-tombstone
semantics), :class:`SparseFullComponent` (the policy's KV-leaf eviction order),
:class:`SparseRadixCache` (owns the policy, plans each request from SGLang's own match with no token
re-matched, statistics, mirror checks) and :func:`sparse_prefill_adder_class` (ends prefill chunks
at planned positions). ``docs/sparse_backend.md`` has the design, its limits and the call sites.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertResult
from sglang.srt.mem_cache.unified_cache.components import ComponentType, EvictLayer
from sglang.srt.mem_cache.unified_cache.components.base import BASE_COMPONENT_TYPE, InternalStateBackup
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_cache.unified_tree_core import (
    UnifiedTreeCore,
    _InsertPhase,
    _InsertWalkState,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from .tree_policy import EngineNode, TreePolicy, request_checkpoints

logger = logging.getLogger("sglang_sparse")

TREE_CORE_NAME = "sparse_python"
_MAX_PENDING_MATCHES = 65536


def _child_key(node: Any, page_size: int) -> Any:
    return node.key.child_key(page_size)


def _holds_state(cd: Any) -> bool:
    """A node's Mamba component data holds a state on the device or (HiCache) on the host."""
    return cd.value is not None or getattr(cd, "host_value", None) is not None


def final_track_depth(input_len: int, max_new_tokens: int | None, page_size: int) -> int | None:
    """Depth (tokens) of the exact finish state of a request that runs to ``max_new_tokens``: the
    key SGLang inserts at finish (prompt + output - 1 tokens; the last sampled token is never
    fed), page-aligned down; ``None`` without a length limit (no depth to track)."""
    if not max_new_tokens:
        return None
    return (int(input_len) + int(max_new_tokens) - 1) // page_size * page_size


class _LeafSet(set):
    """SGLang's set of evictable device leaves, also indexed by node id (``by_id``), so a KV walk
    gets the leaf ids without a pass over the nodes. SGLang changes the set with ``add`` and
    ``discard`` only (0.5.23); the other mutators are kept in step too."""

    def __init__(self, nodes: Iterable[Any] = ()) -> None:
        super().__init__(nodes)
        self.by_id: dict[int, Any] = {n.id: n for n in self}

    def add(self, node: Any) -> None:
        set.add(self, node)
        self.by_id[node.id] = node

    def discard(self, node: Any) -> None:
        set.discard(self, node)
        self.by_id.pop(node.id, None)

    def remove(self, node: Any) -> None:
        set.remove(self, node)
        del self.by_id[node.id]

    def pop(self) -> Any:
        node = set.pop(self)
        del self.by_id[node.id]
        return node

    def clear(self) -> None:
        set.clear(self)
        self.by_id.clear()

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("in-place set operations would bypass the leaf index; use add/discard")

    update = difference_update = intersection_update = symmetric_difference_update = _unsupported
    __ior__ = __isub__ = __iand__ = __ixor__ = _unsupported


class SparseTreeCore(UnifiedTreeCore):
    """SGLang's Python tree core, reporting structural events to ``self.policy`` (set by the cache).
    Every node is created by ``_new_node`` and attached by ``_add_new_node`` (a new edge) or
    ``_split_node`` (a new upper half; the child keeps its id), and detached only by
    ``_remove_leaf_from_parent``; ``reset`` rebuilds the root. Those four are the events."""

    policy: TreePolicy | None = None
    #: ``(node id, depth in tokens)``: the next insert's key starts with the tokens of the path to
    #: that node (:meth:`SparseRadixCache.checkpoint_into_tree` sets the request's locked node and
    #: protected length; the next :meth:`begin_insert` consumes it, whether it uses it or not)
    insert_hint: tuple[Any, int] | None = None
    #: inserts whose walk started from the hint / fell back to SGLang's walk from the root
    hinted_inserts = 0
    unhinted_inserts = 0

    def reset(self) -> None:
        super().reset()
        self.evictable_device_leaves = _LeafSet(self.evictable_device_leaves)
        self.evictable_host_leaves = _LeafSet(self.evictable_host_leaves)
        if self.policy is not None:
            self.policy.reset(self.root_node.id)

    def _add_new_node(self, parent, key, value, priority=0, session_id=None, rotation_base=None):
        node = super()._add_new_node(parent, key, value, priority, session_id, rotation_base)
        if self.policy is not None:
            self.policy.on_node_added(node.id, parent.id, len(node.key), _child_key(node, self.page_size))
        return node

    def _split_node(self, key, child, split_len):
        new_node, action = super()._split_node(key, child, split_len)
        if self.policy is not None:
            self.policy.on_node_split(
                child.id, new_node.id, len(new_node.key), _child_key(child, self.page_size)
            )
        return new_node, action

    def _remove_leaf_from_parent(self, node):
        super()._remove_leaf_from_parent(node)
        if self.policy is not None:
            self.policy.on_leaf_removed(node.id)

    # ---------------------------------------------------------------- insert from a known node

    def begin_insert(self, params):
        """SGLang's insert, its walk resumed at the hinted node (:attr:`insert_hint`) when the key
        is known to continue that node's path: the steps over the path are replayed without
        re-matching its tokens (see :meth:`_replay_known_path`), then SGLang's own walk continues.
        Same tree, same LRU clocks, same actions as SGLang's walk from the root."""
        hint, self.insert_hint = self.insert_hint, None
        path = None if hint is None else self._known_path(hint, params)
        if path is None:
            self.unhinted_inserts += hint is not None
            return super().begin_insert(params)
        self.hinted_inserts += 1
        return self._begin_insert_on(path, params)

    def _known_path(self, hint: tuple[Any, int], params) -> list[Any] | None:
        """The nodes from the root's child to the hinted node (parents first) if the walk may
        resume there, else ``None`` (SGLang's walk runs). Resuming needs: no feature whose walk
        steps emit actions on already-cached nodes (HiCache hit counts, external linker,
        sessions, rotation bases, EAGLE bigrams); a live, non-evicted path whose edges add up to
        exactly the hinted depth ``d``; ``d`` at most the key's page-aligned length and at most
        ``prev_prefix_len`` (so the replayed nodes free no duplicate KV). The tokens are not
        compared: the path holds the request's own first ``d`` tokens (it inserted or matched
        them), checked only with ``SGLANG_SPARSE_CHECK_INVARIANTS``."""
        node_id, depth = hint
        if (
            depth <= 0
            or self.is_eagle
            or self.enable_hicache
            or self.enable_external_cache_linker
            or self.enable_session_radix_cache
            or params.rotation_base is not None
            or depth > int(params.prev_prefix_len)
            or depth > len(params.key) // self.page_size * self.page_size
        ):
            return None
        node = self._node_arena.get(getattr(node_id, "id", node_id))
        path: list[Any] = []
        total = 0
        while node is not None and node is not self.root_node:
            if node.evicted:
                return None
            path.append(node)
            total += len(node.key)
            node = node.parent
        if node is None or total != depth:
            return None
        path.reverse()
        if self.policy is not None and self.policy.config.check_invariants:
            tokens = params.key.token_ids
            at = 0
            for n in path:
                edge = n.key.raw_token_ids()
                if list(edge) != list(tokens[at : at + len(edge)]):
                    logger.error("sparse cache: insert hint path differs from the key at %d", at)
                    return None
                at += len(edge)
        return path

    def _begin_insert_on(self, path: list[Any], params):
        """``UnifiedTreeCore.begin_insert`` with the walk steps over ``path`` replayed
        (:meth:`_replay_known_path`) instead of matched; the walk continues below its last node."""
        key = params.key.page_aligned(self.page_size)
        value = params.value
        if value is not None:
            value = value[: len(key)]
        else:
            value = torch.tensor(key.token_ids[: len(key)], dtype=torch.int64)
        priority = params.priority
        if priority is None:
            priority = 0
        self._touch_node(self.root_node)
        self.root_node.priority = max(self.root_node.priority, priority)
        state = _InsertWalkState(
            phase=_InsertPhase.WALK,
            node=self.root_node,
            key=key,
            value=value,
            params=params,
            priority=priority,
            result=InsertResult(prefix_len=0, adopted_ranges={} if params.track_adopted_ranges else None),
        )
        self._replay_known_path(state, path)
        self._ongoing_insert_walk_state = state
        return self._advance_insert()

    def _replay_known_path(self, state, path: list[Any]) -> None:
        """What ``_insert_walk_step`` + ``_insert_overlap_step`` + ``_finish_insert_walk_node`` do on
        a node whose whole edge the key matches, below ``prev_prefix_len`` and not evicted, for each
        node of ``path`` in order: touch (LRU clock), priority, the components' overlap hooks
        (their consumed index is ignored: nothing below ``prev_prefix_len`` is a duplicate to free),
        the hit count of a node past ``inserted_len``; then the state points below the path (one
        key slice instead of one per node)."""
        params, result, actions = state.params, state.result, state.pending_actions
        value, priority = state.value, state.priority
        inserted = params.inserted_len
        total = 0
        for node in path:
            self._touch_node(node)
            n = len(node.key)
            node.priority = max(node.priority, priority)
            for component in self.components:
                component.update_component_on_insert_overlap(
                    node=node,
                    prefix_len=n,
                    total_prefix_len=total,
                    value_slice=value[:n] if total == 0 else value[total : total + n],
                    params=params,
                    result=result,
                    cache_actions=actions,
                )
            if total + n > inserted and self._inc_hit_count_and_check(node):
                raise AssertionError("a hit-count backup without HiCache or an external linker")
            total += n
        state.node = path[-1]
        state.total_prefix_length = total
        state.key = state.key[total:]
        state.value = value[total:]

    def insert_host(self, node_id, key, host_value, hash_value):
        """HiCache storage prefetch (L3 -> host): SGLang attaches the path's last edge itself
        (``UnifiedTreeCore.insert_host`` builds it with ``_new_node``, not ``_add_new_node``); the
        splits on the way are reported by :meth:`_split_node`."""
        result = super().insert_host(node_id, key, host_value, hash_value)
        nid = result.inserted_host_node
        if self.policy is not None and nid is not None and self.policy.mirror.get(nid) is None:
            node = self._node_arena.get(nid)  # noqa: SLF001
            if node is not None:
                self.policy.on_node_added(
                    node.id, node.parent.id, len(node.key), _child_key(node, self.page_size)
                )
        return result

    def iter_nodes(self) -> Iterator[Any]:
        """Every non-root node, parents before children (iterative)."""
        stack = list(self.root_node.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def make_sparse_tree_core(params, components):
    """Tree-core factory of ``sparse_python`` (``tree_core_registry.register_tree_core_backend``)."""
    return SparseTreeCore(params, components)


def _device_policy_walk(tree_core: Any, policy: TreePolicy) -> bool:
    """Whether the device walks (state pool short, KV pool short) take the policy's order: not with
    sessions (SGLang's session cursors), and with HiCache only under ``SGLANG_SPARSE_DEMOTE=policy``
    (else SGLang's LRU walks pick what the device demotes)."""
    if tree_core.enable_session_radix_cache:
        return False
    return not tree_core.enable_hicache or policy.config.demote == "policy"


def _host_policy_walk(tree_core: Any) -> bool:
    """Whether the host's drops (HiCache, a host pool short) take the policy's order: with HiCache
    and without sessions (SGLang's walks skip session-pinned leaves)."""
    return tree_core.enable_hicache and not tree_core.enable_session_radix_cache


class SparseMambaComponent(MambaComponent):
    """Mamba component: policy admission, state events to the mirror, policy eviction order."""

    # ---------------------------------------------------------------- keep (admission)

    _deferred = False
    #: whether the node last handed to SGLang for a write-back backup came from the policy's order
    _backup_scored = True

    def offered_position(self, req, token_ids_len: int, is_finished: bool) -> int | None:
        """Depth (tokens) of the state SGLang offers at this checkpoint, ``None`` if none: the live
        state at ``token_ids_len`` with no_buffer; with extra_buffer the snapshot its ping-pong
        buffer names (the extend's last grid point, a decode track, or at finish the latest of the
        two that fits the key, as ``MambaComponent._select_finished_checkpoint`` picks it)."""
        if not self.cache.enable_mamba_extra_buffer:
            return int(token_ids_len)
        if is_finished:
            if req.kv.mamba_ping_pong_track_buffer is None:
                return None
            chosen = self._select_finished_checkpoint(req, token_ids_len)
            return None if chosen is None else int(chosen[0])
        pos = req.kv.mamba_last_track_seqlen
        return None if pos is None else int(pos)

    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        policy: TreePolicy = self.cache.policy
        self._deferred = False
        pos = self.offered_position(req, token_ids_len, is_finished)
        if not pos:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        if pos < int(req.kv.cache_protected_len):
            # A deeper state of this request is already in the tree (published capture): this one
            # is shallower on the same path and dominated. Nothing to insert.
            return 0
        free = int(self.cache.req_to_token_pool.mamba_allocator.available_size())
        if not policy.admit(req.rid, pos, finished=is_finished, free_slots=free):
            # Skip the whole insert before a slot is allocated; the KV stays request-owned and is
            # published by the next admitted checkpoint (or the final one). With extra_buffer a
            # request whose plan wants a state past the prompt keeps naming the snapshot, so the
            # finish can still fall back to it (SGLang picks the latest snapshot that fits).
            self._deferred = (
                self.cache.enable_mamba_extra_buffer and not is_finished and policy.wants_final_state(req.rid)
            )
            return 0
        return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)

    def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
        super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
        if node.component_data[self.component_type].value is not None:
            self.cache.policy.on_state_set(node.id)

    def cleanup_after_caching_req(self, req, is_finished, insert_result=None, insert_params=None):
        kept = (req.kv.mamba_last_track_seqlen, req.kv.mamba_prev_track_seqlen) if self._deferred else None
        super().cleanup_after_caching_req(
            req, is_finished=is_finished, insert_result=insert_result, insert_params=insert_params
        )
        if kept is not None:  # a deferred snapshot stays named in the ping-pong buffer
            req.kv.mamba_last_track_seqlen, req.kv.mamba_prev_track_seqlen = kept
        self._deferred = False
        self.cache.policy.end_checkpoint()
        if insert_result is not None and insert_result.last_device_node is not None:
            node_id = getattr(insert_result.last_device_node, "id", insert_result.last_device_node)
            if self.tree_core._node_arena.get(node_id) is not None:  # noqa: SLF001 - lookup, no KeyError
                seq_len = key_length(req) if is_finished else None
                self.cache.policy.on_insert(node_id, finished=is_finished, seq_len=seq_len)
        elif is_finished:
            self.cache.end_sequence_at_lock(req)
        self.cache.maybe_check_invariants("checkpoint")

    # ---------------------------------------------------------------- mirror state frees

    def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
        # HiCache: the mirror is the logical cache (device + host). A state demoted to the host
        # (device slot freed, host copy kept) stays in the mirror; it leaves only when its last
        # copy goes (device eviction without a backup, or host eviction).
        cd = node.component_data[self.component_type]
        had = _holds_state(cd)
        out = super().evict_component(node, device_frees, host_frees, cache_actions, target=target)
        if had and not _holds_state(cd):
            self.cache.policy.on_state_freed(node.id)
        return out

    # ---------------------------------------------------------------- HiCache phases

    def commit_hicache_transfer(
        self, node, phase, transfers=(), *, cache_actions, insert_result=None, pool_storage_result=None
    ):
        """SGLang's copies, then the mirror: a LOAD_BACK puts a host state back on the device (the
        mirror already holds it); a PREFETCH from L3 storage may attach a state to a node that had
        none (a new state for the mirror)."""
        super().commit_hicache_transfer(
            node,
            phase,
            transfers,
            cache_actions=cache_actions,
            insert_result=insert_result,
            pool_storage_result=pool_storage_result,
        )
        if _holds_state(node.component_data[self.component_type]):
            self.cache.policy.on_state_restored(node.id)

    # ---------------------------------------------------------------- evict (order)

    def _policy_walk(self) -> bool:
        return _device_policy_walk(self.tree_core, self.cache.policy)

    def _evict_device_start(self, request_cnt: int) -> None:
        if not self._policy_walk():
            return super()._evict_device_start(request_cnt)
        self._evict_device_request_cnt = request_cnt
        self._sparse_order = self._walk_order()
        self._evict_device_cursor = None

    def _walk_order(self, host: bool = False) -> Iterator[tuple[Any, bool]]:
        """``(SGLang node, scored)`` for the nodes holding a state: the policy's order first (lazily),
        then SGLang's own LRU order for the states the policy offers no candidate for (``host``:
        the host LRU of the states held on the host only, host-unlocked ones; else the device LRU,
        unlocked ones).

        The caller evicts each node before asking for the next, so nothing here may depend on a
        yielded node staying in the tree: a policy handle SGLang no longer holds (only after
        mirror drift, or a tombstone ancestor SGLang deleted with an evicted leaf; ``node_by_id``
        would raise ``KeyError``) is skipped, and the LRU list is read in full before its first
        node is yielded (walking it past an evicted node asserts)."""
        arena = self.tree_core._node_arena.get  # noqa: SLF001 - None for a node SGLang deleted
        seen: set[int] = set(self.cache.policy.protected)  # the LRU rest skips them too
        for h in self.cache.policy.eviction_order():
            x = arena(h)
            if x is not None:
                seen.add(h)
                yield x, True
        if host:
            lru = self.tree_core.host_lru_lists[self.component_type]
            first, prev = lru.get_lru_no_host_lock, lru.get_prev_no_host_lock
        else:
            lru = self.tree_core.lru_lists[self.component_type]
            first, prev = lru.get_lru_no_lock, lru.get_prev_no_lock
        rest = []
        x = first()
        while x is not None:  # least recent first, unlocked only
            if x.id not in seen:
                rest.append(x)
            x = prev(x)
        for x in rest:
            yield x, False

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        if not self._policy_walk():
            return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
        ct = self.component_type
        lru = self.tree_core.lru_lists[ct]
        if tracker[ct] >= self._evict_device_request_cnt:
            return None
        order: Iterable[tuple[Any, bool]] = self._sparse_order
        back = self._evict_device_cursor
        if back is not None:
            # HiCache write-back: SGLang's ``_finish_internal_component_eviction`` hands a node it
            # backed up back for re-selection (it became a leaf, or lost its device KV) by setting
            # the cursor, as its own LRU walk resumes there; this walk has already passed it.
            self._evict_device_cursor = None
            self.cache.policy.stats.backups_reselected += 1
            order = itertools.chain(((back, self._backup_scored),), order)
        for x, scored in order:
            cd = x.component_data[ct]
            if not lru.in_list(x) or cd.value is None or cd.lock_ref > 0:
                continue  # freed or locked
            if not scored:
                self.cache.policy.stats.unscored_evictions += 1
            tc = self.tree_core
            if x in tc.evictable_device_leaves:
                return x.id  # the cache evicts the whole leaf (KV + state; HiCache: backup, demote)
            if (
                tc.enable_hicache
                and tc.is_write_back
                and cd.host_value is None
                and not x.backuped
                and x.component_data[BASE_COMPONENT_TYPE].value is not None
            ):
                # SGLang's own step (MambaComponent._evict_device_next_node): the cache backs the
                # state up to the host, then finishes the tombstone (finish_mamba_state_eviction).
                self._backup_scored = scored
                return InternalStateBackup(node_id=x.id, num_tokens=1)
            self._tombstone(x, EvictLayer.DEVICE, tracker, device_frees, host_frees, cache_actions)
            return None  # one mutation per step
        return None

    def _tombstone(self, x, target, tracker, device_frees, host_frees, cache_actions) -> None:
        """SGLang's step for an internal node (or a leaf that must stay): free its state on layer
        ``target`` (device or host) only, detach it from that LRU, and cascade to the components
        that depend on it, as ``MambaComponent``'s own walks do."""
        tc = self.tree_core
        tc._evict_component_and_detach_lru(
            x,
            self,
            target=target,
            tracker=tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )
        tc._cascade_evict(
            x,
            self,
            tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
            target=target,
        )

    def _evict_device_end(self) -> None:
        if not self._policy_walk():
            return super()._evict_device_end()
        self._sparse_order = iter(())
        self._evict_device_cursor = None
        self.cache.maybe_check_invariants("state eviction")

    # ---------------------------------------------------------------- HiCache host drop (order)

    def drive_host_eviction(self, num_tokens, tracker, device_frees, host_frees, cache_actions):
        """HiCache, host state pool short: drop host-only states in the policy's eviction order
        (:meth:`_walk_order`), not SGLang's host LRU: what the host drops is what the logical cache
        (device + host) loses, the policy's decision as in the simulator's host tier; the device
        side stays SGLang's LRU demotion (nothing is lost there). Each step is SGLang's own: a host
        leaf is evicted whole (``_evict_host_leaf``), an internal node loses its host state only
        (tombstone + cascade). With sessions SGLang's own walk runs (its cursor skips pinned leaves)."""
        if not _host_policy_walk(self.tree_core):
            return super().drive_host_eviction(num_tokens, tracker, device_frees, host_frees, cache_actions)
        ct = self.component_type
        tc = self.tree_core
        host_lru = tc.host_lru_lists[ct]
        for x, scored in self._walk_order(host=True):
            if tracker[ct] >= num_tokens:
                break
            cd = x.component_data[ct]
            if not host_lru.in_list(x) or cd.host_value is None or cd.host_lock_ref > 0:
                continue  # on the device too (not the host's to drop), gone, or host-locked
            if not scored:
                self.cache.policy.stats.unscored_evictions += 1
            self.cache.policy.stats.host_state_drops += 1
            if x in tc.evictable_host_leaves:
                tc._evict_host_leaf(x, tracker, device_frees, host_frees, cache_actions=cache_actions)
                continue
            self._tombstone(x, EvictLayer.HOST, tracker, device_frees, host_frees, cache_actions)
            tc._update_evictable_leaf_sets(x)
        self.cache.maybe_check_invariants("host state eviction")


class SparseFullComponent(FullComponent):
    """KV component whose device-eviction walk (KV pool short) takes leaves in the policy's order
    (:class:`_KVWalk`: a leaf without a state first, its KV is dead weight); SGLang's own walk where
    :func:`_device_policy_walk` says so."""

    def _policy_walk(self) -> bool:
        return _device_policy_walk(self.tree_core, self.cache.policy)

    def _evict_device_start(self, request_cnt: int) -> None:
        if not self._policy_walk():
            return super()._evict_device_start(request_cnt)
        self._ensure_eviction_strategy()
        self._evict_device_request_cnt = request_cnt
        self._evict_device_last_node = None
        self.cache.policy.stats.kv_eviction_walks += 1
        self._walk = _KVWalk(
            self.tree_core.evictable_device_leaves,
            self.cache.policy,
            self.tree_core.eviction_strategy.get_priority,
        )

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        if not self._policy_walk():
            return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
        walk: _KVWalk = self._walk
        lv = self._evict_device_last_node
        if lv is not None and lv.parent is not None and lv.parent in walk.leaves:
            walk.push(lv.parent)  # exposed by the last eviction
        self._evict_device_last_node = None
        if tracker[self.component_type] >= self._evict_device_request_cnt:
            return None
        x = walk.pop()
        if x is None:
            return None
        self._evict_device_last_node = x
        return x.id

    def _evict_device_end(self) -> None:
        if not self._policy_walk():
            return super()._evict_device_end()
        self._walk = None
        self._evict_device_last_node = None
        self.cache.maybe_check_invariants("KV eviction")

    def drive_host_eviction(self, num_tokens, tracker, device_frees, host_frees, cache_actions):
        """HiCache, host KV pool short: drop host leaves in the device walk's order
        (:class:`_KVWalk`), not SGLang's host LRU. Each step is SGLang's own (``_evict_host_leaf``:
        the leaf's KV and state, then tombstoned parents); a parent it exposes joins the walk.
        SGLang's write-back duplicate reclaim (``UnifiedTreeCore.drive_host_eviction``) runs
        first. With sessions SGLang's own walk runs."""
        tc = self.tree_core
        if not _host_policy_walk(tc):
            return super().drive_host_eviction(num_tokens, tracker, device_frees, host_frees, cache_actions)
        policy = self.cache.policy
        walk = _KVWalk(tc.evictable_host_leaves, policy, tc.eviction_strategy.get_priority)
        ct = self.component_type
        while tracker[ct] < num_tokens:
            x = walk.pop()
            if x is None:
                break
            policy.stats.host_kv_drops += 1
            tc._evict_host_leaf(x, tracker, device_frees, host_frees, cache_actions=cache_actions)
            if x.parent is not None and x.parent in walk.leaves:
                walk.push(x.parent)  # exposed by this drop
        self.cache.maybe_check_invariants("host KV eviction")


class _KVWalk:
    """The KV walk's order over SGLang's evictable device (or, for the host drop, host) leaves,
    built lazily. Key of a leaf ``n``: ``(rank, base(n), n.id)`` (smallest first), ``rank`` being
    ``(0, 0.0)`` for a leaf without a state, ``(0, 1.0)`` for a speculative state, ``(1, k)`` for a state
    the policy scores with key ``k`` (the round frozen at the walk's start), ``(2, 0.0)`` for a state it
    does not score; ``base`` is SGLang's priority (LRU by default). This is exactly the order of SGLang's
    own walk (a heap of every leaf) with that key, but only the leaves without a state and the speculative
    ones are keyed up front (one pass over the leaves); scored states enter from the policy's lazily
    sorted stream as the walk reaches their key, and unscored ones only once that stream is exhausted.
    Parents exposed by an eviction are pushed with their own key. Cost at the start: set operations on the
    leaf ids (:class:`_LeafSet`) and the mirror's state ids, a key for each leaf without a state, and the
    policy round's vectorised scoring; each pop is O(log n)."""

    DEAD = (0, 0.0)
    SPEC = (0, 1.0)
    UNSCORED = (2, 0.0)

    def __init__(self, leaves: _LeafSet, policy: TreePolicy, base: Callable[[Any], Any]) -> None:
        self.leaves = leaves
        self.base = base
        self.spec = policy.speculative_ids()
        self.mamba = ComponentType.MAMBA
        by_id = leaves.by_id
        states = policy.mirror.state_ids  # what SGLang holds (the invariant checks assert it)
        heap = [((self.DEAD, base(by_id[h]), h), by_id[h]) for h in by_id.keys() - states]
        stateful = by_id.keys() & states
        heap += [((self.SPEC, base(by_id[h]), h), by_id[h]) for h in stateful.intersection(self.spec)]
        heapq.heapify(heap)
        self.heap = heap
        self.stateful = stateful
        self.by_id = by_id
        # the stream skips, vectorised, the states of inner nodes (a KV walk evicts leaves only)
        only = np.fromiter(stateful, dtype=np.int64, count=len(stateful))
        self.stream, self.key_of = policy.scored_states(only=only)
        self.streamed: set[int] = set()  # handles the stream produced (scored)
        self.peek: tuple[float, int] | None = next(self.stream, None)
        self.unscored_added = False

    def rank(self, n: Any) -> tuple:
        if not _holds_state(n.component_data[self.mamba]):
            return self.DEAD  # no state in either tier (a host-only state is the policy's to rank)
        if n.id in self.spec:
            return self.SPEC
        k = self.key_of(n.id)
        return self.UNSCORED if k is None else (1, k)

    def push(self, n: Any) -> None:
        heapq.heappush(self.heap, ((self.rank(n), self.base(n), n.id), n))

    def _pull_group(self) -> None:
        """Push every stream entry with the next key (ties adjacent) whose handle is a stateful leaf."""
        k = self.peek[0]
        rank = (1, k)
        while self.peek is not None and self.peek[0] == k:
            h = self.peek[1]
            self.streamed.add(h)
            n = self.by_id.get(h) if h in self.stateful else None
            if n is not None and h not in self.spec:
                heapq.heappush(self.heap, ((rank, self.base(n), h), n))
            self.peek = next(self.stream, None)

    def pop(self) -> Any | None:
        heap = self.heap
        while True:
            while self.peek is not None and (not heap or (1, self.peek[0]) <= heap[0][0][0]):
                self._pull_group()
            if self.peek is None and not self.unscored_added:
                self.unscored_added = True
                for h in self.stateful - self.streamed:
                    n = self.by_id.get(h)
                    if n is not None and h not in self.spec:
                        heap.append(((self.UNSCORED, self.base(n), h), n))
                heapq.heapify(heap)
            if not heap:
                return None
            _, x = heapq.heappop(heap)
            if x in self.leaves:
                return x


def key_length(req) -> int:
    """Tokens of a finished request's cache key: its prompt and output but the last token (whose
    KV and state were never computed)."""
    return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)


class SparseRadixCache(UnifiedRadixCache):
    """``UnifiedRadixCache`` + the policy (capture plan, admission, eviction order, stats)."""

    is_sparse = True
    #: ``cut`` here; :class:`~.capture.CaptureRadixCache` captures in the forward
    capture_mode = "cut"
    #: why the factory chose the mode (``config.resolve_capture``)
    capture_reason = "SGLANG_SPARSE_CAPTURE=cut"

    def __init__(self, params, *, policy: TreePolicy, kv_bytes_per_token: int, state_bytes: int):
        self.policy = policy
        self._pending_match: dict[str, tuple[int, int, int | None]] = {}
        #: extra_buffer: rid -> depth (tokens) of the exact finish track of a request whose plan expects
        #: a continuation (set at planning, dropped at release; :func:`~.capture.refine_decode_tracks`)
        self.finish_tracks: dict[str, int] = {}
        self._kv_bytes = int(kv_bytes_per_token)
        self._state_bytes = int(state_bytes)
        #: ``SGLANG_SPARSE_CHECK_INVARIANTS``: check the mirror after every checkpoint and eviction
        self._check = bool(policy.config.check_invariants)
        self.invariant_violations = 0
        self.last_invariant_error = ""
        super().__init__(params)
        if not isinstance(self.tree_core, SparseTreeCore):
            raise RuntimeError(
                f"the sparse backend needs the {TREE_CORE_NAME!r} tree core, "
                f"got {type(self.tree_core).__name__}"
            )
        # The core's reset() ran inside super().__init__ before it knew the policy: attach now.
        self.tree_core.policy = policy
        policy.reset(self.tree_core.root_node.id)
        self._mamba_pool_size = self.req_to_token_pool.mamba_allocator.available_size()
        self._kv_pool_size = self.token_to_kv_pool_allocator.available_size()

    def reset(self) -> None:
        super().reset()  # the tree core's reset() resets the policy's mirror
        if getattr(self, "_pending_match", None) is not None:
            self._pending_match.clear()
        if getattr(self, "finish_tracks", None) is not None:
            self.finish_tracks.clear()

    # ---------------------------------------------------------------- capture

    #: extra_buffer: ``ScheduleBatch.prepare_for_decode`` keeps decode tracks only for the requests
    #: whose plan wants them (set by the backend factory; see :func:`~.capture.refine_decode_tracks`)
    decode_tracking = False

    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
        """SGLang's checkpoint, its insert walk resumed at the request's locked node (the path of
        its first ``cache_protected_len`` tokens; :meth:`SparseTreeCore.begin_insert`) rather than
        re-matched from the root: a request checkpoints several times (chunk ends, planned
        captures), each time below what it already holds."""
        node = getattr(req, "last_node", None)
        depth = int(req.kv.cache_protected_len or 0)
        tc = self.tree_core
        tc.insert_hint = (node, depth) if node is not None and depth > 0 else None
        try:
            super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        finally:
            tc.insert_hint = None

    def match_prefix(self, params):
        r = super().match_prefix(params)
        if self.enable_mamba_extra_buffer and r.mamba_branching_seqlen is not None:
            # SGLang would snapshot the KV match's grid floor in the next extend instead of the
            # extend's last grid point; the policy plans branch points itself (and captures them).
            r = r._replace(mamba_branching_seqlen=None)
        req = params.req
        if req is not None and params.cow_mamba:
            # SGLang's own view: the state-aligned prefix, the KV hit and the node it ends on.
            # HiCache: the prefix continues on the host (``host_hit_length`` tokens, loaded back
            # before the forward), as SGLang's Mamba boundary counts it.
            self._pending_match[req.rid] = (
                int(r.device_prefix_len) + int(r.host_hit_length or 0),
                int(r.full_kv_hit_length),
                r.last_visited_node_id,
            )
            if len(self._pending_match) > _MAX_PENDING_MATCHES:
                self._pending_match.pop(next(iter(self._pending_match)))
        return r

    def end_sequence_at_lock(self, req) -> None:
        """A finished request inserted nothing at its finish (its last state was already in the
        tree, or none was kept): its sequence ended, as far as the tree's KV goes, at the deepest
        node it inserted (its lock's), the rest of its key recorded as that leaf's tail. Not while a
        deeper capture of it is still to be published (that one marks the end). Never raises."""
        if getattr(self, "_capture_pending", {}).get(req.rid):
            return
        node_id = getattr(getattr(req, "lock", None), "node", None)
        if node_id is None or self.tree_core._node_arena.get(node_id) is None:  # noqa: SLF001
            return
        end = self.policy.node_end(node_id)
        if end is None or end <= 0 or end != int(req.kv.cache_protected_len):
            return
        self.policy.on_insert(node_id, finished=True, seq_len=key_length(req))

    def plan_request(self, req) -> None:
        """Plan ``req``'s captures (once per request; first admission attempt)."""
        if self.policy.has_plan(req.rid):
            return
        prefix, kv, node_id = self._pending_match.pop(req.rid, (int(req.prefix_len), 0, None))
        if node_id is not None and self.tree_core._node_arena.get(node_id) is None:  # noqa: SLF001
            node_id, kv = None, 0  # evicted since the match: plan as a miss
        max_new = int(getattr(req.sampling_params, "max_new_tokens", 0) or 0)
        n = len(req.origin_input_ids)
        named = request_checkpoints(getattr(req.sampling_params, "custom_params", None), n)
        if named and self.enable_mamba_extra_buffer:
            # States exist only on SGLang's grid unless they are captured in the forward (any page).
            g = int(self.page_size) if getattr(self, "capture_forward", False) else self.policy.config.grid
            named = tuple(sorted({p // g * g for p in named if p >= g}))
        self.policy.plan(
            req.rid,
            n,
            max_new,
            kv_node_id=node_id,
            engine_kv=kv,
            engine_prefix=prefix,
            named=named,
        )
        if self.decode_tracking and self.policy.wants_exact_finish(req.rid):
            depth = final_track_depth(n, max_new, int(self.page_size))
            if depth is not None:
                self.finish_tracks[req.rid] = depth

    def next_cut(self, req, prefix_len: int) -> int | None:
        return self.policy.next_cut(req.rid, prefix_len)

    def wants_decode_state(self, rid: str) -> bool:
        """Does ``rid``'s plan want a state past its prompt (extra_buffer decode tracking)?"""
        return self.policy.wants_final_state(rid)

    # ---------------------------------------------------------------- release / stats

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._pending_match.pop(req.rid, None)
        self.finish_tracks.pop(req.rid, None)
        self.policy.finish(req.rid, req.origin_input_ids, req.output_ids, self.export_tree)
        n = self.policy.config.log_every
        if n and self.policy.stats.finished % n == 0:
            logger.info("sparse cache: %s", self.format_stats())

    def export_tree(self) -> Iterator[EngineNode]:
        """SGLang's tree as ``(node_id, parent_id, edge token ids, holds a state)``, parents first."""
        mamba = ComponentType.MAMBA
        for n in self.tree_core.iter_nodes():
            yield n.id, n.parent.id, n.key.raw_token_ids(), _holds_state(n.component_data[mamba])

    def check_policy_mirror(self) -> None:
        """Raise ``MirrorError`` unless the policy's mirror equals SGLang's tree (same nodes, parents,
        edge lengths, states) and every SGLang state is one the policy knows."""
        self.policy.check(self.export_tree())

    def maybe_check_invariants(self, where: str) -> None:
        """With ``SGLANG_SPARSE_CHECK_INVARIANTS`` set: check the mirror; count and log violations."""
        if not self._check:
            return
        try:
            self.check_policy_mirror()
        except Exception as e:  # noqa: BLE001 - counted, logged and reported in the statistics
            self.invariant_violations += 1
            self.last_invariant_error = f"after {where}: {e}"
            logger.error("sparse cache: invariant violated %s", self.last_invariant_error)

    def sparse_stats(self) -> dict[str, Any]:
        """Plain-JSON statistics (the ``sparse_cache`` entry of ``/server_info`` internal states)."""
        d = self.policy.snapshot()
        tc = self.tree_core
        states = len(tc.lru_lists[ComponentType.MAMBA].cache)
        kv_tokens = int(tc.full_evictable_size() + tc.full_protected_size())
        host_lru = getattr(tc, "host_lru_lists", None)
        host_only = len(host_lru[ComponentType.MAMBA].cache) if host_lru and tc.enable_hicache else 0
        d.update(
            states_held=states,
            #: HiCache: states held on the host only (demoted from the device, backed up)
            states_host_only=host_only,
            kv_tokens_held=kv_tokens,
            state_bytes=self._state_bytes,
            kv_bytes_per_token=self._kv_bytes,
            bytes_held=states * self._state_bytes + kv_tokens * self._kv_bytes,
            budget_bytes=self.policy.budget_bytes,
            mamba_pool_size=self._mamba_pool_size,
            mamba_available=int(self.req_to_token_pool.mamba_allocator.available_size()),
            mamba_evictable=int(self.mamba_evictable_size()),
            mamba_protected=int(self.mamba_protected_size()),
            kv_pool_size=self._kv_pool_size,
            kv_available=int(self.token_to_kv_pool_allocator.available_size()),
            kv_evictable=int(self.full_evictable_size()),
            kv_protected=int(self.full_protected_size()),
            #: checkpoint inserts that resumed at the request's node / fell back to SGLang's walk
            inserts_hinted=tc.hinted_inserts,
            inserts_unhinted=tc.unhinted_inserts,
            invariant_checks=self._check,
            invariant_violations=self.invariant_violations,
            last_invariant_error=self.last_invariant_error,
            capture_mode=self.capture_mode,
            capture_reason=self.capture_reason,
        )
        return d

    def format_stats(self) -> str:
        d = self.sparse_stats()
        return (
            f"policy={d['policy']} alpha={d['alpha']:g} finished={d['finished']} "
            f"hits={d['hit_requests']}/{d['requests']} "
            f"resume/kv/input tokens={d['resume_tokens']}/{d['kv_hit_tokens']}/{d['input_tokens']} "
            f"cuts={d['cuts_applied']} ckpt kept/probation/spare/rejected/final={d['ckpt_admitted']}/"
            f"{d['ckpt_probation']}/{d['ckpt_spare']}/{d['ckpt_rejected']}/{d['ckpt_final']} "
            f"probation hits={d['probation_hits']} states held={d['states_held']}/{d['mamba_pool_size']} "
            f"kv held={d['kv_tokens_held']} bytes={d['bytes_held']} "
            f"evicted states={d['states_evicted']} kv leaves={d['kv_leaves_evicted']} "
            f"tail prior hit rate={d['tail_hit_rate']:.2f}"
            + (f" MIRROR ERRORS={d['mirror_errors']}" if d["mirror_errors"] else "")
        )


@functools.cache
def sparse_prefill_adder_class() -> type:
    """The ``PrefillAdder`` subclass that cuts prefill chunks at planned capture positions (with
    no_buffer SGLang checkpoints the exact recurrent state at every chunk end)."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    class SparsePrefillAdder(PrefillAdder):
        """Cuts chunks at the policy's positions; closes the batch after a voluntary cut so at most
        one chunked request exists (scheduler invariant)."""

        _sparse_closed = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cache = self._sparse()
            if cache is not None and getattr(cache, "capture_forward", False):
                # A chunk truncated at the batch's token budget ends on the policy's grid (SGLang
                # rounds it down with this grid under DCP only), so the next extend starts on the
                # grid and its captures there need no tail.
                self.mamba_chunk_grid = math.lcm(max(int(self.mamba_chunk_grid), 1), cache.policy.config.grid)

        def _sparse(self) -> SparseRadixCache | None:
            c = self.tree_cache
            return c if getattr(c, "is_sparse", False) and self.dllm_config is None else None

        def _select_prefill_admission(self, req, **kw):
            adm = super()._select_prefill_admission(req, **kw)
            cache = self._sparse()
            if cache is None or isinstance(adm, AddReqResult):
                return adm
            cache.plan_request(req)
            cut = cache.next_cut(req, adm.prefix_len)
            if cut is not None and adm.prefix_len < cut < adm.prefix_len + adm.extend_len:
                adm = dataclasses.replace(
                    adm, extend_len=cut - adm.prefix_len, is_chunked=True, max_new_tokens=0
                )
            return adm

        def _commit_prefill_admission(self, req, admission, mamba_gap_reserve):
            super()._commit_prefill_admission(req, admission, mamba_gap_reserve)
            if admission.is_chunked:
                self._sparse_closed = True
                cache = self._sparse()
                if cache is not None and cache.next_cut(req, admission.prefix_len) == req.extend_end:
                    cache.policy.stats.cuts_applied += 1

        def add_chunked_req(self, req):
            cache = self._sparse()
            cut = None
            if cache is not None:
                cut = cache.next_cut(req, req.prefix_len)
                if cut is not None and cut < len(req.full_untruncated_fill_ids):
                    lim = cut - req.prefix_len
                    self.chunked_req_limit = (
                        lim if self.chunked_req_limit is None else min(self.chunked_req_limit, lim)
                    )
                else:
                    cut = None
            out = super().add_chunked_req(req)
            if out is not None:
                self._sparse_closed = True
            if cut is not None and req.extend_end == cut:
                cache.policy.stats.cuts_applied += 1
            return out

        def budget_state(self):
            if self._sparse_closed:
                return AddReqResult.OTHER
            return super().budget_state()

    return SparsePrefillAdder

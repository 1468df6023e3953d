"""SGLang 0.5.23 classes of the ``sparse`` backend (this module imports SGLang; load it lazily).

* :class:`SparseRadixCache` -- a ``UnifiedRadixCache`` (Python tree core) that owns a
  :class:`~sglang_sparse.sglang_adapter.shadow.PolicyShadow` and mirrors its tree events into it.
* :class:`SparseMambaComponent` -- ``MambaComponent`` with policy admission
  (``prepare_for_caching_req`` returns 0 for an unplanned mid-request checkpoint) and a policy
  eviction order (``_evict_device_*``), keeping SGLang's leaf-vs-tombstone semantics.
* :class:`SparseFullComponent` -- ``FullComponent`` whose KV-leaf eviction walk follows the
  policy: a leaf holding a state by that state's policy score, a leaf without one first.
* :func:`sparse_prefill_adder_class` -- ``PrefillAdder`` subclass that ends prefill chunks at the
  planned capture positions; with ``--mamba-radix-cache-strategy no_buffer`` SGLang checkpoints
  the exact recurrent state at every chunk end.

See ``docs/sparse_backend.md`` for the design, its limits and the SGLang call sites.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from sglang.srt.mem_cache.unified_cache.components import ComponentType, EvictLayer
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from .shadow import PolicyShadow

logger = logging.getLogger("sglang_sparse")

_MAX_PENDING_MATCHES = 65536


def _key_tokens(key: Any) -> list[int]:
    """Token ids of a (non-bigram) ``RadixKey``."""
    ids = key.token_ids
    n = len(key)
    return list(ids[:n]) if len(ids) != n else list(ids)


def _node_id(x: Any) -> Any:
    return getattr(x, "id", x)


class SparseMambaComponent(MambaComponent):
    """Mamba component whose admission and eviction order come from the policy shadow."""

    # ---------------------------------------------------------------- keep (admission)

    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        shadow: PolicyShadow = self.cache.shadow
        if not shadow.admit(req.rid, token_ids_len, finished=is_finished):
            # Skip the whole insert before a slot is allocated; the KV stays request-owned and
            # is published by the next admitted checkpoint (or the final one).
            return 0
        return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)

    def cleanup_after_caching_req(self, req, is_finished, insert_result=None, insert_params=None):
        published = (
            insert_result is not None
            and insert_params is not None
            and insert_params.mamba_value is not None
            and insert_params.key is not None
            and insert_result.last_device_node is not None
        )
        super().cleanup_after_caching_req(
            req, is_finished=is_finished, insert_result=insert_result, insert_params=insert_params
        )
        if published:
            node_id = _node_id(insert_result.last_device_node)
            node = self.tree_core.node_by_id(node_id)
            if node is not None and node.component_data[self.component_type].value is not None:
                self.cache.shadow.on_state_inserted(_key_tokens(insert_params.key), node_id)

    # ---------------------------------------------------------------- mirror state frees

    def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
        had = EvictLayer.DEVICE in target and node.component_data[self.component_type].value is not None
        out = super().evict_component(node, device_frees, host_frees, cache_actions, target=target)
        if had:
            self.cache.shadow.on_state_evicted(node.id)
        return out

    # ---------------------------------------------------------------- evict (order)

    def _policy_walk(self) -> bool:
        return not self.tree_core.enable_session_radix_cache and not self.tree_core.enable_hicache

    def _evict_device_start(self, request_cnt: int) -> None:
        if not self._policy_walk():
            return super()._evict_device_start(request_cnt)
        self._evict_device_request_cnt = request_cnt
        lru = self.tree_core.lru_lists[self.component_type]
        nodes = []
        x = lru.get_lru_no_lock()
        while x is not None:  # least recent first, unlocked only
            nodes.append(x)
            x = lru.get_prev_no_lock(x)
        by_id = {n.id: n for n in nodes}
        order = self.cache.shadow.eviction_order([n.id for n in nodes])
        self._sparse_order = iter([by_id[i] for i in order])
        self._evict_device_cursor = None

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        if not self._policy_walk():
            return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
        ct = self.component_type
        lru = self.tree_core.lru_lists[ct]
        if tracker[ct] >= self._evict_device_request_cnt:
            return None
        for x in self._sparse_order:
            cd = x.component_data[ct]
            if not lru.in_list(x) or cd.value is None or cd.lock_ref > 0:
                continue  # freed or locked since the walk started
            if x in self.tree_core.evictable_device_leaves:
                return x.id  # the cache evicts the whole leaf (KV + state)
            self.tree_core._evict_component_and_detach_lru(
                x,
                self,
                target=EvictLayer.DEVICE,
                tracker=tracker,
                device_frees=device_frees,
                host_frees=host_frees,
                cache_actions=cache_actions,
            )
            self.tree_core._cascade_evict(
                x,
                self,
                tracker,
                device_frees=device_frees,
                host_frees=host_frees,
                cache_actions=cache_actions,
            )
            return None  # one mutation per step
        return None

    def _evict_device_end(self) -> None:
        if not self._policy_walk():
            return super()._evict_device_end()
        self._sparse_order = iter(())
        self._evict_device_cursor = None


class SparseFullComponent(FullComponent):
    """KV component whose device-eviction walk (KV pool short) takes leaves in the policy's order.

    Key of a leaf: the policy score of the recurrent state it holds (the shadow scores every state
    handle, i.e. SGLang node id, exactly as the simulator's :class:`Evictor` would); a leaf without
    a state comes first (no request can resume inside it, its KV is dead weight); ties and states
    the policy does not score keep SGLang's priority (LRU by default) after the scored ones.
    Parents exposed during the walk are keyed the same way. With sessions or HiCache enabled the
    walk is SGLang's own."""

    def _policy_walk(self) -> bool:
        return not self.tree_core.enable_session_radix_cache and not self.tree_core.enable_hicache

    def _evict_device_start(self, request_cnt: int) -> None:
        if not self._policy_walk():
            return super()._evict_device_start(request_cnt)
        self._ensure_eviction_strategy()
        base = self.tree_core.eviction_strategy.get_priority
        scores = self.cache.shadow.state_scores()
        self.cache.shadow.stats.kv_eviction_walks += 1
        mamba = ComponentType.MAMBA

        def key(n):
            if n.component_data[mamba].value is None:
                rank = (0, 0.0)  # dead KV: nothing can resume inside it
            else:
                sc = scores.get(n.id)
                rank = (1, sc) if sc is not None else (2, 0.0)
            return rank, base(n), n.id

        self.session_ref_eviction_strategy = key
        super()._evict_device_start(request_cnt)

    def _evict_device_end(self) -> None:
        super()._evict_device_end()
        if self._policy_walk():
            self.session_ref_eviction_strategy = None  # _ensure_eviction_strategy restores SGLang's


class SparseRadixCache(UnifiedRadixCache):
    """``UnifiedRadixCache`` + policy shadow (capture plan, admission, eviction order, stats)."""

    is_sparse = True

    def __init__(self, params, *, shadow: PolicyShadow, kv_bytes_per_token: int, state_bytes: int):
        # reset() runs inside super().__init__, so the shadow must exist first.
        self.shadow = shadow
        self._pending_match: dict[str, tuple[int, int]] = {}
        self._kv_bytes = int(kv_bytes_per_token)
        self._state_bytes = int(state_bytes)
        super().__init__(params)
        self._mamba_pool_size = self.req_to_token_pool.mamba_allocator.available_size()
        self._kv_pool_size = self.token_to_kv_pool_allocator.available_size()

    def reset(self) -> None:
        super().reset()
        if getattr(self, "shadow", None) is not None:
            self.shadow.reset()
            self._pending_match.clear()

    # ---------------------------------------------------------------- capture

    def match_prefix(self, params):
        r = super().match_prefix(params)
        req = params.req
        if req is not None and params.cow_mamba:
            # Remember SGLang's own view (state-aligned prefix, KV hit) for the stats.
            self._pending_match[req.rid] = (int(r.device_prefix_len), int(r.full_kv_hit_length))
            if len(self._pending_match) > _MAX_PENDING_MATCHES:
                self._pending_match.pop(next(iter(self._pending_match)))
        return r

    def plan_request(self, req) -> None:
        """Plan ``req``'s captures (once per request; first admission attempt)."""
        if self.shadow.has_plan(req.rid):
            return
        prefix, kv = self._pending_match.pop(req.rid, (int(req.prefix_len), int(req.prefix_len)))
        max_new = int(getattr(req.sampling_params, "max_new_tokens", 0) or 0)
        self.shadow.plan(req.rid, req.origin_input_ids, max_new, engine_prefix=prefix, engine_kv=kv)

    def next_cut(self, req, prefix_len: int) -> int | None:
        return self.shadow.next_cut(req.rid, prefix_len)

    # ---------------------------------------------------------------- mirror KV leaf frees

    def _evict_device_leaf(self, node_id, tracker):
        node = self.tree_core.node_by_id(node_id)
        first = _key_tokens(node.key)[0]
        prefix: list[int] = []
        p = node.parent
        chain = []
        while p is not None and p.key is not None and p.parent is not None:
            chain.append(_key_tokens(p.key))
            p = p.parent
        for k in reversed(chain):
            prefix.extend(k)
        out = super()._evict_device_leaf(node_id, tracker)
        self.shadow.on_kv_leaf_evicted(prefix, first)
        return out

    # ---------------------------------------------------------------- release / stats

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._pending_match.pop(req.rid, None)
        self.shadow.finish(req.rid, req.origin_input_ids, req.output_ids)
        n = self.shadow.config.log_every
        if n and self.shadow.stats.finished % n == 0:
            logger.info("sparse cache: %s", self.format_stats())

    def sparse_stats(self) -> dict[str, Any]:
        """Plain-JSON statistics (the ``sparse_cache`` entry of ``/server_info`` internal states)."""
        d = self.shadow.snapshot()
        tc = self.tree_core
        states = len(tc.lru_lists[ComponentType.MAMBA].cache)
        kv_tokens = int(tc.full_evictable_size() + tc.full_protected_size())
        d.update(
            states_held=states,
            kv_tokens_held=kv_tokens,
            state_bytes=self._state_bytes,
            kv_bytes_per_token=self._kv_bytes,
            bytes_held=states * self._state_bytes + kv_tokens * self._kv_bytes,
            budget_bytes=self.shadow.budget_bytes,
            mamba_pool_size=self._mamba_pool_size,
            mamba_available=int(self.req_to_token_pool.mamba_allocator.available_size()),
            mamba_evictable=int(self.mamba_evictable_size()),
            mamba_protected=int(self.mamba_protected_size()),
            kv_pool_size=self._kv_pool_size,
            kv_available=int(self.token_to_kv_pool_allocator.available_size()),
            kv_evictable=int(self.full_evictable_size()),
            kv_protected=int(self.full_protected_size()),
        )
        return d

    def format_stats(self) -> str:
        d = self.sparse_stats()
        return (
            f"policy={d['policy']} alpha={d['alpha']:g} finished={d['finished']} "
            f"hits={d['hit_requests']}/{d['requests']} "
            f"resume/kv/input tokens={d['resume_tokens']}/{d['kv_hit_tokens']}/{d['input_tokens']} "
            f"cuts={d['cuts_applied']} ckpt kept/rejected/final={d['ckpt_admitted']}/{d['ckpt_rejected']}/"
            f"{d['ckpt_final']} states held={d['states_held']}/{d['mamba_pool_size']} "
            f"kv held={d['kv_tokens_held']} bytes={d['bytes_held']} "
            f"evicted states={d['states_evicted']} kv leaves={d['kv_leaves_evicted']}"
        )


@functools.cache
def sparse_prefill_adder_class() -> type:
    """The ``PrefillAdder`` subclass that cuts prefill chunks at planned capture positions."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    class SparsePrefillAdder(PrefillAdder):
        """Cuts chunks at the policy's positions; closes the batch after a voluntary cut so at most
        one chunked request exists (scheduler invariant)."""

        _sparse_closed = False

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
                    cache.shadow.stats.cuts_applied += 1

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
                cache.shadow.stats.cuts_applied += 1
            return out

        def budget_state(self):
            if self._sparse_closed:
                return AddReqResult.OTHER
            return super().budget_state()

    return SparsePrefillAdder

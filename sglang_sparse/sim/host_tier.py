"""Two-tier replay: a device cache with a host tier below it (SGLang's HiCache), as one logical cache.

The policy's :class:`HybridCache` holds the logical cache (``HostTierConfig.logical_bytes``: device
+ host under write-back, the larger of the two under write-through; see
:mod:`sglang_sparse.policy.host_tier`): its admission and its eviction order decide what either
tier keeps. Which tier an item is on follows SGLang's mechanics: the device holds the most recently
used items that fit in its bytes (device eviction is LRU and demotes; a hit loads the path up, which
makes it the most recent), the rest is on the host. Per request, in tokens / bytes / FLOPs:

* ``resume_depth``: the logical cache's deepest state on the prompt, but no deeper than a prefix
  whose KV and state fit in the device (the forward runs there).
* **load**: the KV of the matched path down to ``resume_depth`` and the state there that are not
  device-resident when the request arrives (bytes), i.e. whose last use is older than the device's
  most recent ``device_bytes`` of items. The result's ``load_bytes`` sums them and ``load_flops``
  converts them into prefill FLOPs of device time (``HostTierConfig.load_flops``), so
  ``net_flops_saved_frac`` charges every policy for its host traffic. Loads are charged, never
  refused (SGLang loads whatever host prefix matches); without a host tier ``load_bytes == 0``.
"""

from __future__ import annotations

import numpy as np

from sglang_sparse.policy import HybridCache
from sglang_sparse.policy.host_tier import HostTierConfig
from sglang_sparse.tree import MatchResult, Node


class TwoTierCache:
    """Residency and loads of ``cache`` (the logical cache) over a device of ``device_bytes``."""

    def __init__(self, cache: HybridCache, device_bytes: int, config: HostTierConfig) -> None:
        if device_bytes < cache.tree.state_bytes:
            raise ValueError(f"device_bytes={device_bytes} is smaller than one recurrent state")
        self.cache = cache
        self.device_bytes = int(device_bytes)
        self.config = config
        kvb = cache.tree.kv_bytes_per_token
        #: the deepest prefix whose KV and state fit in the device (tokens)
        self.device_tokens = (self.device_bytes - cache.tree.state_bytes) // kvb if kvb else None

    def resume(self, match: MatchResult, tokens: np.ndarray) -> tuple[MatchResult, int]:
        """The match a request resumes from (``match``, or a shallower one when ``match``'s state lies
        beyond what fits in the device) and the bytes it loads from the host. Call before the
        request's :meth:`HybridCache.observe` (residency is as of its arrival)."""
        cap = self.device_tokens
        if cap is not None and match.resume_depth > cap:
            match = self.cache.match(tokens[:cap])
        c = match.resume_depth
        if c == 0:
            return match, 0
        return match, self._load_bytes(match, c)

    def _load_bytes(self, match: MatchResult, depth: int) -> int:
        """Bytes of ``match``'s path down to ``depth`` (KV) and of its state at ``depth`` that are on
        the host: last used no later than the tick at which the device's most recent items fill it."""
        tree = self.cache.tree
        kvb, sb = tree.kv_bytes_per_token, tree.state_bytes
        cut = self._device_cut()
        load = 0
        for node in match.path:
            if node.start >= depth:
                break
            if node.last_access <= cut:
                load += (min(node.end, depth) - node.start) * kvb
        holder = match.ckpt_node
        if holder is not None and self._state_tick(holder, depth) <= cut:
            load += sb
        return load

    def _state_tick(self, node: Node, pos: int) -> int:
        """The tick that orders the state at ``pos`` for device residency: its last use, or -1 for a
        state on probation (a first-sight guess no request has resumed from: the policy's device
        evicts, hence demotes, those first)."""
        if node.checkpoints[pos] in self.cache.probation:
            return -1
        return node.ckpt_access[pos]

    def _device_cut(self) -> float:
        """The access tick at or below which an item is on the host: the device holds the items used
        after it (most recent first, KV per node and each state, until ``device_bytes`` is full).
        Items last used at the cut tick itself count as host-resident (a conservative tie)."""
        tree = self.cache.tree
        kvb, sb = tree.kv_bytes_per_token, tree.state_bytes
        ticks: list[int] = []
        sizes: list[int] = []
        for node in tree.nodes():
            if node.parent is None:
                continue
            ticks.append(node.last_access)
            sizes.append(node.num_tokens * kvb)
            for p in node.ckpt_access:
                ticks.append(self._state_tick(node, p))
                sizes.append(sb)
        if not ticks:
            return float("-inf")
        order = np.argsort(-np.asarray(ticks, dtype=np.int64), kind="stable")
        filled = np.cumsum(np.asarray(sizes, dtype=np.int64)[order])
        over = int(np.searchsorted(filled, self.device_bytes, side="right"))
        if over >= len(order):
            return float("-inf")  # everything fits on the device
        return float(ticks[int(order[over])])

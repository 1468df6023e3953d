"""Headroom: an offline upper bound on what any cache of a given size can save on a trace.

No policy, however much it knows of the future, can resume request ``i`` deeper than

* ``lcp_i``: the longest common prefix of its input with an earlier request's input + output (what
  an unbounded cache with a state at every position reuses), and
* ``cap = (cache_bytes - state_bytes) // kv_bytes_per_token``: the deepest resume point whose
  prefix KV plus one state fit in the cache at all (a resume at depth ``d`` needs the KV of all
  ``d`` tokens and a state while the request is matched).

So ``hit_i <= min(lcp_i, cap, len(input_i))`` and, as the prefill FLOPs saved grow with the
resume depth, ``saved_i <= flops_saved(len_i, that)``. Summed over the trace this is a sound
(loose when many prefixes compete for the cache) bound per trace and cache size: tables report
each policy's share of it. It assumes the simulator's hard byte budget; a policy allowed to exceed
the budget (a soft cap) can exceed it.

Exact future-knowledge eviction + placement (a knapsack over intervals of a growing tree) is not
attempted: this bound is what is computed, and documented as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_sparse.policy import ModelCostModel
from sglang_sparse.tree import RadixTree, as_tokens

from .trace import SimRequest


@dataclass(frozen=True)
class HeadroomBound:
    """Upper bounds for one trace and cache size (tokens, FLOPs)."""

    cache_bytes: int
    input_tokens: int
    hit_tokens: int
    flops_saved: float
    flops_total: float
    cap_tokens: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def flops_saved_frac(self) -> float:
        return self.flops_saved / self.flops_total if self.flops_total else 0.0


def reuse_depths(requests: Sequence[SimRequest]) -> list[int]:
    """``lcp_i`` for every request (tokens): the longest prefix of its input that an earlier
    request's input + output also starts with."""
    tree = RadixTree(1, 1)
    out: list[int] = []
    for r in requests:
        inp = as_tokens(r.input_tokens)
        out.append(min(int(tree.match(inp).kv_depth), len(inp)))
        tree.insert(as_tokens(list(r.input_tokens) + list(r.output_tokens)))
    return out


def headroom_bound(
    requests: Sequence[SimRequest],
    cache_bytes: int,
    cost: ModelCostModel,
    depths: Sequence[int] | None = None,
) -> HeadroomBound:
    """The bound of the module docstring for ``cache_bytes`` bytes (pass ``depths`` from
    :func:`reuse_depths` to reuse them across sizes)."""
    if cache_bytes < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
    depths = reuse_depths(requests) if depths is None else depths
    if len(depths) != len(requests):
        raise ValueError(f"{len(depths)} reuse depths for {len(requests)} requests")
    free = cache_bytes - cost.state_bytes
    cap = max(0, free // cost.kv_bytes_per_token) if free >= 0 else 0
    hit = n_in = 0
    saved = total = 0.0
    for r, d in zip(requests, depths, strict=True):
        n = len(r.input_tokens)
        h = min(int(d), cap, n)
        n_in += n
        hit += h
        saved += cost.flops_saved(n, h)
        total += cost.prefill_flops(n)
    return HeadroomBound(int(cache_bytes), n_in, hit, saved, total, int(cap))

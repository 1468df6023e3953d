"""Headroom: an offline upper bound on what any cache of a given size can save on a trace.

Units: tokens and bytes; FLOPs from :class:`~sglang_sparse.policy.ModelCostModel`. Requests are
served one after another (the simulator's model); *boundary* ``t`` is the moment between request
``t`` and request ``t + 1``.

Two facts hold for every policy that keeps its cache within ``cache_bytes`` (a hard budget):

1. **Capacity.** A hit needs a recurrent state besides the KV, so at every boundary where some
   later hit is still pending the cache holds at most
   ``cap = (cache_bytes - state_bytes) // kv_bytes_per_token`` tokens of KV (counted once per
   radix-tree token, however many requests share it).
2. **Retention.** Tokens enter the cache only while a request computes (or reuses) them. If request
   ``j`` resumes through a token span whose most recent earlier *visitor* (a request whose input +
   output contains it) is request ``k``, that span was in the cache at every boundary
   ``k, ..., j - 1``: once evicted it cannot come back before another visitor.

Cut every request's input at the depths where its most recent earlier visitor changes: each piece
is a *reuse interval* ``(k, j, tokens)`` (built in one pass over a radix tree whose nodes carry the
clock of their last visitor: :func:`reuse_profile`). A policy's hit tokens are at most the tokens it
keeps of these intervals, and the kept amounts obey ``sum over intervals spanning boundary t <= cap``
at every ``t``. Maximising that total is interval packing with one capacity on a line: the greedy
that takes intervals by right end (``j``) and keeps as much of each as the remaining capacity over
its span allows is optimal (interval graphs are perfect, so a load <= ``cap`` everywhere is exactly
``cap``-colourability, and for that the earliest-end greedy is optimal; Yannakakis & Gavril 1987,
Carlisle & Lloyd 1995). ``tests/test_sim_bound.py`` checks it against a min-cost-flow solution.
Relaxed away (hence an upper bound, not an achievable schedule): hits need not be prefixes, states
cost nothing beyond one, and nothing is charged for the running request.

FLOPs: the FLOPs saved by a hit of ``h`` tokens, ``F(h)``, are convex in ``h`` with ``F(0) = 0``,
and request ``i`` can hit at most ``m_i = min(lcp_i, cap, len_i)`` tokens. So the FLOPs any policy
saves are at most the fractional knapsack over items ``(m_i, F(m_i))`` with the hit-token bound as
capacity (fill by ``F(m_i) / m_i``, best first).

Both figures are also capped by the looser per-request bound (``hit_i <= min(lcp_i, cap, len_i)``
summed; ``per_request_*``), which the packing bound never exceeds. A policy allowed to exceed the
budget (a soft cap) can exceed the bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_sparse.policy import ModelCostModel
from sglang_sparse.tree import RadixTree

from .common import HitRates, prepare_requests
from .trace import SimRequest


@dataclass(frozen=True)
class HeadroomBound(HitRates):
    """Upper bounds for one trace and cache size (tokens, FLOPs). ``hit_tokens`` / ``flops_saved``: the
    packing bound (the one tables report); ``per_request_hit_tokens`` / ``per_request_flops_saved``: the
    looser per-request bound."""

    cache_bytes: int
    input_tokens: int
    hit_tokens: int
    flops_saved: float
    flops_total: float
    cap_tokens: int
    per_request_hit_tokens: int = 0
    per_request_flops_saved: float = 0.0

    @property
    def per_request_hit_rate(self) -> float:
        return self.per_request_hit_tokens / self.input_tokens if self.input_tokens else 0.0


@dataclass(frozen=True)
class ReuseProfile:
    """What the bound needs from a trace, independent of the cache size. ``depths[j]``: ``lcp_j``
    (tokens of request ``j``'s input that some earlier input + output starts with). ``intervals``:
    ``int64 [P, 3]`` rows ``(k, j, tokens)`` with ``k < j``: request ``j`` reuses ``tokens`` tokens
    whose most recent earlier visitor is ``k`` (per ``j`` they sum to ``depths[j]``).
    ``input_lens[j]``: tokens of request ``j``'s input."""

    depths: tuple[int, ...]
    intervals: np.ndarray
    input_lens: tuple[int, ...]


def reuse_profile(requests: Sequence[SimRequest]) -> ReuseProfile:
    """One pass over the trace with a radix tree of every earlier input + output. A node's
    ``last_access`` is the logical clock of the last insert through it (inserts stamp the whole
    path; a split keeps the stamp on both halves), so the matched path of request ``j`` read before
    ``j`` is inserted gives the most recent visitor of each of its reused spans."""
    tree = RadixTree(1, 1)
    visitor: dict[int, int] = {}  # tree clock of an insert -> request index
    depths: list[int] = []
    rows: list[tuple[int, int, int]] = []
    lens: list[int] = []
    for j, (inp, full) in enumerate(prepare_requests(requests)):
        n = len(inp)
        lens.append(n)
        m = tree.match(inp)
        d = min(int(m.kv_depth), n)
        depths.append(d)
        last_k, amount = -1, 0
        for node in m.path:
            lo, hi = node.start, min(node.start + len(node.key), d)
            if hi <= lo:
                break
            k = visitor[node.last_access]
            if k != last_k and amount:
                rows.append((last_k, j, amount))
                amount = 0
            last_k = k
            amount += hi - lo
        if amount:
            rows.append((last_k, j, amount))
        if len(full):
            tree.insert(full)
            visitor[tree.clock] = j
    iv = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return ReuseProfile(tuple(depths), iv, tuple(lens))


def reuse_depths(requests: Sequence[SimRequest]) -> list[int]:
    """``lcp_i`` for every request (tokens): the longest prefix of its input that an earlier
    request's input + output also starts with."""
    return list(reuse_profile(requests).depths)


def pack_intervals(intervals: np.ndarray, n_requests: int, cap: int) -> np.ndarray:
    """Greedy interval packing (module docstring): per row ``(k, j, tokens)`` of ``intervals`` the
    tokens kept, taken by ascending ``j`` (ties by descending ``k``: shorter first), each as much as
    ``min(tokens, remaining capacity at boundaries k..j-1)``. Returns ``int64 [P]`` (row order)."""
    kept = np.zeros(len(intervals), dtype=np.int64)
    if cap <= 0 or len(intervals) == 0:
        return kept
    free = np.full(max(n_requests - 1, 1), cap, dtype=np.int64)
    order = np.lexsort((-intervals[:, 0], intervals[:, 1]))
    for i in order.tolist():
        k, j, tokens = (int(x) for x in intervals[i])
        span = free[k:j]
        x = min(tokens, int(span.min()))
        if x > 0:
            span -= x
            kept[i] = x
    return kept


def fractional_knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int) -> float:
    """``max sum(f_i v_i)`` over ``0 <= f_i <= 1`` with ``sum(f_i s_i) <= capacity`` (best ``v/s``
    first; items of size 0 count fully)."""
    total, room = 0.0, max(int(capacity), 0)
    items = sorted(
        ((v / s if s else float("inf"), s, v) for s, v in zip(sizes, values, strict=True) if v > 0),
        reverse=True,
    )
    for _, s, v in items:
        if s <= room:
            total += v
            room -= s
        else:
            total += v * room / s
            break
    return total


def headroom_bound(
    requests: Sequence[SimRequest],
    cache_bytes: int,
    cost: ModelCostModel,
    profile: ReuseProfile | None = None,
) -> HeadroomBound:
    """The bound of the module docstring for ``cache_bytes`` bytes (pass ``profile`` from
    :func:`reuse_profile` to reuse it across sizes)."""
    if cache_bytes < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
    profile = reuse_profile(requests) if profile is None else profile
    if len(profile.depths) != len(requests):
        raise ValueError(f"a reuse profile of {len(profile.depths)} requests for {len(requests)}")
    free = cache_bytes - cost.state_bytes
    cap = max(0, free // cost.kv_bytes_per_token) if free >= 0 else 0
    caps = [min(int(d), cap, n) for d, n in zip(profile.depths, profile.input_lens, strict=True)]
    values = [cost.flops_saved(n, h) for n, h in zip(profile.input_lens, caps, strict=True)]
    n_in = sum(profile.input_lens)
    total = sum(cost.prefill_flops(n) for n in profile.input_lens)
    loose_hit, loose_saved = sum(caps), sum(values)
    packed = int(pack_intervals(profile.intervals, len(requests), int(cap)).sum())
    hit = min(packed, loose_hit)
    saved = min(fractional_knapsack(caps, values, hit), loose_saved)
    return HeadroomBound(int(cache_bytes), n_in, hit, saved, total, int(cap), loose_hit, loose_saved)

"""The headroom bound is an upper bound: no policy's hits or FLOPs saved exceed it, at any size;
with an unbounded cache it is the perfect-cache reuse, and a cache too small for one state plus
any KV gets nothing."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_sparse.sim import (
    cost_model,
    headroom_bound,
    reuse_depths,
    reuse_profile,
    simulate,
    synthetic_trace,
)
from sglang_sparse.sim.bound import pack_intervals
from sglang_sparse.sim.trace import SimRequest

CM = cost_model("qwen3-next-80b-a3b")
IN_BUDGET = ("lru", "block32", "marconi", "sglang_native", "sparse", "sparse_dp")
PUBLISHED = ("sglang_plus_published", "marconi_published", "vllm_plus_published")


@pytest.mark.parametrize("shape", ["doc_qa", "system_prompts", "agent"])
def test_no_policy_beats_the_bound(shape: str) -> None:
    """Every run that stays within its byte budget stays under the packing bound; only the
    published baselines (soft caps) may leave the budget."""
    reqs = synthetic_trace(shape, 60, seed=1)
    profile = reuse_profile(reqs)
    footprint = sum(len(r.input_tokens) + len(r.output_tokens) for r in reqs) * CM.kv_bytes_per_token
    for frac in (0.02, 0.1, 0.5):
        size = int(footprint * frac)
        b = headroom_bound(reqs, size, CM, profile)
        assert b.hit_tokens > 0
        assert b.hit_tokens <= b.per_request_hit_tokens
        for pol in (*IN_BUDGET, *PUBLISHED):
            r = simulate(reqs, pol, size, CM, keep_records=False)
            if r.max_bytes_used > size:  # soft caps may exceed the budget, and the bound with it
                assert pol in PUBLISHED, (pol, frac, r.max_bytes_used, size)
                continue
            assert r.hit_tokens <= b.hit_tokens, (pol, frac)
            assert r.flops_saved <= b.flops_saved * (1 + 1e-12), (pol, frac)


def test_bound_limits() -> None:
    a = tuple(range(100, 400))
    reqs = [
        SimRequest("s", 0, a, (1, 2)),
        SimRequest("s", 1, a + (1, 2, 9), ()),  # extends the first request's output
        SimRequest("t", 0, (7,) + a, ()),  # shares nothing at the start
    ]
    assert reuse_depths(reqs) == [0, 302, 0]
    huge = headroom_bound(reqs, 10**15, CM)
    assert huge.hit_tokens == 302 and huge.cap_tokens > 302
    tiny = headroom_bound(reqs, CM.state_bytes + 10 * CM.kv_bytes_per_token, CM)
    assert tiny.cap_tokens == 10 and tiny.hit_tokens == 10
    assert headroom_bound(reqs, CM.state_bytes - 1, CM).hit_tokens == 0
    with pytest.raises(ValueError):
        headroom_bound(reqs, -1, CM)


def _flow_optimum(intervals: np.ndarray, n_requests: int, cap: int) -> int:
    """Max tokens kept by a min-cost flow: a line of boundaries with capacity ``cap`` that every
    interval bypasses over its span (a unit on an interval earns one token)."""
    nx = pytest.importorskip("networkx")
    g = nx.DiGraph()
    b = max(n_requests - 1, 1)
    for t in range(b):
        g.add_edge(("v", t), ("v", t + 1), capacity=cap, weight=0)
    for i, (k, j, tokens) in enumerate(intervals.tolist()):
        g.add_edge(("v", k), ("m", i), capacity=tokens, weight=-1)
        g.add_edge(("m", i), ("v", j), capacity=tokens, weight=0)
    g.nodes[("v", 0)]["demand"] = -cap
    g.nodes[("v", b)]["demand"] = cap
    return -int(nx.min_cost_flow_cost(g))


@pytest.mark.parametrize("seed", range(12))
def test_greedy_packing_matches_min_cost_flow(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 25))
    rows = []
    for _ in range(int(rng.integers(1, 40))):
        k = int(rng.integers(0, n - 1))
        j = int(rng.integers(k + 1, n))
        rows.append((k, j, int(rng.integers(1, 60))))
    iv = np.array(rows, dtype=np.int64)
    cap = int(rng.integers(1, 120))
    kept = pack_intervals(iv, n, cap)
    assert (kept >= 0).all() and (kept <= iv[:, 2]).all()
    load = np.zeros(n - 1, dtype=np.int64)
    for (k, j, _), x in zip(iv.tolist(), kept.tolist(), strict=True):
        load[k:j] += x
    assert load.max() <= cap  # feasible
    assert int(kept.sum()) == _flow_optimum(iv, n, cap)  # and optimal


def test_alternating_documents_share_one_cache() -> None:
    """A, B, A, B with room for one document: the second visits of A and B both need their
    document kept across the boundary between requests 1 and 2, so only one of them can hit."""
    doc_a, doc_b = tuple(range(1000, 1100)), tuple(range(2000, 2100))
    reqs = [SimRequest(s, i, d + (i,), ()) for i, (s, d) in enumerate([("a", doc_a), ("b", doc_b)] * 2)]
    prof = reuse_profile(reqs)
    assert prof.depths == (0, 0, 100, 100)
    assert prof.intervals.tolist() == [[0, 2, 100], [1, 3, 100]]
    one_doc = headroom_bound(reqs, CM.state_bytes + 100 * CM.kv_bytes_per_token, CM, prof)
    assert one_doc.per_request_hit_tokens == 200 and one_doc.hit_tokens == 100
    two_docs = headroom_bound(reqs, CM.state_bytes + 200 * CM.kv_bytes_per_token, CM, prof)
    assert two_docs.hit_tokens == 200
    # FLOPs: one of the two equal hits, not both
    assert one_doc.flops_saved == pytest.approx(CM.flops_saved(101, 100))


def test_profile_splits_a_reuse_by_its_latest_visitor() -> None:
    """Request 2 reuses the system prompt last seen in request 1 and the document last seen in
    request 0: two intervals with different starts."""
    sys_p, doc = tuple(range(10, 60)), tuple(range(500, 580))
    reqs = [
        SimRequest("s0", 0, sys_p + doc, ()),
        SimRequest("s1", 0, sys_p + (7, 7, 7), ()),
        SimRequest("s2", 0, sys_p + doc + (9,), ()),
    ]
    prof = reuse_profile(reqs)
    assert prof.depths == (0, 50, 130)
    assert sorted(prof.intervals.tolist()) == [[0, 1, 50], [0, 2, 80], [1, 2, 50]]

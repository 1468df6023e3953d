"""The headroom bound is an upper bound: no policy's hits or FLOPs saved exceed it, at any size;
with an unbounded cache it is the perfect-cache reuse, and a cache too small for one state plus
any KV gets nothing."""

from __future__ import annotations

import pytest

from sglang_sparse.sim import cost_model, headroom_bound, reuse_depths, simulate, synthetic_trace
from sglang_sparse.sim.trace import SimRequest

CM = cost_model("qwen3-next-80b-a3b")


@pytest.mark.parametrize("shape", ["doc_qa", "agent"])
def test_no_policy_beats_the_bound(shape: str) -> None:
    reqs = synthetic_trace(shape, 60, seed=1)
    depths = reuse_depths(reqs)
    footprint = sum(len(r.input_tokens) + len(r.output_tokens) for r in reqs) * CM.kv_bytes_per_token
    for frac in (0.02, 0.1, 0.5):
        size = int(footprint * frac)
        b = headroom_bound(reqs, size, CM, depths)
        assert b.hit_tokens > 0
        for pol in ("lru", "sglang_native", "sparse"):
            r = simulate(reqs, pol, size, CM, keep_records=False, alpha=0.0 if pol == "sparse" else None)
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

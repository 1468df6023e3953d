"""Published Marconi-paper baselines (``*_published``): each one's distinguishing behaviour on tiny
hand-built traces, replay through ``simulate``, and ``sim_compare --trace`` on a temporary file."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from sglang_sparse.policy import PUBLISHED_NAMES, SIM_POLICY_NAMES, get_policy, get_published
from sglang_sparse.sim import SimRequest, cost_model, simulate, synthetic_trace
from sglang_sparse.sim.published_caches import (
    MARCONI_ALPHA_GRID,
    MarconiModel,
    PublishedBlockCache,
    PublishedHybridCache,
    _replay_flops_saved,
    make_published_cache,
)


@dataclass(frozen=True)
class Unit:
    """Toy accounting: ``state`` bytes per state, 1 byte per KV token, FLOPs = tokens."""

    state: int = 10

    def states_bytes(self, count: float) -> float:
        return count * self.state

    def kv_bytes(self, tokens: float) -> float:
        return tokens

    def node_flops_saved(self, total: int, parent: int) -> float:
        return total - parent

    def request_flops_saved(self, hit: int) -> float:
        return hit


def ids(*parts: list[int] | range) -> np.ndarray:
    return np.array([t for p in parts for t in p], dtype=np.int32)


def serve(c: PublishedHybridCache | PublishedBlockCache, inp: np.ndarray, out: list[int] = ()) -> int:
    return c.serve(inp, np.concatenate([inp, np.array(out, dtype=np.int32)])).hit


P, A, B = range(100, 110), range(200, 210), range(300, 310)


def three_requests(version: int) -> PublishedHybridCache:
    """P+A, P+B (split at |P|), P+A again; big capacity (no eviction yet)."""
    c = PublishedHybridCache(version, 10**9, Unit())
    assert serve(c, ids(P, A)) == 0
    assert serve(c, ids(P, B)) == 0  # creates the branch node at depth 10
    assert serve(c, ids(P, A)) == 20  # the whole input ends at a node: all of it reused
    c.check()
    return c


def test_registry_keeps_published_apart():
    assert set(PUBLISHED_NAMES) == {"sglang_plus_published", "marconi_published", "vllm_plus_published"}
    assert set(SIM_POLICY_NAMES) >= set(PUBLISHED_NAMES) | {"lru", "marconi", "block32"}
    with pytest.raises(ValueError, match="published baseline"):
        get_policy("marconi_published")  # never a HybridCache / SGLang adapter policy
    assert get_published("marconi_published").reference.startswith("radix_cache_hybrid.py")
    with pytest.raises(ValueError, match="valid: sglang_plus_published"):
        get_published("nope")
    with pytest.raises(ValueError, match="not FLOP-aware"):
        make_published_cache("sglang_plus_published", 100, Unit(), alpha=1.0)


def test_sglang_plus_evicts_leaves_only_marconi_evicts_single_child_states():
    v1, v2 = three_requests(1), three_requests(2)
    for c in (v1, v2):
        c.evict(1)  # least recent leaf: P+B's
        assert (c.num_nodes, c.kv_tokens) == (2, 20)
    v1.evict(1)  # SGLang+: only leaves -> the P+A leaf goes, the branch node stays
    assert (v1.num_nodes, v1.kv_tokens) == (1, 10)
    v2.evict(1)  # Marconi: the now single-child branch node is older than its leaf: its state goes
    assert (v2.num_nodes, v2.kv_tokens) == (1, 20)
    (only,) = v2.root.children.values()
    assert only.end == 20 and len(only.key) == 20  # merged into the child
    v1.check()
    v2.check()


def test_marconi_refreshes_only_the_deepest_matched_node():
    v1, v2 = three_requests(1), three_requests(2)
    for c in (v1, v2):
        branch = c.root.children[100]
        leaf_a = branch.children[200]
        if c.version == 1:  # SGLang+: the whole path is stamped on match and insert
            assert branch.ts == leaf_a.ts == c.clock
        else:  # only the deepest matched node; the branch node keeps its creation time
            assert leaf_a.ts == c.clock and branch.ts < leaf_a.ts
            assert branch.ts == branch.children[300].ts  # created by the P+B insertion


def test_branch_state_at_the_exact_split_depth_not_the_grid():
    pre = list(range(1000, 1077))  # 77 tokens: the split is off the 64-token grid
    c = make_published_cache("sglang_plus_published", 10**9, Unit())
    serve(c, ids(pre, range(1, 30)))
    serve(c, ids(pre, range(50, 60)))
    assert serve(c, ids(pre, range(70, 80))) == 77
    # the improved policy captures the branch on SGLang's 64-token grid
    cm = cost_model("qwen3-next-80b-a3b")
    reqs = [SimRequest("s", i, tuple(pre + list(t)), ()) for i, t in enumerate((range(1, 30), range(50, 60)))]
    reqs.append(SimRequest("s", 2, tuple(pre + list(range(70, 80))), ()))
    assert simulate(reqs, "lru", 10**12, cm).records[-1].resume_depth == 64
    assert simulate(reqs, "sglang_plus_published", 10**12, cm).records[-1].resume_depth == 77


def test_repeated_input_branches_inside_the_earlier_output():
    inp = ids(range(10, 30))
    c = PublishedHybridCache(1, 10**9, Unit())
    serve(c, inp, [1, 2, 3, 4, 5])
    # same input: it ends inside the cached edge (no state there: 0 reused); the sequence diverges
    # 3 tokens into the earlier output, and the branch state is stored there
    assert serve(c, inp, [1, 2, 3, 9, 9]) == 0
    node = c.root.children[10]
    assert node.end == 23 and set(node.children) == {4, 9}  # a state inside the first output
    assert serve(c, ids(range(10, 30), [1, 2, 3, 7])) == 23


def test_marconi_tunes_once_at_five_times_the_first_eviction_from_an_empty_tree():
    rng = np.random.default_rng(0)
    prefixes = [list(rng.integers(0, 50, 40)) for _ in range(4)]
    reqs = [
        (ids(prefixes[int(rng.integers(4))], rng.integers(50, 99, int(rng.integers(5, 30)))), [1, 2])
        for _ in range(80)
    ]
    cap = 400
    c = PublishedHybridCache(2, cap, Unit(), tuner_workers=1)
    for inp, out in reqs:
        serve(c, inp, out)
        c.check()
    k = c.num_reqs_before_eviction
    assert k is not None and 5 * k <= len(reqs)
    assert [t[0] for t in c.tunings] == [5 * k]  # once, at 5x the requests seen before eviction
    window = tuple((i, np.concatenate([i, np.array(o, dtype=np.int32)])) for i, o in reqs[: 5 * k])
    scores = [
        _replay_flops_saved(a, requests=window, capacity_bytes=cap, model=Unit(), last_n=500)
        for a in MARCONI_ALPHA_GRID
    ]
    assert c.alpha == MARCONI_ALPHA_GRID[scores.index(max(scores))]  # replay from empty, first max


def test_vllm_plus_soft_cap_tail_blocks_and_partial_block_reuse():
    c = PublishedBlockCache(200, Unit(), block=32)
    seq = ids(range(1000, 1100))  # 100 tokens: blocks 32 + 32 + 32 + 4
    serve(c, seq)
    assert (c.num_nodes, c.kv_tokens) == (4, 100)
    assert c.bytes_used == 140 <= 200
    big = ids(range(5000, 5300))  # 300 tokens alone exceed the capacity: inserted anyway (soft cap)
    serve(c, big)
    c.check()
    assert c.bytes_used > c.capacity_bytes and c.kv_tokens >= 300
    # tail eviction: the LRU leaf is the deepest block of the older sequence, then its parent
    d = PublishedBlockCache(10**6, Unit())
    serve(d, seq)
    d.evict(1)
    assert serve(d, seq) == 96  # the 4-token tail block went first
    # partial-block reuse: a 70-token sequence ends in a 6-token block, an extension fills it in place
    e = PublishedBlockCache(10**6, Unit())
    serve(e, ids(range(70)))
    assert (e.num_nodes, e.kv_tokens) == (3, 70)
    serve(e, ids(range(80)))
    assert (e.num_nodes, e.kv_tokens) == (3, 80)  # no new block: the tail block grew to 16
    assert serve(e, ids(range(80), [7])) == 80
    assert serve(e, ids(range(70), [7])) == 64  # the 70-token state moved to 80
    e.check()


def test_marconi_model_matches_the_reference_formulas():
    m = MarconiModel()
    assert m.state_bytes == 24 * (4096 * 128 * 2 + (2 * 4096 + 2 * 128) * 4 * 2) == 26_787_840
    assert m.kv_bytes_per_token == 4 * 2 * 4096 * 2 == 65_536
    assert (
        m.request_flops_saved(10)
        == 24 * (12 * 10 * 4096**2 + 16 * 10 * 4096 * 128 + 10 * 10 * 4096)
        + 4 * (8 * 10 * 4096**2 + 4 * 100 * 4096)
        + 28 * 16 * 10 * 4096**2
    )


@pytest.mark.parametrize("policy", PUBLISHED_NAMES)
def test_simulate_replays_published_policies(policy):
    cm = cost_model("qwen3-next-80b-a3b")
    trace = synthetic_trace("doc_qa", 40, seed=1, scale=0.3)
    budget = 6 * cm.state_bytes + 20_000 * cm.kv_bytes_per_token
    r = simulate(trace, policy, budget, cm, check=True, tuner_workers=1)
    assert r.policy == policy and r.requests == len(trace)
    for rec in r.records:
        assert 0 <= rec.resume_depth <= rec.kv_depth <= rec.input_len
        assert rec.flops_saved == cm.prefill_flops(rec.resume_depth)
    assert r.summary() == simulate(trace, policy, budget, cm, tuner_workers=1).summary()  # deterministic


def test_sim_compare_accepts_trace_files(tmp_path):
    from benchmarks import sim_compare

    rows = [
        {
            "session_id": f"s{i % 3}",
            "turn_id": i // 3,
            "ts": float(i),
            "num_input_tokens": 60,
            "num_output_tokens": 4,
            "input_tokens": list(range(40)) + list(range(1000 + 20 * i, 1020 + 20 * i)),
            "output_tokens": [7, 8, 9, i],
        }
        for i in range(12)
    ]
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    pols = ["lru", "sglang_plus_published", "vllm_plus_published"]
    # fractions of the KV footprint: a tiny trace needs a big one to hold a few 77 MB states
    rc = sim_compare.main(["--trace", str(trace), "--policies", *pols, "--fracs", "60", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "sim_compare.json").read_text())
    assert list(res["traces"]) == ["tiny"]
    got = {r["policy"]: r for r in res["traces"]["tiny"]["rows"]}
    assert set(got) == set(pols) and all(r["source"] == str(trace) for r in got.values())
    assert got["sglang_plus_published"]["requests"] == 12
    assert sim_compare.trace_sources(None, [str(trace), str(trace)])[1][0] == "tiny-2"
    with pytest.raises(SystemExit, match="not found"):
        sim_compare.main(["--trace", str(tmp_path / "missing.jsonl"), "--out", str(out)])

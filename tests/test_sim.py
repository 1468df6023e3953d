"""Simulator: every policy replays a synthetic trace with tree invariants checked, deterministically;
the oracle law is consistent with the trace; metric definitions hold per request."""

from __future__ import annotations

import json

import pytest

from sglang_sparse.policy import POLICY_NAMES
from sglang_sparse.sim import OracleLaw, cost_model, load_trace, simulate, synthetic_trace

COST = cost_model("qwen3-next-80b-a3b")
TRACE = synthetic_trace("doc_qa", 60, seed=3, scale=0.3)
BUDGET = 6 * COST.state_bytes + 20_000 * COST.kv_bytes_per_token


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_replays_with_invariants(policy):
    r = simulate(TRACE, policy, BUDGET, COST, check=True, bootstrap=20)
    assert r.requests == len(TRACE) and r.max_bytes_used <= BUDGET
    for rec in r.records:
        assert 0 <= rec.resume_depth <= rec.kv_depth <= rec.input_len
        assert rec.recomputed == rec.kv_depth - rec.resume_depth
        assert rec.flops_saved == COST.prefill_flops(rec.resume_depth)
    assert r.recomputed_tokens == sum(x.recomputed for x in r.records)


def test_deterministic_including_alpha_tuning():
    a = simulate(TRACE, "sparse", BUDGET, COST, bootstrap=20)
    b = simulate(TRACE, "sparse", BUDGET, COST, bootstrap=20)
    assert a.summary() == b.summary() and a.alphas


def test_oracle_depths_are_infinite_cache_overlaps():
    o = OracleLaw(TRACE)
    inf = simulate(TRACE, "lru", 10**15, COST, keep_records=True)
    assert [x.kv_depth for x in inf.records] == o.depths.tolist()


def test_jsonl_reader(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [
        {
            "session_id": "a",
            "turn_id": 0,
            "ts": 0.0,
            "num_input_tokens": 2,
            "num_output_tokens": 1,
            "input_tokens": [1, 2],
            "output_tokens": [3],
        },
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (req,) = load_trace(p)
    assert req.input_tokens == (1, 2) and req.output_tokens == (3,)


def test_unknown_policy_and_tiny_budget():
    with pytest.raises(ValueError, match="valid:"):
        simulate(TRACE, "fifo", BUDGET, COST)
    with pytest.raises(ValueError, match="smaller than one"):
        simulate(TRACE, "lru", 1000, COST)

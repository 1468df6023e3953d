"""Two-tier replay (device + host, SGLang's HiCache): the configuration, the load-discounted cost,
residency and loads, the device fit cap, and the ``--host-ratio`` sweep."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from benchmarks import sim_compare
from sglang_sparse.policy import HybridCache
from sglang_sparse.policy.host_tier import HostCost, HostTierConfig
from sglang_sparse.sim import SimRequest, cost_model, simulate, synthetic_trace
from sglang_sparse.sim.host_tier import TwoTierCache

COST = cost_model("qwen3-next-80b-a3b")
KV, SB = COST.kv_bytes_per_token, COST.state_bytes
TRACE = synthetic_trace("agent", 80, seed=5, scale=0.3)


def _req(sid: str, tokens: np.ndarray, out: int = 8, turn: int = 0) -> SimRequest:
    inp = tuple(int(x) for x in tokens)
    return SimRequest(sid, turn, inp, tuple(range(900_000 + 0, 900_000 + out)))


def _text(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1000, 150_000, size=n)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTierConfig(0)
    with pytest.raises(ValueError, match="load_bandwidth"):
        HostTierConfig(1, load_bandwidth=0)
    with pytest.raises(ValueError, match="device_flops"):
        HostTierConfig(1, device_flops=-1)
    with pytest.raises(ValueError, match="write_policy"):
        HostTierConfig(1, write_policy="write_around")


def test_logical_bytes_and_host_share():
    wb = HostTierConfig(300)
    wt = HostTierConfig(300, write_policy="write_through")
    assert wb.logical_bytes(100) == 400 and wt.logical_bytes(100) == 300
    assert wt.logical_bytes(500) == 500  # a host smaller than the device adds nothing under write-through
    assert wb.host_share(100) == pytest.approx(0.75) and wt.host_share(100) == pytest.approx(2 / 3)
    assert wt.host_share(500) == 0.0
    assert wb.load_flops(25) == pytest.approx(25 * wb.device_flops / wb.load_bandwidth)


def test_host_cost_discounts_the_expected_load_and_pickles():
    cfg = HostTierConfig(10 * SB)
    full = HostCost(COST, cfg, 1.0)
    half = HostCost(COST, cfg, 0.5)
    none = HostCost(COST, cfg, 0.0)
    pos, fb = 4096, 1024
    base = COST.node_flops_saved(pos, fb)
    load = cfg.load_flops(SB + (pos - fb) * KV)
    assert none.node_flops_saved(pos, fb) == base
    assert full.node_flops_saved(pos, fb) == pytest.approx(base - load)
    assert half.node_flops_saved(pos, fb) == pytest.approx(base - load / 2)
    slow = HostCost(COST, HostTierConfig(SB, load_bandwidth=1.0), 1.0)  # a load dearer than any recompute
    assert slow.node_flops_saved(pos, fb) == 0.0
    assert full.kv_bytes_per_token == KV and full.prefill_flops(10) == COST.prefill_flops(10)
    copy = pickle.loads(pickle.dumps(half))
    assert copy.node_flops_saved(pos, fb) == half.node_flops_saved(pos, fb)
    with pytest.raises(ValueError, match="host_share"):
        HostCost(COST, cfg, 1.5)


@pytest.mark.parametrize("policy", ["lru", "sglang_native", "sparse_dp", "block32"])
def test_hits_equal_one_cache_of_both_tiers(policy):
    """Policies that do not value loads keep exactly what one cache of device + host bytes keeps
    (write-back), with the device's fit: the tier only decides who pays a load. (No prompt here
    resumes deeper than the device fits; the cap is tested below.)"""
    device = 4 * SB + 6_000 * KV
    host = HostTierConfig(3 * device)
    two = simulate(TRACE, policy, device, COST, host=host, check=True, keep_records=True)
    fit = (device - SB) // KV
    one = simulate(TRACE, policy, device + host.budget_bytes, COST, fit_tokens=fit, keep_records=True)
    assert two.max_bytes_used <= device + host.budget_bytes
    assert all(r.resume_depth <= fit for r in one.records)  # the cap never binds on this trace
    assert [r.resume_depth for r in two.records] == [r.resume_depth for r in one.records]
    assert two.hit_tokens == one.hit_tokens > 0 and two.load_bytes > 0


def test_no_loads_when_the_device_holds_everything():
    big = 10**15
    r = simulate(TRACE, "sparse", big, COST, host=HostTierConfig(big), bootstrap=20)
    one = simulate(TRACE, "sparse", big, COST, bootstrap=20)
    assert r.load_bytes == 0 and r.load_flops == 0.0
    assert r.hit_tokens == one.hit_tokens and r.net_flops_saved_frac == r.flops_saved_frac


def test_a_prefix_pushed_off_the_device_is_loaded_back_whole():
    """A session's first turn, three unrelated requests that push it off the device (but not out of
    the two tiers), then its next turn: the resume depth is the first turn's end and the load is
    exactly its state plus the KV of its whole path."""
    rng = np.random.default_rng(0)
    first = _req("a", _text(rng, 1000))
    full = first.input_tokens + first.output_tokens
    cont = SimRequest("a", 1, full + tuple(int(x) for x in _text(rng, 50)), (7,))
    fillers = [_req(f"f{i}", _text(rng, 1000)) for i in range(3)]
    device = SB + 3_000 * KV
    host = HostTierConfig(20 * device)
    pushed = simulate([first, *fillers, cont], "lru", device, COST, host=host, keep_records=True, check=True)
    last = pushed.records[-1]
    assert last.resume_depth == len(full)
    assert pushed.load_bytes == SB + len(full) * KV
    assert pushed.host_hit_tokens == len(full)
    assert pushed.load_flops == pytest.approx(host.load_flops(SB + len(full) * KV))
    direct = simulate([first, cont], "lru", device, COST, host=host, keep_records=True)
    assert direct.records[-1].resume_depth == len(full) and direct.load_bytes == 0
    # without a host tier the fillers evicted it: nothing to resume
    alone = simulate([first, *fillers, cont], "lru", device, COST, keep_records=True)
    assert alone.records[-1].resume_depth == 0


def test_resume_never_deeper_than_the_device_fits():
    rng = np.random.default_rng(1)
    first = _req("a", _text(rng, 5000))
    full = first.input_tokens + first.output_tokens
    cont = SimRequest("a", 1, full + (5,), (7,))
    device = SB + 3_000 * KV  # fits 3,000 tokens next to one state
    host = HostTierConfig(20 * device)
    r = simulate([first, cont], "lru", device, COST, host=host, keep_records=True)
    assert r.records[-1].resume_depth <= 3_000
    one = simulate([first, cont], "lru", device + host.budget_bytes, COST, keep_records=True)
    assert one.records[-1].resume_depth == len(full)  # one big device would have served it all


def test_probation_states_are_the_first_to_leave_the_device():
    """Residency ranks a state on probation (a first-sight guess no request resumed from) below every
    used item, as sparse's device evicts, hence demotes, those first; otherwise it is by recency."""
    rng = np.random.default_rng(2)
    a, b = _text(rng, 1000), _text(rng, 1000)
    device = SB + 2_000 * KV  # both KV paths and one state

    def loads(probation: bool) -> tuple[int, int]:
        cache = HybridCache("sparse", budget_bytes=100 * device, cost=COST)
        cache.insert(a, None, {1000: 1})
        cache.insert(b, None, {1000: 2}, probation=frozenset({1000}) if probation else frozenset())
        tier = TwoTierCache(cache, device, HostTierConfig(10 * device))
        out = []
        for t in (a, b):
            q = np.concatenate([t, [5]])
            m, load = tier.resume(cache.match(q), q)
            assert m.resume_depth == 1000
            out.append(load)
        return out[0], out[1]

    assert loads(probation=True) == (0, SB)  # b's guess went down, a's used path stayed
    la, lb = loads(probation=False)
    assert lb == 0 and la == SB + 1000 * KV  # by recency: b (newer) on the device, a on the host


def test_deterministic_and_rejects_policies_without_a_host_model():
    device = 4 * SB + 6_000 * KV
    host = HostTierConfig(2 * device, write_policy="write_through")
    a = simulate(TRACE, "sparse", device, COST, host=host, bootstrap=20)
    b = simulate(TRACE, "sparse", device, COST, host=host, bootstrap=20)
    assert a.summary() == b.summary() and a.host_bytes == 2 * device
    assert a.max_bytes_used <= host.logical_bytes(device)
    for pol in ("offline", "marconi_published"):
        with pytest.raises(ValueError, match="no host tier"):
            simulate(TRACE, pol, device, COST, host=host)


def test_one_tier_summary_keeps_its_shape():
    s = simulate(TRACE, "lru", 4 * SB + 6_000 * KV, COST).summary()
    assert not any(k.startswith(("host", "load", "net_")) for k in s)


def test_sim_compare_host_ratio_sweep(tmp_path, capsys):
    out = tmp_path / "res"
    rc = sim_compare.main(
        [
            "--synthetic",
            "--traces",
            "doc_qa",
            "--fracs",
            "0.1",
            "--host-ratio",
            "2",
            "--policies",
            "sparse",
            "sglang_native",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "sim_compare_host.json").read_text())
    rows = res["traces"]["doc_qa"]["rows"]
    assert {(r["policy"], r["host_ratio"]) for r in rows} == {
        ("sparse (no host)", 0.0),
        ("sparse", 2.0),
        ("sglang_native", 2.0),
    }
    (acc,) = res["acceptance"]["doc_qa"]
    sp = next(r for r in rows if r["policy"] == "sparse")
    nat = next(r for r in rows if r["policy"] == "sglang_native")
    beaten = (
        nat["token_hit_rate"] > sp["token_hit_rate"]
        or nat["net_flops_saved_frac"] > sp["net_flops_saved_frac"]
    )
    assert acc["sparse_ge_all"] == (not beaten)
    assert (out / "sim_compare_host_doc_qa.png").exists()
    assert "native HiCache" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no host-tier model"):
        sim_compare.main(["--synthetic", "--traces", "doc_qa", "--host-ratio", "2", "--policies", "offline"])
    with pytest.raises(SystemExit, match="must be > 0"):
        sim_compare.main(["--synthetic", "--traces", "doc_qa", "--host-ratio", "0", "--policies", "sparse"])
    with pytest.raises(SystemExit, match="no synthetic shape"):
        sim_compare.main(["--synthetic", "--traces", "rag", "--policies", "sparse"])

"""The ``sparse`` backend's two-tier scoring under HiCache, without a server: ``TreePolicy.set_host_tier``
turns the policy's cache into the logical cache (device + host under write-back, the larger under
write-through) and values states net of their expected load (``HostCost`` with the engine's bytes,
not the cost model's), as the simulator's host tier does; the start-up bandwidth probe; the new
options' parsing."""

from __future__ import annotations

import pickle

import pytest

from sglang_sparse.policy.host_tier import HostCost, HostTierConfig
from sglang_sparse.sglang_adapter.config import SparseConfig
from sglang_sparse.sglang_adapter.tree_policy import TreePolicy
from sglang_sparse.sim import cost_model

KV_B, STATE_B, DEVICE = 10, 500, 50_000
COST = cost_model("qwen3-next-80b-a3b")


def _policy(**kw) -> TreePolicy:
    name = kw.pop("policy", "sparse")
    return TreePolicy(
        SparseConfig(policy=name, **kw),
        budget_bytes=DEVICE,
        cost=COST,
        kv_bytes_per_token=KV_B,
        state_bytes=STATE_B,
    )


@pytest.mark.parametrize("wp,logical", [("write_back", DEVICE + 200_000), ("write_through", 200_000)])
def test_set_host_tier_scores_the_logical_cache_net_of_loads(wp: str, logical: int) -> None:
    pol = _policy()
    host = HostTierConfig(budget_bytes=200_000, load_bandwidth=1e9, device_flops=1e12, write_policy=wp)
    pol.set_host_tier(host)
    assert pol.budget_bytes == logical and pol.cache.budget_bytes == logical
    assert pol.device_bytes == DEVICE and pol.cache.fit_tokens == (DEVICE - STATE_B) // KV_B
    cost = pol.cache.evictor.cost
    assert isinstance(cost, HostCost) and cost is pol.cost
    assert cost.host_share == pytest.approx(1 - DEVICE / logical)
    # the load is the engine's bytes (state + KV since the fallback), not the cost model's
    assert (cost.load_state_bytes, cost.load_kv_bytes) == (STATE_B, KV_B)
    assert (
        (cost.state_bytes, cost.kv_bytes_per_token)
        == (STATE_B, KV_B)
        != (COST.state_bytes, COST.kv_bytes_per_token)
    )
    load = host.load_flops(STATE_B + 100 * KV_B)
    want = max(0.0, COST.node_flops_saved(300, 200) - cost.host_share * load)
    assert cost.node_flops_saved(300, 200) == pytest.approx(want)
    snap = pol.snapshot()
    assert snap["host_budget_bytes"] == 200_000 and snap["host_cost"] is True
    assert snap["host_share"] == pytest.approx(cost.host_share)
    pickle.loads(pickle.dumps(cost))  # the tuning worker receives it
    pol.reset(pol.mirror.root.uid)  # a flush keeps both tiers
    assert pol.cache.budget_bytes == logical and pol.cache.evictor.cost is cost


def test_host_cost_off_and_non_flop_aware_policies_keep_the_cost_model() -> None:
    host = HostTierConfig(budget_bytes=200_000)
    for pol in (_policy(host_cost=False), _policy(policy="lru", alpha=0.0)):
        pol.set_host_tier(host)
        assert pol.cost is COST and pol.budget_bytes == DEVICE + 200_000
        assert pol.snapshot()["host_cost"] is False


def test_set_host_tier_only_before_requests() -> None:
    pol = _policy()
    pol.on_node_added(1, pol.mirror.root.uid, 64, 7)
    with pytest.raises(RuntimeError, match="already holds"):
        pol.set_host_tier(HostTierConfig(budget_bytes=1_000))


def test_measured_bandwidth_is_a_positive_rate() -> None:
    pytest.importorskip("torch")
    from sglang_sparse.sglang_adapter.plugin import measure_load_bandwidth

    bw, pinned = measure_load_bandwidth("cpu", nbytes=1 << 20, repeats=3)
    assert bw > 1e6 and pinned is False  # > 1 MB/s: a memcpy on any machine


def test_measured_device_flops_prices_a_cpu_load_below_a_gpu_default() -> None:
    """The measured default pairs the CPU's own matmul rate with its own memcpy bandwidth: a loaded
    byte then costs the few prefill FLOPs the CPU could run meanwhile, not the GPU default's 16,000
    (4e14 FLOP/s over 25 GB/s), which on the CPU priced every host hit at more than it saves."""
    pytest.importorskip("torch")
    from sglang_sparse.sglang_adapter.plugin import measure_device_flops, measure_load_bandwidth

    flops, dtype = measure_device_flops("cpu", n=256, repeats=3)
    bw, _ = measure_load_bandwidth("cpu", nbytes=1 << 20, repeats=3)
    assert dtype == "float32" and 1e6 < flops < 1e14  # a 2-core CPU: well below any GPU's rate
    assert HostTierConfig(1, load_bandwidth=bw, device_flops=flops).flops_per_byte < (
        HostTierConfig(1).flops_per_byte
    )


def test_host_options_parse() -> None:
    cfg = SparseConfig.from_env(
        {
            "SGLANG_SPARSE_HOST_BANDWIDTH": "1.2e10",
            "SGLANG_SPARSE_DEVICE_FLOPS": "5e13",
            "SGLANG_SPARSE_HOST_COST": "0",
            "SGLANG_SPARSE_DEMOTE": "policy",
        }
    )
    assert (cfg.host_bandwidth, cfg.device_flops, cfg.host_cost, cfg.demote) == (
        1.2e10,
        5e13,
        False,
        "policy",
    )
    default = SparseConfig.from_env({})
    assert default.host_bandwidth is None and default.device_flops is None and default.host_cost
    assert default.demote == "lru"

"""The ``sparse`` backend sizes its policy from SGLang's own pools (issue 22, issue 21's "facts from
SGLang"): bytes per recurrent state equal SGLang's ``mamba_cache_per_req`` (what it sizes the Mamba
pool by) and one slot's row of the pool's tensors, KV bytes per token equal the KV pool's
``get_kv_size_bytes()`` over its rows, and the policy's byte budget is those bytes times the pools'
free sizes. ``SGLANG_MAMBA_SSM_DTYPE=bfloat16`` halves the temporal state in SGLang's pool; the
project's cost model (float32 by default) does not see it, the policy does. Real pools built like the
scheduler's (``benchmarks/scheduler_cache.py``), one subprocess per dtype, ~25 s each."""

from __future__ import annotations

import pytest
from sparse_testing.child import run_tagged_child
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(("torch", "sglang", "transformers"))


PROBE = r"""
import json, warnings
warnings.simplefilter("ignore")
from benchmarks.scheduler_cache import build_cache, make_model_dir
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.configs.model_config import ModelConfig
from sglang_sparse.sglang_adapter.plugin import _cost_model

model = make_model_dir(context_len=4096)
b = build_cache("sparse", model_dir=model, kv_tokens=2500, mamba_slots=24, max_reqs=4,
                context_len=1024, chunk=128)
mc = ModelConfig(str(model))
kv = b.allocator.get_kvcache().full_kv_pool
k, v = kv.get_kv_size_bytes()
st = b.req_to_token_pool.mamba_pool.mamba_cache
pol = b.cache.policy
print("PROBE " + json.dumps({
    "policy_kv_bytes": pol._kv_bytes,
    "policy_state_bytes": pol._state_bytes,
    "policy_budget_bytes": pol.budget_bytes,
    "per_req": int(mambaish_config(mc).mamba2_cache_params.mamba_cache_per_req),
    "pool_state_row": sum(int(t[:, 0].numel() * t.element_size()) for t in (st.temporal, *st.conv)),
    "temporal_dtype": str(st.temporal.dtype),
    "pool_kv_bytes": int(k) + int(v),
    "pool_kv_rows": int(kv.k_buffer[0].shape[0]),
    "kv_free": int(b.allocator.available_size()),
    "state_free": int(b.req_to_token_pool.mamba_allocator.available_size()),
    "cost_state_bytes": _cost_model(type("Ctx", (), {"model_config": mc})).state_bytes,
}))
"""


def _probe(**env: str) -> dict:
    return run_tagged_child(
        ["-c", PROBE],
        "PROBE",
        drop_env=("SGLANG_SPARSE_", "SGLANG_MAMBA_"),
        env={"SGLANG_SPARSE_CAPTURE": "cut", **env},
    )


@pytest.fixture(scope="module")
def default() -> dict:
    return _probe()


@pytest.fixture(scope="module")
def bf16_ssm() -> dict:
    return _probe(SGLANG_MAMBA_SSM_DTYPE="bfloat16")


@pytest.mark.parametrize("which", ["default", "bf16_ssm"])
def test_policy_bytes_are_sglangs_pool_bytes(which: str, request: pytest.FixtureRequest) -> None:
    r = request.getfixturevalue(which)
    assert r["policy_state_bytes"] == r["per_req"] == r["pool_state_row"], r
    assert r["policy_kv_bytes"] * r["pool_kv_rows"] == r["pool_kv_bytes"], r
    budget = r["kv_free"] * r["policy_kv_bytes"] + r["state_free"] * r["policy_state_bytes"]
    assert r["policy_budget_bytes"] == budget, r


def test_the_ssm_dtype_override_reaches_the_policy(default: dict, bf16_ssm: dict) -> None:
    assert default["temporal_dtype"] == "torch.float32" and bf16_ssm["temporal_dtype"] == "torch.bfloat16"
    assert bf16_ssm["policy_state_bytes"] < default["policy_state_bytes"]
    # the cost model reads the model config only: it still counts a float32 temporal state
    assert bf16_ssm["cost_state_bytes"] == default["cost_state_bytes"] == default["policy_state_bytes"]
    assert bf16_ssm["policy_kv_bytes"] == default["policy_kv_bytes"]

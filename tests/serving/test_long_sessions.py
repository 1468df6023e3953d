"""Long multi-turn sessions on the real CPU server with the ``sparse`` backend (issue: one tree).

A session of ``T`` turns builds a radix-tree chain ``T`` nodes deep; before the one-tree adapter,
the alpha tuner's ``deepcopy`` of a token-replayed shadow recursed once per level and killed the
scheduler near turn 119 (tuning window 20) / 199 (default window). Here: default options except a
short tuning window with re-tuning on (so every window snapshots the tree and alpha is tuned
several times along the chain) and the in-server invariant check (the policy's mirror equals
SGLang's tree after every checkpoint and eviction). Tokens are compared with a
``--disable-radix-cache`` server on sampled turns. About 4 minutes on 2 cores.
The full-size soak (2,000 turns; 20 x 300 interleaved turns) is ``python -m benchmarks.long_sessions``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack()

from sparse_testing.reference import NoCacheReference  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.server import SGLangServer  # noqa: E402
from sglang_sparse.testing.sessions import mismatches, run_sessions, sample_turns  # noqa: E402

TURNS = 300
CONTEXT = 4096
KV_TOKENS = 6000
STATE_SLOTS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3_next_sessions"),
        arch="qwen3_next",
        seed=0,
        max_position_embeddings=CONTEXT,
    )


def _server(model_dir: Path, extra: list[str], env: dict | None = None) -> SGLangServer:
    return SGLangServer(
        model_dir,
        extra_args=["--chunked-prefill-size", "256", *extra],
        env=env,
        context_length=CONTEXT,
        max_total_tokens=KV_TOKENS,
        max_mamba_cache_size=STATE_SLOTS,
    ).start(timeout=300)


def test_long_and_interleaved_sessions_default_options(model_dir: Path, nocache: NoCacheReference) -> None:
    # re-tuning on, so every window snapshots SGLang's tree (by default alpha is tuned once)
    env = {
        "SGLANG_SPARSE_TUNE_WINDOW": "20",
        "SGLANG_SPARSE_RETUNE": "1",
        "SGLANG_SPARSE_CHECK_INVARIANTS": "1",
    }
    with _server(model_dir, ["--radix-cache-backend", "sparse"], env) as srv:
        chain = run_sessions(lambda p, n: srv.generate(p, n), sessions=1, turns=TURNS, seed=1)
        assert srv.alive(), srv.log_tail()
        inter = run_sessions(lambda p, n: srv.generate(p, n), sessions=4, turns=60, seed=2)
        assert srv.alive(), srv.log_tail()
        s = srv.wait_sparse_idle()
    # Multi-turn reuse: every later turn resumes from the previous turn's finish state.
    cached = chain.cached[0]
    assert all(c > 0 for c in cached[1:]), cached[:20]
    assert sum(cached[1:]) >= 0.9 * sum(len(p) for p in chain.prompts[0][1:])
    # Tuning windows (each snapshotting SGLang's tree) all along the 300-deep chain, alpha tuned,
    # no failure; the mirror never drifted.
    assert s["tune_windows"] >= (TURNS + 4 * 60) // 20 - 2, s
    assert s["alpha_tunes"] and s["tune_runs"] >= 1 and s["tune_failures"] == 0, s
    assert s["invariant_violations"] == 0, s["last_invariant_error"]
    assert s["mirror_errors"] == 0 and s["policy_states"] == s["states_held"], s
    # Pools clean at idle: nothing protected, every slot free or held by the tree.
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"], s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    assert s["states_evicted"] + s["kv_leaves_evicted"] > 0, "the sessions should have forced evictions"
    # Tokens identical to no cache on sampled turns (first turns, every 50th, the last).
    nocache.check_model(model_dir)
    assert mismatches(chain, nocache.generate, sample_turns(TURNS, head=4, every=75), [0]) == []
    assert mismatches(inter, nocache.generate, sample_turns(60, head=2, every=30), [0, 3]) == []


def test_300_turn_session_on_extra_buffer(model_dir: Path, nocache: NoCacheReference) -> None:
    """The same 300-turn chain on SGLang's fast path (extra_buffer, overlap schedule on, page 16):
    every turn whose previous sequence crosses a state-grid point resumes from its grid-floored
    finish state (a decode-time snapshot), the mirror never drifts, nothing leaks at idle, and the
    sampled turns equal no cache."""
    from sglang_sparse.testing.server import strategy_setup

    base, env = strategy_setup("extra_buffer")
    srv = SGLangServer(
        model_dir,
        extra_args=["--chunked-prefill-size", "256", "--page-size", "16", "--radix-cache-backend", "sparse"],
        env={**env, "SGLANG_SPARSE_TUNE_WINDOW": "50", "SGLANG_SPARSE_CHECK_INVARIANTS": "1"},
        base_args=base,
        context_length=CONTEXT,
        max_total_tokens=KV_TOKENS,
        max_mamba_cache_size=STATE_SLOTS,
    ).start(timeout=300)
    with srv:
        chain = run_sessions(lambda p, n: srv.generate(p, n), sessions=1, turns=TURNS, seed=1)
        assert srv.alive(), srv.log_tail()
        s = srv.wait_sparse_idle()
    cached, prompts = chain.cached[0], chain.prompts[0]
    # the previous sequence (prompt + output) reaches 64 tokens after a few turns; from then on
    # every turn resumes within one grid step (64) of the previous sequence's end
    late = [k for k in range(1, TURNS) if len(prompts[k - 1]) + 2 >= 128]
    assert late and all(cached[k] >= len(prompts[k - 1]) + 2 - 64 - 1 for k in late), cached[:40]
    assert sum(cached[1:]) >= 0.9 * sum(len(p) for p in prompts[1:])
    assert s["invariant_violations"] == 0 and s["mirror_errors"] == 0, s
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    nocache.check_model(model_dir)
    assert mismatches(chain, nocache.generate, sample_turns(TURNS, head=4, every=75), [0]) == []

"""SGLang's hierarchical cache (HiCache) on the CPU, native and with ``--radix-cache-backend sparse``.

SGLang 0.5.23 with ``--enable-hierarchical-cache`` serves the tiny random-weight Qwen3-Next on the CPU
once the plugin's HiCache routes are installed (``kernels/sglang_sparse_kernels/sgl_kernel_cpu/
hicache.py``: host pools without CUDA, torch copy ops, the ``direct`` io backend resolved
automatically). A small device pool (1,024 KV tokens, 8 state slots) and a host 6x its size; per
configuration (native: no_buffer write-through, extra_buffer write-back at page 16;
sparse: no_buffer write-back, extra_buffer write-through at page 16), one server at a time:

* the resolved arguments: io backend ``direct``, layout ``page_first_direct``, without the flags;
* greedy tokens identical to a ``--disable-radix-cache`` server on a workload whose session turns and
  branches come back after six unrelated requests have pushed them off the device (one new token
  after each hit: this model's GDN layers forget a wrong state within a few tokens);
* those returning requests hit (``cached_tokens`` > 0), where SGLang's plain radix cache with the
  same device pool hits nothing: the host tier served them;
* nothing leaked at idle (KV in use 0; SGLang's strict idle memory check on); for sparse also: its
  mirror of SGLang's tree (device + host: a state demoted to the host stays, it leaves with its last
  copy) checked after every step (``SGLANG_SPARSE_CHECK_INVARIANTS``) without a violation, available
  + held = pool size on both pools, and a flush returns both pools whole.

And the sparse backend with HiCache under load (extra_buffer, page 16, write-back, in-forward
capture): a 500-request storm over 8 shared heads with every 5th request aborted, and two
interleaved 300-turn sessions whose chains do not fit the device together (each turn loads the other
session's path back): completed requests / sampled turns equal no cache, the mirror never drifts,
nothing leaked at idle, every reserved capture slot accounted for.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(cpu_platform=True)

import requests  # noqa: E402
from sparse_testing.reference import NoCacheReference  # noqa: E402
from sparse_testing.storm import CAPTURE_OUTCOMES, new_tokens, run_storm, storm_prompts  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.server import ServerError, SGLangServer, strategy_setup  # noqa: E402
from sglang_sparse.testing.sessions import mismatches, run_sessions, sample_turns  # noqa: E402

VOCAB = 4096
NEW = 8
SIZING = {"context_length": 2048, "max_total_tokens": 1024, "max_mamba_cache_size": 8}
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "6"]
#: the requests that come back after the device was flushed (session turn, branch, other session)
RETURNING = ("A1t3", "A1b", "B1t2")
WT, WB = ["--hicache-write-policy", "write_through"], ["--hicache-write-policy", "write_back"]
SPARSE = ["--radix-cache-backend", "sparse"]
CONFIGS = {
    "native_nb_write_through": ("no_buffer", WT),
    "native_eb_write_back_page16": ("extra_buffer", [*WB, "--page-size", "16"]),
    "sparse_nb_write_back": ("no_buffer", [*SPARSE, *WB]),
    "sparse_eb_write_through_page16": ("extra_buffer", [*SPARSE, *WT, "--page-size", "16"]),
    "sparse_eb_write_back_page16_demote_policy": ("extra_buffer", [*SPARSE, *WB, "--page-size", "16"]),
}
#: per-config environment on top of CHECK_ENV: the device walks in the policy's order under HiCache
#: (write-back: an internal state is backed up to the host before its slot is freed)
CONFIG_ENV = {"sparse_eb_write_back_page16_demote_policy": {"SGLANG_SPARSE_DEMOTE": "policy"}}
CHECK_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
    "SGLANG_SPARSE_CHECK_INVARIANTS": "1",
}


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def steps() -> list[tuple[str, Callable[[dict, dict], list[int]]]]:
    """``(tag, build(prompts, outputs))``: two documents, a session turn and a branch, six unrelated
    350-token requests (more than the device pool, less than the host), then the returning ones."""
    a, b = toks(300, 1), toks(300, 2)
    out: list[tuple[str, Callable[[dict, dict], list[int]]]] = [
        ("A1", lambda p, o: a + toks(20, 11)),
        ("A2", lambda p, o: a + toks(25, 12)),
        ("A1t2", lambda p, o: p["A1"] + o["A1"] + toks(20, 13)),
        ("B1", lambda p, o: b + toks(20, 21)),
    ]
    out += [(f"F{i}", lambda p, o, i=i: toks(350, 100 + i)) for i in range(6)]
    out += [
        ("A1t3", lambda p, o: p["A1t2"] + o["A1t2"] + toks(1, 14)),
        ("A1b", lambda p, o: p["A1"] + o["A1"] + toks(1, 15)),
        ("B1t2", lambda p, o: p["B1"] + o["B1"] + toks(1, 22)),
        ("A3", lambda p, o: a + toks(30, 16)),
    ]
    return out


def run(srv: SGLangServer | NoCacheReference) -> dict[str, Any]:
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for tag, build in steps():
        prompts[tag] = build(prompts, outputs)
        r = srv.generate(prompts[tag], NEW)
        outputs[tag], cached[tag] = r.output_ids, r.cached_tokens
    return {"outputs": outputs, "cached": cached}


def idle_load(srv: SGLangServer, timeout: float = 60.0) -> dict[str, Any]:
    """``/v1/loads`` once the scheduler has settled (the last request's release can trail its
    response) or after ``timeout`` seconds: the last reading either way."""
    deadline = time.monotonic() + timeout
    while True:
        load = requests.get(f"{srv.url}/v1/loads", timeout=60).json()["loads"][0]
        if (load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.5)


def _start(srv: SGLangServer) -> SGLangServer:
    try:
        srv.start(timeout=300)
    except ServerError as exc:
        pytest.fail(f"SGLang CPU server failed to start ({srv.cmd[-12:]}): {exc}")
    return srv


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3_next_hicache"),
        arch="qwen3_next",
        seed=0,
        max_position_embeddings=4096,
    )


def _serve(
    model_dir: Path, strategy: str, extra: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    base, strategy_env = strategy_setup(strategy)
    srv = _start(
        SGLangServer(
            model_dir, base_args=base, env={**strategy_env, **(env or {})}, extra_args=extra, **SIZING
        )
    )
    sparse = "sparse" in extra
    try:
        info = requests.get(f"{srv.url}/server_info", timeout=60).json()
        res = run(srv)
        load = idle_load(srv)
        idle = flushed = None
        if sparse:
            idle = srv.wait_sparse_idle(60)
            assert srv.flush_cache()
            flushed = srv.wait_sparse_idle(60)
        alive, log = srv.alive(), srv.log_tail(2_000_000)
    finally:
        srv.stop()
    return {**res, "info": info, "load": load, "idle": idle, "flushed": flushed, "alive": alive, "log": log}


@pytest.fixture(scope="module")
def reference(model_dir: Path, nocache: NoCacheReference) -> dict[str, Any]:
    nocache.check_model(model_dir)
    return run(nocache)


@pytest.fixture(scope="module")
def plain_radix(model_dir: Path) -> dict[str, Any]:
    return _serve(model_dir, "no_buffer", [])


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def hicache(request: pytest.FixtureRequest, model_dir: Path) -> dict[str, Any]:
    strategy, extra = CONFIGS[request.param]
    env = {**CHECK_ENV, **CONFIG_ENV.get(request.param, {})}
    return {**_serve(model_dir, strategy, [*HICACHE, *extra], env), "name": request.param}


def test_io_backend_resolved_for_the_cpu(hicache: dict[str, Any]) -> None:
    info = hicache["info"]
    assert info["enable_hierarchical_cache"] is True
    assert info["hicache_io_backend"] == "direct" and info["hicache_mem_layout"] == "page_first_direct"
    assert "resolved to direct" in hicache["log"]


def test_capture_default_follows_the_write_policy(hicache: dict[str, Any]) -> None:
    """The sparse backend's default capture with HiCache: ``cut`` under write-back (it keeps more
    on the measured slices, docs/sparse_backend.md), the CPU default ``forward`` under write-through."""
    if "sparse" not in (hicache["info"].get("radix_cache_backend") or ""):
        pytest.skip("native SGLang: no capture mode")
    want = "forward" if hicache["info"]["hicache_write_policy"] == "write_through" else "cut"
    assert f"capture={want}" in hicache["log"], hicache["log"][-4000:]
    assert hicache["idle"].get("capture_mode", "cut") == want, hicache["idle"]  # set by forward only


def test_sparse_scores_two_tiers_from_sglangs_host_pools(hicache: dict[str, Any]) -> None:
    """The policy's host tier is SGLang's host pools in bytes (KV tokens x the KV host pool's bytes
    per token + state slots x the Mamba host pool's bytes per state, the counts SGLang logs when it
    allocates them), under the server's write policy, with the start-up bandwidth probe's figure; a
    state's value is net of its load (``HostCost``)."""
    s = hicache["idle"]
    if s is None:
        pytest.skip("native SGLang: no policy")
    log = hicache["log"]
    kv_tokens = int(re.search(r"hierarchical KV host pool: (\d+) tokens", log).group(1))
    slots = int(re.search(r"hierarchical Mamba cache \((\d+) state slots", log).group(1))
    assert s["host_budget_bytes"] == kv_tokens * s["kv_bytes_per_token"] + slots * s["state_bytes"], s
    wp = hicache["info"]["hicache_write_policy"]
    assert s["host_write_policy"] == wp and s["host_cost"] is True, s
    device, host = s["device_budget_bytes"], s["host_budget_bytes"]
    assert s["budget_bytes"] == (device + host if wp == "write_back" else max(device, host)), s
    assert s["host_load_bandwidth"] > 0 and "load bandwidth" in log and "measured on cpu" in log
    assert 0 < s["host_share"] < 1, s


def test_device_walks_follow_the_demotion_order(hicache: dict[str, Any]) -> None:
    """``SGLANG_SPARSE_DEMOTE``: SGLang's LRU walks pick what the device demotes by default; with
    ``policy`` the device's KV walk is the policy's (and its state walk: counted with the host's)."""
    s = hicache["idle"]
    if s is None:
        pytest.skip("native SGLang: no policy")
    if hicache["name"].endswith("demote_policy"):
        assert s["kv_eviction_walks"] > 0, s
    else:
        assert s["kv_eviction_walks"] == 0, s


def test_greedy_tokens_identical_to_no_cache(hicache: dict[str, Any], reference: dict[str, Any]) -> None:
    assert hicache["alive"], hicache["log"][-6000:]
    assert hicache["outputs"] == reference["outputs"]


def test_returning_requests_are_served_from_the_host(
    hicache: dict[str, Any], plain_radix: dict[str, Any]
) -> None:
    assert plain_radix["outputs"] == hicache["outputs"]
    assert all(plain_radix["cached"][t] == 0 for t in RETURNING), plain_radix["cached"]
    assert all(hicache["cached"][t] > 0 for t in RETURNING), hicache["cached"]


def test_nothing_leaked_at_idle(hicache: dict[str, Any]) -> None:
    load = hicache["load"]
    assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0, load
    for marker in ("leak detected", "Leak Detected", "Traceback"):
        assert marker not in hicache["log"], marker
    s = hicache["idle"]
    if s is None:  # native
        return
    assert s["mirror_errors"] == 0 and s["invariant_violations"] == 0, s.get("last_invariant_error")
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"], s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    # the mirror is the logical cache: every state on the device or only on the host
    assert s["states_host_only"] > 0 and s["policy_states"] == s["states_held"] + s["states_host_only"], s
    f = hicache["flushed"]
    assert f["kv_available"] == f["kv_pool_size"] and f["mamba_available"] == f["mamba_pool_size"], f
    assert f["policy_states"] == 0 and f["mirror_errors"] == 0, f


def _sparse_eb_hicache(
    model_dir: Path, kv_tokens: int, slots: int, context: int = 2048, hicache: list[str] = HICACHE
) -> SGLangServer:
    """Sparse on extra_buffer at page 16 with HiCache write-back and the in-forward capture (named
    explicitly: it is the CPU default too)."""
    base, env = strategy_setup("extra_buffer")
    return _start(
        SGLangServer(
            model_dir,
            base_args=base,
            env={**env, **CHECK_ENV, "SGLANG_SPARSE_CAPTURE": "forward"},
            extra_args=[*SPARSE, *hicache, *WB, "--page-size", "16", "--chunked-prefill-size", "256"],
            context_length=context,
            max_total_tokens=kv_tokens,
            max_mamba_cache_size=slots,
        )
    )


def _assert_idle_clean(srv: SGLangServer) -> dict[str, Any]:
    s = srv.wait_sparse_idle(60)
    assert s["mirror_errors"] == 0 and s["invariant_violations"] == 0, s.get("last_invariant_error")
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"], s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    assert s["policy_states"] == s["states_held"] + s["states_host_only"], s
    assert s["capture_mode"] == "forward" and s["captures_pending"] == 0, s
    assert s["captures_reserved"] == sum(s[k] for k in CAPTURE_OUTCOMES), s
    log = srv.log_tail(5_000_000)
    for marker in ("leak detected", "Leak Detected", "leaked_mamba_pages={", "Traceback"):
        assert marker not in log, marker
    assert srv.flush_cache()
    f = srv.wait_sparse_idle(60)
    assert f["kv_available"] == f["kv_pool_size"] and f["mamba_available"] == f["mamba_pool_size"], f
    assert f["policy_states"] == 0, f
    return s


def test_sparse_hicache_storm_with_aborts(model_dir: Path, nocache: NoCacheReference) -> None:
    """Issue 22: with write-back and the in-forward capture this storm killed the scheduler after
    ~100-190 requests ("Not enough space for mamba ping pong idx" in SGLang's ``alloc_req_slots``):
    the capture slots one step reserved were still pending when the next step allocated its new
    requests' slots, and SGLang could not evict them. They are now reclaimed for SGLang's own
    allocations (``CaptureRadixCache.evict_for_alloc``); the storm completes, tokens equal no cache."""
    storm = 500
    prompts = storm_prompts(storm, toks)
    srv = _sparse_eb_hicache(model_dir, kv_tokens=4096, slots=30)
    try:
        done = run_storm(srv, prompts)
        assert srv.alive(), srv.log_tail()
        assert len(done) >= storm // 2, len(done)
        log = srv.log_tail(5_000_000)
        assert "capture=forward" in log and "capture=cut" not in log
        s = _assert_idle_clean(srv)
        captures = {k: s[k] for k in ("captures_reserved", *CAPTURE_OUTCOMES, "captures_dropped")}
        print(f"storm with HiCache: {len(done)}/{storm} completed, host-only states {s['states_host_only']}")
        print(f"capture slots: {captures}")
        walks = ("backups_reselected", "eviction_walks", "kv_eviction_walks", "host_state_drops")
        print(f"walks: { {k: s[k] for k in walks} }")
        assert s["captures_published"] > 0, captures
    finally:
        srv.stop()
    nocache.check_model(model_dir)
    want = {k: nocache.generate(prompts[k], new_tokens(k)).output_ids for k in sorted(done)}
    assert done == want


def _host_short_run(
    model_dir: Path, nocache: NoCacheReference, prompts: list[list[int]], slots: int
) -> tuple[list[Any], dict[str, Any]]:
    """Serve ``prompts`` in turn on sparse + HiCache (extra_buffer, write-back, 1,024 device KV
    tokens, host 2x, ``slots`` device state slots), check the idle server is clean
    (:func:`_assert_idle_clean`) and that greedy tokens equal a no-cache server's; return the
    responses and the idle statistics."""
    hicache = ["--enable-hierarchical-cache", "--hicache-ratio", "2"]
    srv = _sparse_eb_hicache(model_dir, kv_tokens=1024, slots=slots, hicache=hicache)
    try:
        got = [srv.generate(p, NEW) for p in prompts]
        assert srv.alive(), srv.log_tail()
        s = _assert_idle_clean(srv)
    finally:
        srv.stop()
    print({k: s[k] for k in ("host_state_drops", "host_kv_drops", "unscored_evictions", "states_host_only")})
    print("cached:", [r.cached_tokens for r in got])
    nocache.check_model(model_dir)
    assert [r.output_ids for r in got] == nocache.outputs(prompts, NEW)
    return got, s


def test_sparse_hicache_host_pool_short_drops_in_the_policys_order(
    model_dir: Path, nocache: NoCacheReference
) -> None:
    """A host tier twice the device (8 device, ~16 host state slots) under 10 documents asked 6
    questions each in turn: every request plans a few first-sight states, so the host's state pool
    runs short and drops host-only states in the policy's order (``drive_host_eviction``), every one
    a state the policy scores; greedy tokens equal no cache, nothing leaks in
    either pool, and most later questions resume inside their document. (SGLang's host LRU reads the
    same 6,400 cached tokens here: this checks the path and its exactness; the order's gain is
    measured on the system_prompts slice, ``serving.py --hicache``: 29,022 prefilled vs 31,198 with
    the LRU.)"""
    docs = [toks(150, 500 + d) for d in range(10)]
    prompts = [docs[i % 10] + toks(20, 900 + i) for i in range(60)]
    got, s = _host_short_run(model_dir, nocache, prompts, slots=8)
    assert s["host_state_drops"] > 0, s
    assert s["unscored_evictions"] == 0, s
    assert sum(r.cached_tokens >= 128 for r in got[10:]) >= 40, [r.cached_tokens for r in got]


def test_sparse_hicache_host_kv_short_drops_in_the_policys_order(
    model_dir: Path, nocache: NoCacheReference
) -> None:
    """The host's KV pool runs short first (2x the device's 1,024 tokens, 60 host state slots) under
    4 hot documents of 320 tokens asked 5 questions each in turn, every other request a new cold
    document read once (20): host leaves go in the policy's order
    (``SparseFullComponent.drive_host_eviction``: leaves holding no state first, then the policy's
    key of the host-only state a leaf holds), not SGLang's host LRU; greedy tokens equal no cache,
    nothing leaks in either pool, and later hot questions still resume inside their documents."""
    hot = [toks(320, 700 + d) for d in range(4)]
    prompts = [hot[(i // 2) % 4] if i % 2 == 0 else toks(320, 800 + i) for i in range(40)]
    prompts = [p + toks(20, 1900 + i) for i, p in enumerate(prompts)]
    got, s = _host_short_run(model_dir, nocache, prompts, slots=30)
    assert s["host_kv_drops"] > 0, s
    assert s["unscored_evictions"] == 0, s
    assert sum(r.cached_tokens >= 256 for r in got[8::2]) >= 12, [r.cached_tokens for r in got]


def test_sparse_hicache_interleaved_300_turn_sessions(model_dir: Path, nocache: NoCacheReference) -> None:
    turns = 300
    srv = _sparse_eb_hicache(model_dir, kv_tokens=4096, slots=16, context=4096)
    try:
        run = run_sessions(lambda p, n: srv.generate(p, n), sessions=2, turns=turns, seed=3)
        assert srv.alive(), srv.log_tail()
        s = _assert_idle_clean(srv)
    finally:
        srv.stop()
    assert s["states_host_only"] > 0, s  # the chains did not fit the device together
    late = [c for cached in run.cached for c in cached[turns // 2 :]]
    assert sum(late) > 0.8 * sum(len(p) for ps in run.prompts for p in ps[turns // 2 :]), "late turns resume"
    nocache.check_model(model_dir)
    assert mismatches(run, nocache.generate, sample_turns(turns, head=4, every=75), [0, 1]) == []

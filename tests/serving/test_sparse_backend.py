"""``--radix-cache-backend sparse`` on the real SGLang 0.5.23 CPU server with the tiny hybrid model.

Three servers (module-scoped, started one at a time): ``sparse`` (small cache), the native cache
(same flags) and ``--disable-radix-cache``. Checks greedy-token equality across the three on
trace-like request patterns, the SGLang #22935 partial-overlap case, a 200-request concurrent storm
(no crash, no leaked KV/state slots, pool budgets respected) and start-up failures on bad options.
Whole file: about 8 minutes on 2 cores.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack()


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "sparse" for ep in entry_points(group="sglang.srt.plugins"))


if not _entry_point_installed():
    pytest.skip(
        "sglang_sparse is installed without its 'sparse' sglang plugin entry point; "
        "run `pip install -e . --no-deps` in the serving venv",
        allow_module_level=True,
    )

import requests  # noqa: E402
from sparse_testing.reference import NoCacheReference  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.server import ServerError, SGLangServer  # noqa: E402

VOCAB = 4096
CONTEXT = 2048
NEW = 4
CHUNK = ["--chunked-prefill-size", "256"]
KV_TOKENS = 3000
STATE_SLOTS = 12


def toks(n: int, seed: int) -> list[int]:
    """Deterministic ids in [4, VOCAB)."""
    return [(i * (2 * seed + 37) + 11 * seed + 5) % (VOCAB - 4) + 4 for i in range(n)]


def workload() -> list[list[int]]:
    """Trace-like patterns, sent in order (later requests reuse earlier ones)."""
    reqs: list[list[int]] = []
    system = toks(200, 1)  # shared system prompt
    reqs += [system + toks(20 + 7 * q, 100 + q) for q in range(4)]
    doc = toks(300, 2)  # doc + several questions
    reqs += [doc + toks(15 + 5 * q, 200 + q) for q in range(3)]
    base = toks(150, 3)  # partial overlaps that split edges
    reqs += [
        base + toks(50, 301),
        base[:100] + toks(60, 302),
        base[:120] + toks(40, 303),
        base + toks(30, 304),
    ]
    return reqs


def session_turns(srv: SGLangServer | NoCacheReference) -> tuple[list[list[int]], list[int]]:
    """A 3-turn session: each turn = previous prompt + its output + new user tokens."""
    prompt = toks(60, 4)
    outs, cached = [], []
    for turn in range(3):
        r = srv.generate(prompt, NEW)
        outs.append(r.output_ids)
        cached.append(r.cached_tokens)
        prompt = prompt + r.output_ids + toks(30, 400 + turn)
    return outs, cached


def server_info(srv: SGLangServer) -> dict:
    return requests.get(f"{srv.url}/server_info", timeout=60).json()


def sparse_stats(srv: SGLangServer) -> dict:
    return srv.sparse_stats()


def assert_one_tree(s: dict) -> None:
    """The policy's mirror equalled SGLang's tree after every checkpoint and eviction (checked in
    the server, ``SGLANG_SPARSE_CHECK_INVARIANTS=1``), and no engine event missed the mirror."""
    assert s["invariant_checks"], "the server must run with SGLANG_SPARSE_CHECK_INVARIANTS=1"
    assert s["invariant_violations"] == 0, s["last_invariant_error"]
    assert s["mirror_errors"] == 0, s
    assert s["policy_states"] == s["states_held"], s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next_sparse"), arch="qwen3_next", seed=0)


def _start(
    model_dir: Path,
    extra: list[str],
    env: dict | None = None,
    *,
    kv_tokens: int = KV_TOKENS,
    state_slots: int = STATE_SLOTS,
) -> SGLangServer:
    # Every sparse server checks the policy mirror against SGLang's tree after each checkpoint and
    # eviction (``sparse_stats(...)["invariant_violations"]`` must stay 0).
    srv = SGLangServer(
        model_dir,
        extra_args=[*CHUNK, *extra],
        env={"SGLANG_SPARSE_CHECK_INVARIANTS": "1", **(env or {})},
        context_length=CONTEXT,
        max_total_tokens=kv_tokens,
        max_mamba_cache_size=state_slots,
    )
    try:
        srv.start(timeout=300)
    except ServerError as exc:
        pytest.fail(f"SGLang CPU server failed to start ({extra}): {exc}")
    return srv


def _workloads(srv: SGLangServer | NoCacheReference, overlap: bool) -> dict:
    """Every sequential workload on ``srv``: outputs and cached tokens of each."""
    res = [srv.generate(p, NEW) for p in workload()]
    sess, sess_cached = session_turns(srv)
    # SGLang #22935 shape (scaled to the tiny model's context): long shared prefix, then 376- and
    # 1296-token different suffixes, then another long suffix.
    prefix = toks(600, 5)
    over = [srv.generate(prefix + toks(n, 500 + i), NEW) for i, n in enumerate((376, 1296, 1290)) if overlap]
    return {
        "outputs": [r.output_ids for r in res],
        "cached": [r.cached_tokens for r in res],
        "session": sess,
        "session_cached": sess_cached,
        "overlap": [r.output_ids for r in over],
        "overlap_cached": [r.cached_tokens for r in over],
    }


@pytest.fixture(scope="module")
def results(model_dir: Path, nocache: NoCacheReference) -> dict[str, dict]:
    """Every sequential workload on sparse and native, one server at a time, and on the session's
    no-cache server."""
    out: dict[str, dict] = {}
    for name, extra in {"sparse": ["--radix-cache-backend", "sparse"], "native": []}.items():
        srv = _start(model_dir, extra)
        try:
            res = _workloads(srv, overlap=True)
            out[name] = {**res, "stats": sparse_stats(srv) if name == "sparse" else None}
        finally:
            srv.stop()
    nocache.check_model(model_dir)
    out["nocache"] = {**_workloads(nocache, overlap=False), "stats": None}
    return out


def test_greedy_tokens_identical_across_caches(results) -> None:
    base = results["nocache"]
    for name in ("sparse", "native"):
        r = results[name]
        assert r["outputs"] == base["outputs"], name
        assert r["session"] == base["session"], name
    assert results["sparse"]["overlap"] == results["native"]["overlap"]
    assert all(c == 0 for c in base["cached"]), base["cached"]


def test_sparse_reuses_prefixes(results) -> None:
    r = results["sparse"]
    print(
        "sparse cached:",
        r["cached"],
        r["session_cached"],
        "native cached:",
        results["native"]["cached"],
        results["native"]["session_cached"],
    )
    assert sum(r["cached"]) > 0
    # On every request of every pattern, sparse reuses at least what the native cache reuses.
    nat = results["native"]
    for mine, theirs in (
        (r["cached"], nat["cached"]),
        (r["session_cached"], nat["session_cached"]),
        (r["overlap_cached"], nat["overlap_cached"]),
    ):
        assert all(a >= b for a, b in zip(mine, theirs, strict=True)), (mine, theirs)
    # Multi-turn: the finish state of turn k is the resume point of turn k+1.
    assert r["session_cached"][1] > 0 and r["session_cached"][2] > r["session_cached"][1], r["session_cached"]
    s = r["stats"]
    assert s["requests"] >= len(workload()) and s["resume_tokens"] > 0
    assert s["resume_tokens"] <= s["kv_hit_tokens"] <= s["input_tokens"]
    assert s["states_held"] <= STATE_SLOTS and s["kv_tokens_held"] <= KV_TOKENS
    assert s["inserts_hinted"] > 0, s  # the server's checkpoint inserts resume at the request's node
    assert_one_tree(s)


def test_partial_overlap_issue_22935(results) -> None:
    sparse, native = results["sparse"]["overlap_cached"], results["native"]["overlap_cached"]
    print(f"#22935 cached tokens (376, 1296, 1290-token suffixes): sparse={sparse} native={native}")
    # Marconi-style admission learns the branch at the first divergence (request 2 captures the
    # chunk-aligned branch point); from then on the long shared prefix is a hit.
    assert sparse[2] > 0, sparse
    assert sparse[2] <= 600


@pytest.fixture(scope="module")
def storm_server(model_dir: Path):
    # A short alpha-tuning window so the storm also exercises the synchronous replay tuner.
    env = {"SGLANG_SPARSE_LOG_EVERY": "50", "SGLANG_SPARSE_TUNE_WINDOW": "50"}
    srv = _start(model_dir, ["--radix-cache-backend", "sparse"], env=env)
    yield srv
    srv.stop()


def _idle(srv: SGLangServer, timeout: float = 60.0) -> dict:
    return srv.wait_sparse_idle(timeout)


def test_concurrent_storm_no_leak(storm_server: SGLangServer) -> None:
    srv = storm_server
    start = sparse_stats(srv)
    prefixes = [toks(40 + 10 * k, 600 + k) for k in range(6)]
    prompts = [prefixes[i % 6][: 20 + (i * 7) % 30] + toks(5 + i % 17, 700 + i) for i in range(200)]

    def one(p: list[int]):
        return srv.generate(p, 2, timeout=600)

    with ThreadPoolExecutor(max_workers=64) as pool:
        outs = list(pool.map(one, prompts))
    assert srv.alive(), srv.log_tail()
    assert all(len(o.output_ids) == 2 for o in outs)
    s = _idle(srv)
    keys = (
        "hit_requests",
        "requests",
        "resume_tokens",
        "kv_hit_tokens",
        "states_held",
        "kv_tokens_held",
        "states_evicted",
        "kv_leaves_evicted",
        "eviction_walks",
        "kv_eviction_walks",
        "alpha",
        "alpha_tunes",
    )
    print("storm stats:", {k: s[k] for k in keys})
    assert s["alpha_tunes"], "alpha=auto should have tuned (window 50)"
    # Budget: what the tree holds fits the pools (no over-subscription).
    assert s["states_held"] <= s["mamba_pool_size"] <= STATE_SLOTS + 1
    assert s["kv_tokens_held"] <= s["kv_pool_size"] <= KV_TOKENS + 1
    # Idle: nothing protected, every slot is free or held by the tree (no leak).
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"], s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    assert s["states_evicted"] + s["kv_leaves_evicted"] > 0, "the storm should have forced evictions"
    assert_one_tree(s)
    # After a flush every slot is back to its start value.
    assert srv.flush_cache()
    s2 = _idle(srv)
    assert s2["kv_available"] == s2["kv_pool_size"] >= start["kv_available"], (start, s2)
    assert s2["mamba_available"] == s2["mamba_pool_size"] >= start["mamba_available"], (start, s2)
    assert s2["states_held"] == 0 and s2["kv_tokens_held"] == 0
    assert_one_tree(s2)
    assert s2["policy_nodes"] == 0


def test_kv_pool_pressure_keeps_tokens_and_returns_every_slot(model_dir: Path) -> None:
    """A KV pool far smaller than the working set (and plenty of state slots): SGLang's KV walk
    runs through :class:`SparseFullComponent`. Greedy tokens must not depend on what was evicted
    (second pass == first pass), and every slot comes back after a flush. (The order of the
    evictions is not observable from the server; tests/test_policy_eviction.py pins it against
    the reference evictor, and tests/serving/test_eviction_walks.py the walks SGLang drives.)"""
    srv = _start(model_dir, ["--radix-cache-backend", "sparse"], kv_tokens=1200, state_slots=48)
    try:
        heads = [toks(180, 900 + k) for k in range(6)]
        prompts = [heads[i % 6] + toks(20 + i % 5, 950 + i) for i in range(18)]
        first = [srv.generate(p, NEW).output_ids for p in prompts]
        second = [srv.generate(p, NEW) for p in prompts]
        assert [r.output_ids for r in second] == first
        s = _idle(srv)
        print(
            "kv pressure stats:", {k: s[k] for k in ("kv_eviction_walks", "kv_leaves_evicted", "states_held")}
        )
        assert s["kv_eviction_walks"] > 0, "the KV pool should have run short"
        assert s["kv_tokens_held"] <= s["kv_pool_size"]
        assert s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"], s
        assert_one_tree(s)
        assert srv.flush_cache()
        s2 = _idle(srv)
        assert s2["kv_available"] == s2["kv_pool_size"] and s2["mamba_available"] == s2["mamba_pool_size"]
    finally:
        srv.stop()


def test_misconfiguration_fails_at_start(model_dir: Path) -> None:
    """The launcher itself exits with code 2 and the message (no subprocess, no SIGKILL)."""
    srv = SGLangServer(
        model_dir,
        extra_args=[*CHUNK, "--radix-cache-backend", "sparse"],
        env={"SGLANG_SPARSE_POLICY": "bogus"},
        context_length=CONTEXT,
        max_total_tokens=KV_TOKENS,
        max_mamba_cache_size=STATE_SLOTS,
    )
    try:
        with pytest.raises(ServerError) as exc:
            srv.start(timeout=300)
    finally:
        srv.stop()
    message = "SGLANG_SPARSE_POLICY='bogus': unknown policy"
    assert message in srv.log_tail(200_000), exc.value
    assert "server not healthy" not in str(exc.value), "should fail fast, not time out"
    assert "exited with code 2" in str(exc.value), exc.value  # a clean exit, not -9
    assert "Scheduler hit an exception" not in srv.log_tail(200_000)  # stopped before any subprocess


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--speculative-algorithm", "NEXTN"], "--speculative-algorithm NEXTN is not supported yet"),
        (["--enable-two-batch-overlap"], "--enable-two-batch-overlap is not supported"),
    ],
    ids=["speculative", "two_batch_overlap"],
)
def test_unsupported_modes_refused_at_launch(model_dir: Path, flags: list[str], message: str) -> None:
    """Serving modes the capture does not serve stop ``launch_server`` with one line naming them
    (exit code 2, before any subprocess)."""
    srv = SGLangServer(
        model_dir,
        extra_args=[*CHUNK, "--radix-cache-backend", "sparse", *flags],
        context_length=CONTEXT,
        max_total_tokens=KV_TOKENS,
        max_mamba_cache_size=STATE_SLOTS,
    )
    try:
        with pytest.raises(ServerError) as exc:
            srv.start(timeout=300)
    finally:
        srv.stop()
    lines = [
        ln
        for ln in srv.log_tail(200_000).splitlines()
        if ln.startswith("error: --radix-cache-backend sparse")
    ]
    assert len(lines) == 1 and message in lines[0], lines
    assert "exited with code 2" in str(exc.value), exc.value


@pytest.mark.parametrize(
    "env,strategy,page,message",
    [
        ({"SGLANG_SPARSE_GAMMA": "2"}, "no_buffer", 1, "SGLANG_SPARSE_GAMMA='2': must be in (0, 1]"),
        ({}, "no_buffer", 16, "needs --page-size 1 (got 16)"),
        (
            {"SGLANG_SPARSE_BRANCH_GRID": "8"},
            "extra_buffer",
            16,
            "SGLANG_SPARSE_BRANCH_GRID=8 must be a multiple of --page-size 16",
        ),
    ],
)
def test_launcher_hook_names_each_misconfiguration(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict,
    strategy: str,
    page: int,
    message: str,
) -> None:
    """The hook the launcher runs on its resolved arguments (``prepare_server_args``; its exit is
    checked end to end above) exits with code 2 and names the problem for each misconfiguration."""
    from types import SimpleNamespace

    from sglang_sparse.sglang_adapter import plugin

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = SimpleNamespace(radix_cache_backend="sparse", disable_radix_cache=False)
    args.mamba_radix_cache_strategy, args.page_size = strategy, page
    with pytest.raises(SystemExit) as exc:
        plugin._server_args_hook(args)  # noqa: SLF001
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_policy_lists_only_serving_policies() -> None:
    from sglang_sparse.sglang_adapter.config import SparseConfig, SparseConfigError

    with pytest.raises(SparseConfigError) as ei:
        SparseConfig.from_env({"SGLANG_SPARSE_POLICY": "bogus"})
    msg = str(ei.value)
    assert "sparse" in msg and "lru" in msg and "marconi" in msg
    assert "oracle" not in msg  # simulator-only: needs the whole trace


@pytest.mark.parametrize(
    "env,message",
    [
        ({"SGLANG_SPARSE_EDGE_BUDGET": "-1"}, "SGLANG_SPARSE_EDGE_BUDGET='-1': must be >= 0"),
        ({"SGLANG_SPARSE_REFRESH": "x"}, "SGLANG_SPARSE_REFRESH='x': expected an integer"),
        ({"SGLANG_SPARSE_ALPHA": "-0.5"}, "SGLANG_SPARSE_ALPHA='-0.5': must be >= 0 or 'auto'"),
        ({"SGLANG_SPARSE_ALPHA": "1", "SGLANG_SPARSE_POLICY": "lru"}, "not FLOP-aware"),
        ({"SGLANG_SPARSE_GRID": "0"}, "SGLANG_SPARSE_GRID='0': must be >= 1"),
        ({"SGLANG_SPARSE_MIN_CUT_GAIN": "-3"}, "SGLANG_SPARSE_MIN_CUT_GAIN='-3': must be >= 0"),
        ({"SGLANG_SPARSE_BRANCH_GRID": "0"}, "SGLANG_SPARSE_BRANCH_GRID='0': must be >= 1"),
        ({"SGLANG_SPARSE_TAIL_GRID": "0"}, "SGLANG_SPARSE_TAIL_GRID='0': must be >= 1"),
        ({"SGLANG_SPARSE_POLICY": "oracle"}, "simulator only"),
        (
            {"SGLANG_SPARSE_HOST_BANDWIDTH": "0"},
            "SGLANG_SPARSE_HOST_BANDWIDTH='0': must be > 0 (bytes per second)",
        ),
        ({"SGLANG_SPARSE_HOST_BANDWIDTH": "fast"}, "SGLANG_SPARSE_HOST_BANDWIDTH='fast': expected a number"),
        (
            {"SGLANG_SPARSE_DEVICE_FLOPS": "-1e12"},
            "SGLANG_SPARSE_DEVICE_FLOPS='-1e12': must be > 0 (FLOP per second)",
        ),
        ({"SGLANG_SPARSE_HOST_COST": "maybe"}, "SGLANG_SPARSE_HOST_COST='maybe': expected 0 or 1"),
        (
            {"SGLANG_SPARSE_DEMOTE": "fifo"},
            "SGLANG_SPARSE_DEMOTE='fifo': unknown demotion order; valid: lru, policy",
        ),
        ({"SGLANG_SPARSE_POLCY": "lru"}, "unknown variable SGLANG_SPARSE_POLCY"),
        (
            {"SGLANG_SPARSE_CONFIG": "/nonexistent.json"},
            "SGLANG_SPARSE_CONFIG='/nonexistent.json': cannot read",
        ),
    ],
)
def test_config_validation_messages(env: dict, message: str) -> None:
    """The exact parser the backend factory runs at start-up (no server needed)."""
    from sglang_sparse.sglang_adapter.config import SparseConfig, SparseConfigError

    with pytest.raises(SparseConfigError, match=None) as exc:
        SparseConfig.from_env(env)
    assert message in str(exc.value)


def test_config_sources(tmp_path: Path) -> None:
    from sglang_sparse.sglang_adapter.config import SparseConfig

    f = tmp_path / "c.json"
    f.write_text('{"policy": "marconi", "gamma": 0.9, "alpha": 0.5}')
    cfg = SparseConfig.from_env({"SGLANG_SPARSE_CONFIG": str(f), "SGLANG_SPARSE_GAMMA": "0.95"})
    assert (cfg.policy, cfg.gamma, cfg.alpha) == ("marconi", 0.95, 0.5)  # env wins over JSON
    assert SparseConfig.from_env({}).alpha_auto
    assert SparseConfig.from_env({}).min_cut_gain is None  # auto: 0 with capture=forward, 32 with cut
    assert SparseConfig.from_env({"SGLANG_SPARSE_MIN_CUT_GAIN": "0"}).min_cut_gain == 0
    assert SparseConfig.from_env({}).branch_grid is None  # auto: the policy's grid
    assert SparseConfig.from_env({"SGLANG_SPARSE_BRANCH_GRID": "64"}).branch_grid == 64
    assert SparseConfig.from_env({}).tail_grid is None  # auto: the policy's grid
    assert SparseConfig.from_env({"SGLANG_SPARSE_TAIL_GRID": "16"}).tail_grid == 16
    from sglang_sparse.sglang_adapter.plugin import _grid_option_problems

    bad = SparseConfig.from_env({"SGLANG_SPARSE_TAIL_GRID": "8", "SGLANG_SPARSE_BRANCH_GRID": "32"})
    assert _grid_option_problems(bad, 16) == [
        "SGLANG_SPARSE_TAIL_GRID=8 must be a multiple of --page-size 16 (the KV match is page-aligned)"
    ]


def test_the_flag_leaves_sglangs_strategy_resolution_alone() -> None:
    """The plugin hooks nothing SGLang resolves ``--mamba-radix-cache-strategy auto``,
    ``--disable-overlap-schedule`` or ``--page-size`` with (``arg_groups``): ``auto`` picks
    extra_buffer and the overlap schedule wherever SGLang would (checked on a real server in
    ``test_sparse_extra_buffer.py::test_default_launch_keeps_sglangs_fast_path``). Its one hook in
    argument handling, on ``prepare_server_args``, only validates (it returns its input)."""
    from types import SimpleNamespace

    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_sparse.sglang_adapter import plugin

    plugin.register()
    ours = {
        target
        for target, hooks in HookRegistry._hooks.items()  # noqa: SLF001
        if any(getattr(h, "__module__", "").startswith("sglang_sparse") for _, h, _ in hooks)
    }
    assert plugin.HOOKS["chat"].target in ours and plugin.HOOKS["track_grid"].target in ours, ours
    # the one argument hook of the package is the CPU plugin's HiCache io backend (sgl_kernel_cpu/hicache.py)
    hicache_io = "sglang.srt.arg_groups.hicache_hook.resolve_layout_io_compatibility"
    assert not [t for t in ours if ".arg_groups." in t and t != hicache_io], ours
    args = SimpleNamespace(radix_cache_backend="radix", page_size=16, mamba_radix_cache_strategy="auto")
    assert plugin._server_args_hook(args) is args

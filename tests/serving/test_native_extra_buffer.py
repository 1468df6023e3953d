"""SGLang's own ``extra_buffer`` Mamba radix-cache strategy, overlap schedule ON, on the CPU.

Native SGLang 0.5.23 (no ``--radix-cache-backend``) serves the tiny random-weight Qwen3-Next with
``--mamba-radix-cache-strategy extra_buffer`` and without ``--disable-overlap-schedule`` at page sizes
1 and 16 (64: ``test_sparse_extra_buffer.py`` runs native_eb there against no cache too), on the
opt-in out-of-tree CPU platform (``SGLANG_PLATFORM=sglang_sparse_cpu``, ``CPU_EXTRA_BUFFER_ENV``;
the in-tree CPU platform fails SGLang's extra_buffer platform gate). Checks,
per page size, one server at a time:

* the resolved arguments (``/server_info``): extra_buffer, overlap on, the page size asked;
* greedy tokens identical to a ``--disable-radix-cache`` server on prefix-sharing patterns (shared
  system prompt + questions, document + questions, partial overlaps, a 600-token prefix prefilled
  in 256-token chunks, a multi-turn session whose turns extend prompt + output, and a concurrent
  burst);
* cached tokens > 0 where prefixes repeat, including a state tracked during decode (every
  ``mamba_track_interval`` = 256 tokens) and one tracked at a chunked-prefill boundary;
* nothing leaked at idle: no KV in use (``/v1/loads``), no mamba slot in use (the pool gauges SGLang
  republishes when the scheduler turns idle), every mamba slot free or held by the tree, and SGLang's
  own strict idle invariant checker (pool conservation, on by default, raises on a leak) plus its
  tree sanity check ran without a report.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(cpu_platform=True)

import requests  # noqa: E402
from sparse_testing.reference import NoCacheReference  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.server import (  # noqa: E402
    CPU_EXTRA_BUFFER_ENV,
    CPU_EXTRA_BUFFER_SERVER_ARGS,
    ServerError,
    SGLangServer,
)

VOCAB = 4096
CONTEXT = 2048
NEW = 4  # new tokens per workload request
SESSION_NEW = 16  # turn 1: 250 prompt tokens + 16 crosses the decode track point 256
CHUNK = ["--chunked-prefill-size", "256"]
KV_TOKENS = 4096
STATE_SLOTS = 24  # mamba pool slots (a running request holds 1 + 2 ping-pong track slots)
PAGES = (1, 16)  # page 64: native_eb in test_sparse_extra_buffer.py
TRACK_INTERVAL = 256  # SGLang's default --mamba-track-interval

#: Strict checks in the extra_buffer servers: SGLang's idle pool conservation check (default on;
#: raises in the scheduler on a leak), its tree-cache sanity check and the busy-time KV check.
CHECK_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
}
_GAUGE = re.compile(r"^sglang:(\w+)\{[^}]*\} ([0-9.eE+-]+)$", re.M)


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def workload() -> list[list[int]]:
    """Sequential prefix-sharing patterns (later requests reuse earlier ones)."""
    reqs: list[list[int]] = []
    system = toks(200, 1)  # shared system prompt + questions
    reqs += [system + toks(20 + 7 * q, 100 + q) for q in range(4)]
    doc = toks(300, 2)  # document + questions (300 > one 256-token prefill chunk)
    reqs += [doc + toks(15 + 5 * q, 200 + q) for q in range(3)]
    base = toks(150, 3)  # partial overlaps that split tree edges
    reqs += [
        base + toks(50, 301),
        base[:100] + toks(60, 302),
        base[:120] + toks(40, 303),
        base + toks(30, 304),
    ]
    return reqs


def long_prefix() -> list[list[int]]:
    """A 600-token prefix with two suffixes (SGLang #22935's shape, scaled down): each request is
    a chunked prefill (256-token chunks), so the second resumes from a state tracked at the end of
    a chunk of the first (512)."""
    prefix = toks(600, 5)
    return [prefix + toks(n, 500 + i) for i, n in enumerate((100, 200))]


def burst() -> list[list[int]]:
    """16 requests over 4 shared prefixes, sent 8 at a time."""
    prefixes = [toks(150, 600 + k) for k in range(4)]
    return [prefixes[i % 4][: 70 + (i * 13) % 80] + toks(5 + i % 11, 700 + i) for i in range(16)]


def run_workloads(
    srv: SGLangServer | NoCacheReference,
    session_prompts: list[list[int]] | None = None,
    *,
    concurrent: bool = True,
) -> dict[str, Any]:
    """Every pattern on ``srv``; the session replays ``session_prompts`` when given (else builds
    each turn as previous prompt + its output + 30 new user tokens); the burst is sent 8 at a time
    (``concurrent``) or one by one."""
    out: dict[str, Any] = {}
    res = [srv.generate(p, NEW) for p in workload()]
    out["workload"] = [r.output_ids for r in res]
    out["workload_cached"] = [r.cached_tokens for r in res]
    res = [srv.generate(p, NEW) for p in long_prefix()]
    out["long"] = [r.output_ids for r in res]
    out["long_cached"] = [r.cached_tokens for r in res]
    prompt, prompts, outs, cached = toks(250, 4), [], [], []
    for turn in range(3):
        if session_prompts is not None:
            prompt = session_prompts[turn]
        prompts.append(prompt)
        r = srv.generate(prompt, SESSION_NEW)
        outs.append(r.output_ids)
        cached.append(r.cached_tokens)
        prompt = prompt + r.output_ids + toks(30, 400 + turn)
    out.update(session=outs, session_cached=cached, session_prompts=prompts)
    with ThreadPoolExecutor(max_workers=8 if concurrent else 1) as pool:
        res = list(pool.map(lambda p: srv.generate(p, NEW, timeout=600), burst()))
    out["burst"] = [r.output_ids for r in res]
    out["burst_cached"] = [r.cached_tokens for r in res]
    # Last: one sequential request, so the final stats SGLang logs come from a decode step with a
    # running request and the pool gauges are republished as soon as the scheduler turns idle.
    out["last"] = srv.generate(toks(40, 9), NEW).output_ids
    return out


def gauges(srv: SGLangServer) -> dict[str, float]:
    return {k: float(v) for k, v in _GAUGE.findall(requests.get(f"{srv.url}/metrics", timeout=60).text)}


def idle_state(srv: SGLangServer, timeout: float = 60.0) -> dict[str, Any]:
    """``/v1/loads`` and the pool gauges once the scheduler is idle (gauges republished)."""
    deadline = time.monotonic() + timeout
    while True:
        load = requests.get(f"{srv.url}/v1/loads", timeout=60).json()["loads"][0]
        g = gauges(srv)
        settled = load["num_running_reqs"] == 0 and g.get("num_running_reqs") == 0
        if (settled and g.get("mamba_used_tokens") == 0) or time.monotonic() > deadline:
            return {"load": load, "gauges": g}
        time.sleep(0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next_eb"), arch="qwen3_next", seed=0)


def _start(srv: SGLangServer) -> SGLangServer:
    try:
        srv.start(timeout=300)
    except ServerError as exc:
        pytest.fail(f"SGLang CPU server failed to start ({srv.cmd[-12:]}): {exc}")
    return srv


@pytest.fixture(scope="module")
def reference(model_dir: Path, nocache: NoCacheReference) -> dict[str, Any]:
    """Greedy tokens from the session's no-cache server (SGLang's in-tree CPU platform, no_buffer)."""
    nocache.check_model(model_dir)
    return run_workloads(nocache, concurrent=False)


@pytest.fixture(scope="module", params=PAGES, ids=lambda p: f"page{p}")
def eb(request: pytest.FixtureRequest, model_dir: Path, reference: dict[str, Any]) -> dict[str, Any]:
    """One extra_buffer server (overlap schedule on) per page size: its resolved arguments, the
    workloads' results and its idle state. The server is stopped before the next page size starts."""
    page = request.param
    srv = _start(
        SGLangServer(
            model_dir,
            base_args=CPU_EXTRA_BUFFER_SERVER_ARGS,
            env={**CPU_EXTRA_BUFFER_ENV, **CHECK_ENV},
            extra_args=["--page-size", str(page), *CHUNK, "--enable-metrics", "--decode-log-interval", "1"],
            context_length=CONTEXT,
            max_total_tokens=KV_TOKENS,
            max_mamba_cache_size=STATE_SLOTS,
        )
    )
    try:
        info = requests.get(f"{srv.url}/server_info", timeout=60).json()
        results = run_workloads(srv, reference["session_prompts"])
        idle = idle_state(srv)
        alive = srv.alive()
        log = srv.log_tail(2_000_000)
    finally:
        srv.stop()
    return {"page": page, "info": info, "results": results, "idle": idle, "alive": alive, "log": log}


def test_resolved_server_args(eb: dict[str, Any]) -> None:
    info = eb["info"]
    assert info["mamba_radix_cache_strategy"] == "extra_buffer"
    assert info["disable_overlap_schedule"] is False  # the overlap schedule runs
    assert info["page_size"] == eb["page"]
    assert info["disable_radix_cache"] is False and info["radix_cache_backend"] is None  # native cache
    assert info["mamba_track_interval"] == TRACK_INTERVAL


def test_greedy_tokens_identical_to_no_cache(eb: dict[str, Any], reference: dict[str, Any]) -> None:
    got = eb["results"]
    for key in ("workload", "long", "session", "last"):
        assert got[key] == reference[key], key
    assert got["burst"] == reference["burst"]  # concurrent and cached == one by one, uncached
    assert not any(reference["workload_cached"] + reference["long_cached"] + reference["session_cached"])


def test_prefixes_are_reused(eb: dict[str, Any]) -> None:
    got = eb["results"]
    print(
        f"page {eb['page']} cached tokens: workload {got['workload_cached']} long {got['long_cached']} "
        f"session {got['session_cached']} burst {got['burst_cached']}"
    )
    w = got["workload_cached"]
    assert all(c >= 192 for c in w[1:4]), w  # system prompt (200 tokens): the 64-grid state at 192
    assert all(c >= 256 for c in w[5:7]), w  # document (300): a prefill state past a chunk
    # Partial overlaps of a 150-token base: base[:100] + 60 finds no state (extra_buffer keeps one
    # state per extend, the last 64-grid point: 192 of base + 50), the later ones reuse 64.
    assert w[9] >= 64 and w[10] >= 64, w
    assert got["long_cached"][1] >= 512, got["long_cached"]  # tracked at a chunked-prefill boundary
    # Turn 1 prefills 250 tokens (prefill state at 192) and decodes past 256: the decode-time track
    # (every mamba_track_interval tokens, copied by the CPU route of _track_mamba_state_decode) is
    # what turn 2 resumes from.
    assert got["session_cached"][1] >= TRACK_INTERVAL, got["session_cached"]
    assert got["session_cached"][2] >= TRACK_INTERVAL, got["session_cached"]
    assert sum(got["burst_cached"]) > 0, got["burst_cached"]


def test_nothing_leaked_at_idle(eb: dict[str, Any]) -> None:
    assert eb["alive"], eb["log"][-6000:]
    load, g = eb["idle"]["load"], eb["idle"]["gauges"]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0, load
    assert load["num_used_tokens"] == 0, load  # KV: every token free or evictable (cached)
    assert g["num_running_reqs"] == 0 and g["kv_used_tokens"] == 0, g
    assert g["mamba_used_tokens"] == 0, g  # no mamba slot held (working, ping-pong track) at idle
    assert g["mamba_available_tokens"] + g["mamba_evictable_tokens"] == STATE_SLOTS, g
    assert g["mamba_evictable_tokens"] > 0, g  # the tree holds states
    # SGLang's strict idle conservation check (KV, mamba and req pools) and tree sanity check raise
    # in the scheduler (the server would be dead) or log on a violation.
    for marker in ("leak detected", "Leak Detected", "Traceback"):
        assert marker not in eb["log"], marker

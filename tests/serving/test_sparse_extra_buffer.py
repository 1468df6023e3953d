"""``--radix-cache-backend sparse`` on SGLang's own fast path: ``extra_buffer``, overlap schedule ON.

The project's opt-in CPU platform (``SGLANG_PLATFORM=sglang_sparse_cpu``, kernels/.../sglang_platform.py)
passes SGLang's extra_buffer platform gate, so the CPU serves the tiny hybrid model the way a GPU
serves Qwen3-Next by default. Per page size (1, 16, 64), one server at a time: native extra_buffer
(``native_eb``, SGLang's GPU default) and ``sparse`` on extra_buffer, both with the overlap schedule,
against a ``--disable-radix-cache`` server:

* greedy tokens identical to no cache on every pattern of ``test_sparse_backend.py`` (shared system
  prompt, document + questions, partial overlaps, SGLang #22935's long-prefix shape) and a 3-turn
  session whose first turn decodes across a state-grid point;
* a session turn that continues the previous one finishes exactly at the end of its key, and the
  next turn resumes there (page-aligned);
* sparse's in-forward captures are published, the policy's mirror equals SGLang's tree after every
  checkpoint and eviction, nothing leaks at idle (SGLang's strict idle checks on), and sparse reuses
  at least as many tokens as native_eb on the whole run;
* the default launch (only ``--radix-cache-backend sparse``) keeps SGLang's fast path: ``auto``
  resolves to extra_buffer with the overlap schedule on (nothing in the flag's path turns it off);
* a 500-request storm with client aborts (20%) against a small state pool: tokens of the completed
  requests identical to no cache, no slot leaked at idle.

About 8 minutes on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(cpu_platform=True)

import requests  # noqa: E402
from sparse_testing.reference import NoCacheReference  # noqa: E402
from sparse_testing.storm import new_tokens, run_storm, storm_prompts  # noqa: E402
from test_sparse_backend import NEW, assert_one_tree, toks, workload  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.server import (  # noqa: E402
    CPU_EXTRA_BUFFER_ENV,
    CPU_EXTRA_BUFFER_SERVER_ARGS,
    CPU_SERVER_ARGS,
    ServerError,
    SGLangServer,
)

CONTEXT = 2048
CHUNK = ["--chunked-prefill-size", "256"]
KV_TOKENS = 3000
STATE_SLOTS = 24
PAGES = (1, 16, 64)
SPARSE = ["--radix-cache-backend", "sparse"]
#: SGLang's strict checks: pool conservation at idle (raises in the scheduler on a leak), tree sanity
CHECK_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
    "SGLANG_SPARSE_CHECK_INVARIANTS": "1",
}


def patterns(srv: SGLangServer | NoCacheReference) -> dict[str, list]:
    """Every sequential pattern; returns prompts, outputs and cached tokens, in order."""
    prompts: list[list[int]] = []
    outs: list[list[int]] = []
    cached: list[int] = []

    def go(p: list[int], n: int = NEW) -> list[int]:
        r = srv.generate(p, n)
        prompts.append(p)
        outs.append(r.output_ids)
        cached.append(r.cached_tokens)
        return r.output_ids

    for p in workload():
        go(p)
    prefix = toks(600, 5)  # SGLang #22935's shape: a long prefix, then different long suffixes
    for i, n in enumerate((376, 1296, 1290)):
        go(prefix + toks(n, 500 + i))
    prompt = toks(250, 4)  # turn 1 decodes across the grid point 256: a decode-time state
    for turn in range(3):
        out = go(prompt, 16)
        prompt = prompt + out + toks(30, 400 + turn)
    return {"prompts": prompts, "outputs": outs, "cached": cached}


def _server(model_dir: Path, extra: list[str], *, env: dict | None = None, **kw: Any) -> SGLangServer:
    """A server on extra_buffer with the overlap schedule (the no-cache reference is the session's)."""
    srv = SGLangServer(
        model_dir,
        extra_args=[*CHUNK, *extra],
        env={**CPU_EXTRA_BUFFER_ENV, **CHECK_ENV, **(env or {})},
        base_args=CPU_EXTRA_BUFFER_SERVER_ARGS,
        context_length=CONTEXT,
        max_total_tokens=kw.pop("kv_tokens", KV_TOKENS),
        max_mamba_cache_size=kw.pop("state_slots", STATE_SLOTS),
    )
    try:
        srv.start(timeout=300)
    except ServerError as exc:
        pytest.fail(f"SGLang CPU server failed to start ({extra}): {exc}")
    return srv


def server_info(srv: SGLangServer) -> dict:
    return requests.get(f"{srv.url}/server_info", timeout=60).json()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next_sparse_eb"), arch="qwen3_next", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path, nocache: NoCacheReference) -> dict[str, list]:
    nocache.check_model(model_dir)
    return patterns(nocache)


@pytest.fixture(scope="module", params=PAGES, ids=lambda p: f"page{p}")
def runs(request: pytest.FixtureRequest, model_dir: Path) -> dict[str, Any]:
    page = ["--page-size", str(request.param)]
    out: dict[str, Any] = {"page": request.param}
    for name, extra in (("native_eb", []), ("sparse", SPARSE)):
        srv = _server(model_dir, [*page, *extra])
        try:
            info = server_info(srv)
            out[name] = patterns(srv)
            out[name]["args"] = {
                k: info.get(k)
                for k in ("mamba_radix_cache_strategy", "disable_overlap_schedule", "page_size")
            }
            if name == "sparse":
                out[name]["stats"] = srv.wait_sparse_idle()
            out[name]["log"] = srv.log_tail(2_000_000)
        finally:
            srv.stop()
    out["prompts"] = out["sparse"]["prompts"]
    return out


def test_tokens_identical_to_no_cache(runs: dict, reference: dict) -> None:
    for name in ("native_eb", "sparse"):
        r = runs[name]
        assert r["args"]["mamba_radix_cache_strategy"] == "extra_buffer", r["args"]
        assert r["args"]["disable_overlap_schedule"] is False, r["args"]
        assert r["args"]["page_size"] == runs["page"], r["args"]
        assert r["outputs"] == reference["outputs"], (name, runs["page"])


def test_sparse_on_extra_buffer_reuses_and_leaks_nothing(runs: dict) -> None:
    sp, nat = runs["sparse"], runs["native_eb"]
    print(f"page {runs['page']} cached: sparse {sp['cached']} native_eb {nat['cached']}")
    s = sp["stats"]
    assert sum(sp["cached"]) >= sum(nat["cached"]) > 0, (sp["cached"], nat["cached"])
    # the session: turn 2 continues turn 1's sequence end, so its plan expects a continuation and
    # it finishes exactly at the end of its key (the exact finish track, capture.refine_decode_tracks): turn 3
    # (296 + 16 tokens, key 311, page-aligned down) resumes there; native_eb stops at its last grid
    # point (256). Turn 1 (a first sight: its finish only on probation) keeps its grid point, as native_eb.
    page = runs["page"]
    assert sp["cached"][-1] == 311 // page * page, sp["cached"]
    assert sp["cached"][-2] >= 256, sp["cached"]
    assert nat["cached"][-2] == 256 and nat["cached"][-1] == 256, nat["cached"]
    assert s["captures_published"] > 0 and s["captures_incomplete"] == 0 and s["captures_pending"] == 0, s
    assert s["captures_reserved"] == (
        s["captures_published"] + s["captures_rejected"] + s["captures_freed"] + s["captures_incomplete"]
    ), s
    assert_one_tree(s)
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    assert s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"], s
    log = sp["log"]
    assert "mamba strategy extra_buffer" in log and "overlap schedule on" in log
    assert "leaked_mamba_pages={" not in log and "Traceback" not in log
    # In-forward capture through SGLang's track copies: no cut, and no forward beyond the chunks the
    # prefilled tokens need (requests are sequential: one prefill batch per 256-token chunk, plus
    # the server's own warm-up, the same on both servers).
    assert s["cuts_applied"] == 0 and s["capture_mode"] == "forward" and s["capture_layout"] == "chunks", s
    prompts = [len(p) for p in runs["prompts"]]
    need = {
        name: sum(-(-(n - c) // 256) for n, c in zip(prompts, runs[name]["cached"], strict=True))
        for name in ("sparse", "native_eb")
    }
    forwards = {name: runs[name]["log"].count("Prefill batch") for name in ("sparse", "native_eb")}
    print(f"page {page} prefill forwards {forwards}, needed {need}")
    assert forwards["sparse"] - need["sparse"] == forwards["native_eb"] - need["native_eb"] >= 0, (
        forwards,
        need,
    )
    assert forwards["sparse"] <= forwards["native_eb"], forwards


STORM = 500


def test_storm_with_aborts_no_leak_tokens_identical(model_dir: Path, nocache: NoCacheReference) -> None:
    """500 concurrent requests over 8 shared heads, every 5th aborted mid-flight, against a 30-slot
    state pool (page 16): no crash, every completed request matches no cache token for token, and at idle
    every slot is free or held by the tree (also after a flush)."""
    prompts = storm_prompts(STORM, toks)
    srv = _server(model_dir, ["--page-size", "16", *SPARSE], state_slots=30)
    try:
        done = run_storm(srv, prompts)
        assert srv.alive(), srv.log_tail()
        s = srv.wait_sparse_idle()
        print(
            f"storm: {len(done)}/{STORM} completed; capture stats",
            {k: v for k, v in s.items() if "capture" in k},
        )
        assert len(done) >= STORM // 2, len(done)
        assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
        assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
        assert s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"], s
        assert s["captures_pending"] == 0 and s["captures_incomplete"] == 0, s
        assert s["captures_published"] > 0 and s["cuts_applied"] == 0, s
        assert_one_tree(s)
        log = srv.log_tail(5_000_000)
        assert "leaked_mamba_pages={" not in log and "Traceback" not in log
        assert srv.flush_cache()
        s2 = srv.sparse_stats()
        assert s2["mamba_available"] == s2["mamba_pool_size"] and s2["states_held"] == 0, s2
    finally:
        srv.stop()
    nocache.check_model(model_dir)
    assert done == {k: nocache.generate(prompts[k], new_tokens(k)).output_ids for k in sorted(done)}


def test_chunk_cut_capture_on_extra_buffer(model_dir: Path, reference: dict) -> None:
    """The chunk-cut path (``SGLANG_SPARSE_CAPTURE=cut``, auto only with a prefill kernel without
    per-chunk states or HiCache write-back: a planned position inside a prefill ends the chunk
    there, and SGLang's own extra_buffer snapshot at the chunk end is the state), at page 16 with
    the overlap schedule: tokens identical to no cache, cuts made, the mirror exact, nothing
    leaked."""
    srv = _server(model_dir, ["--page-size", "16", *SPARSE], env={"SGLANG_SPARSE_CAPTURE": "cut"})
    try:
        got = patterns(srv)
        s = srv.wait_sparse_idle()
        log = srv.log_tail(2_000_000)
    finally:
        srv.stop()
    assert got["outputs"] == reference["outputs"]
    print("cut on extra_buffer: cached", got["cached"], "cuts", s["cuts_applied"])
    assert s["cuts_applied"] > 0 and sum(got["cached"]) > 0, s
    assert_one_tree(s)
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    assert "capture=cut" in log and "Traceback" not in log


def test_default_launch_keeps_sglangs_fast_path(model_dir: Path) -> None:
    """Only ``--radix-cache-backend sparse`` (no strategy, no overlap flag): SGLang's ``auto``
    picks extra_buffer with the overlap schedule on, as it does without the flag.

    On that server, the tail prior learns (SGLang splits the edge where a match ends, so the match
    ends one node above the leaf it diverged from) and plans first-sight states: after two prompts
    each seen twice (the user turn diverges ~20 tokens before the end), the *second* request on a
    third, longer prompt resumes at its divergence itself (700 for a 700-token prompt: with
    in-forward capture the tail prior's positions are page-exact, on the grid below they would be
    640). SGLang's own extra_buffer keeps chunk-end states only (512 here)."""

    def run(srv: SGLangServer) -> list[int]:
        out = []
        for k, head in enumerate((300, 420, 700)):
            prefix = toks(head, 60 + k)
            for q in range(2):
                out.append(srv.generate(prefix + toks(18 + q, 70 + 10 * k + q), 1).cached_tokens)
        return out

    drop = {"--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"}
    srv = SGLangServer(
        model_dir,
        extra_args=[*CHUNK, *SPARSE],
        env={**CPU_EXTRA_BUFFER_ENV, **CHECK_ENV},
        base_args=[a for a in CPU_SERVER_ARGS if a not in drop],
        context_length=CONTEXT,
        max_total_tokens=KV_TOKENS,
        max_mamba_cache_size=32,
    )
    try:
        srv.start(timeout=300)
        info = server_info(srv)
        sparse = run(srv)
        log = srv.log_tail(2_000_000)
    finally:
        srv.stop()
    assert info["radix_cache_backend"] == "sparse"
    assert info["mamba_radix_cache_strategy"] == "extra_buffer", info["mamba_radix_cache_strategy"]
    assert info["disable_overlap_schedule"] is False
    assert "mamba strategy extra_buffer (SGLang's fast path: overlap schedule on" in log
    native_srv = _server(model_dir, [], state_slots=32)
    try:
        native = run(native_srv)
    finally:
        native_srv.stop()
    print("tail prior: cached sparse", sparse, "native_eb", native)
    assert sparse[5] == 700, sparse
    assert native[5] < 640, native

"""``--radix-cache-backend sparse`` on a Mamba2 hybrid (tiny Nemotron-H) on the real CPU server.

The model: attention, Mamba2 and MLP blocks (``M-M*M-``), SSM chunk 128 (real Mamba2 checkpoints use
128-256), so SGLang's state grid is ``lcm(128, page)``; the plans' grid stays ``lcm(64, page)`` (the
capture recomputes exact states inside an SSM chunk).
SGLang's Mamba2 kernels run through the project's CPU stand-ins (``sgl_kernel_cpu/mamba2.py``).

* Four servers, one at a time: native and sparse on no_buffer, native and sparse on extra_buffer
  (overlap schedule on, page 16), each on every sequential pattern of ``test_sparse_backend.py``
  (shared system prompt, document + questions, partial overlaps, SGLang #22935's shape, a 3-turn
  session): greedy tokens identical to a ``--disable-radix-cache`` server and (first prompts) to
  HF transformers; sparse's captures are written in the forward by SGLang's own Mamba2 track
  copies (``capture_layout`` flat: per-chunk states on the grid, the scan's exact recompute off
  it; none incomplete, no cut) and it runs no prefill forward beyond the chunks its prefilled
  tokens need (as native does).
* A 500-request storm with client aborts against a small state pool (extra_buffer, page 16): tokens
  of the completed requests identical to no cache, nothing leaked at idle.
* A 300-turn session on extra_buffer: the mirror never drifts, every later turn resumes near the
  previous sequence's end, sampled turns identical to no cache.

About 10 minutes on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(cpu_platform=True)

from sparse_testing.reference import NoCacheReference  # noqa: E402
from sparse_testing.storm import new_tokens, run_storm, storm_prompts  # noqa: E402
from test_sparse_backend import NEW, assert_one_tree, toks, workload  # noqa: E402

from sglang_sparse.testing.server import SGLangServer, strategy_setup  # noqa: E402
from sglang_sparse.testing.sessions import mismatches, run_sessions, sample_turns  # noqa: E402

ARCH = "nemotron_h"
SSM_CHUNK = 128  # the model's mamba_chunk_size: SGLang's state grid lcm(128, page)
MODEL = {"mamba_chunk_size": SSM_CHUNK}
CONTEXT = 4096
CHUNK = ["--chunked-prefill-size", "256"]
KV_TOKENS = 6000
STATE_SLOTS = 24
PAGE = 16
SPARSE = ["--radix-cache-backend", "sparse"]
CHECK_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
    "SGLANG_SPARSE_CHECK_INVARIANTS": "1",
}
CONFIGS = {  # name: (strategy, extra flags)
    "native_nb": ("no_buffer", []),
    "sparse_nb": ("no_buffer", SPARSE),
    "native_eb": ("extra_buffer", ["--page-size", str(PAGE)]),
    "sparse_eb": ("extra_buffer", ["--page-size", str(PAGE), *SPARSE]),
}


@pytest.fixture(scope="module")
def reference(nemotron_reference: NoCacheReference) -> NoCacheReference:
    """The session's ``--disable-radix-cache`` server on the tiny Nemotron-H (``conftest.py``)."""
    return nemotron_reference


@pytest.fixture(scope="module")
def model_dir(reference: NoCacheReference) -> Path:
    """The reference's checkpoint: every server of this module serves the same weights."""
    return reference.model_dir


def _server(model_dir: Path, strategy: str, extra: list[str], **kw: Any) -> SGLangServer:
    base, env = strategy_setup(strategy)
    return SGLangServer(
        model_dir,
        base_args=base,
        extra_args=[*CHUNK, *extra],
        env={**env, **CHECK_ENV, **kw.pop("env", {})},
        context_length=CONTEXT,
        max_total_tokens=kw.pop("kv_tokens", KV_TOKENS),
        max_mamba_cache_size=kw.pop("state_slots", STATE_SLOTS),
    ).start(timeout=300)


def patterns(srv: SGLangServer | NoCacheReference) -> dict[str, list]:
    """Every sequential pattern of ``test_sparse_backend.py``; prompts, outputs, cached tokens."""
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
    prefix = toks(600, 5)  # SGLang #22935's shape
    for i, n in enumerate((376, 1296, 1290)):
        go(prefix + toks(n, 500 + i))
    prompt = toks(250, 4)  # a 3-turn session whose first turn decodes across a grid point
    for turn in range(3):
        out = go(prompt, 16)
        prompt = prompt + out + toks(30, 400 + turn)
    return {"prompts": prompts, "outputs": outs, "cached": cached}


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, (strategy, extra) in CONFIGS.items():
        with _server(model_dir, strategy, extra) as srv:
            out[name] = patterns(srv)
            if "sparse" in name:
                out[name]["stats"] = srv.wait_sparse_idle()
            out[name]["log"] = srv.log_tail(2_000_000)
    return out


def test_tokens_identical_to_no_cache_and_hf(
    runs: dict, reference: NoCacheReference, model_dir: Path
) -> None:
    want = patterns(reference)["outputs"]
    for name in CONFIGS:
        assert runs[name]["outputs"] == want, name
    from sparse_testing.engine import HFReference

    hf = HFReference(model_dir)
    prompts = runs["sparse_eb"]["prompts"]
    for k in (0, 4, 7):  # one of each workload pattern, all on the SSM path end to end
        assert hf.greedy(prompts[k], NEW) == want[k], k


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_sparse_captures_in_the_forward_on_mamba2(runs: dict, strategy: str) -> None:
    tag = "nb" if strategy == "no_buffer" else "eb"
    sp, nat = runs[f"sparse_{tag}"], runs[f"native_{tag}"]
    s = sp["stats"]
    print(f"{strategy} cached: sparse {sp['cached']} native {nat['cached']}")
    print(f"{strategy} capture stats:", {k: v for k, v in s.items() if "capture" in k})
    assert sum(sp["cached"]) >= sum(nat["cached"]) > 0, (sp["cached"], nat["cached"])
    assert s["capture_mode"] == "forward" and s["capture_layout"] == "flat", s
    assert s["captures_published"] > 0 and s["captures_incomplete"] == 0 and s["captures_pending"] == 0, s
    assert s["cuts_applied"] == 0 and s["capture_tails"] == 0, s  # Mamba2 recomputes off-grid states
    # states off the 128-token SSM grid were captured and resumed from (the scan's exact recompute)
    assert any(c % SSM_CHUNK for c in sp["cached"]), sp["cached"]
    need = {
        name: sum(
            -(-(len(p) - c) // 256) for p, c in zip(runs[name]["prompts"], runs[name]["cached"], strict=True)
        )
        for name in (f"sparse_{tag}", f"native_{tag}")
    }
    forwards = {name: runs[name]["log"].count("Prefill batch") for name in need}
    print(f"{strategy} prefill forwards {forwards}, needed {need}")
    # no forward beyond the chunks its prefilled tokens need (the warm-up aside, as native): the
    # capture adds none; how many chunks each needs is the policy's (what it resumes from)
    assert (
        forwards[f"sparse_{tag}"] - need[f"sparse_{tag}"] == forwards[f"native_{tag}"] - need[f"native_{tag}"]
    )
    assert_one_tree(s)
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    assert "leaked_mamba_pages={" not in sp["log"] and "Traceback" not in sp["log"]


STORM = 500


def test_storm_with_aborts_on_mamba2(model_dir: Path, reference: NoCacheReference) -> None:
    """500 concurrent requests over 8 shared heads, every 5th aborted mid-flight, against a 30-slot
    state pool (extra_buffer, page 16): no crash, tokens of every completed request identical to no
    cache, and at idle every slot is free or held by the tree (also after a flush)."""
    prompts = storm_prompts(STORM, toks)
    with _server(model_dir, "extra_buffer", ["--page-size", str(PAGE), *SPARSE], state_slots=30) as srv:
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
        assert s["captures_pending"] == 0 and s["captures_incomplete"] == 0 and s["cuts_applied"] == 0, s
        assert s["captures_published"] > 0, s
        assert_one_tree(s)
        log = srv.log_tail(5_000_000)
        assert "leaked_mamba_pages={" not in log and "Traceback" not in log
        assert srv.flush_cache()
        s2 = srv.sparse_stats()
        assert s2["mamba_available"] == s2["mamba_pool_size"] and s2["states_held"] == 0, s2
    assert done == {k: reference.generate(prompts[k], new_tokens(k)).output_ids for k in sorted(done)}


TURNS = 300


def test_300_turn_session_on_mamba2(model_dir: Path, reference: NoCacheReference) -> None:
    """One 300-turn chain on extra_buffer (page 16): every turn whose previous sequence crosses a
    state-grid point resumes within one grid step of that sequence's end, the mirror never
    drifts, nothing leaks, sampled turns identical to no cache."""
    env = {"SGLANG_SPARSE_TUNE_WINDOW": "50"}
    extra = ["--page-size", str(PAGE), *SPARSE]
    with _server(model_dir, "extra_buffer", extra, env=env, state_slots=16) as srv:
        chain = run_sessions(lambda p, n: srv.generate(p, n), sessions=1, turns=TURNS, seed=1)
        assert srv.alive(), srv.log_tail()
        s = srv.wait_sparse_idle()
    cached, prompts = chain.cached[0], chain.prompts[0]
    late = [k for k in range(1, TURNS) if len(prompts[k - 1]) + 2 >= 2 * SSM_CHUNK]
    assert late and all(cached[k] >= len(prompts[k - 1]) + 2 - SSM_CHUNK - 1 for k in late), cached[:40]
    assert sum(cached[1:]) >= 0.9 * sum(len(p) for p in prompts[1:])
    assert s["invariant_violations"] == 0 and s["mirror_errors"] == 0, s
    assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
    assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
    assert s["captures_incomplete"] == 0 and s["cuts_applied"] == 0, s
    assert mismatches(chain, reference.generate, sample_turns(TURNS, head=4, every=75), [0]) == []


OTHER_FAMILIES = ("falcon_h1", "granite_moe_hybrid")
#: the other families' storm (requests) and session (turns)
OTHER_STORM, OTHER_TURNS = STORM // 4, TURNS // 3


@pytest.mark.parametrize("arch", OTHER_FAMILIES)
def test_other_mamba2_families(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Falcon-H1 (attention and Mamba2 in every layer) and Granite-4.0-H: every pattern on
    no_buffer and on extra_buffer (page 16), then on the extra_buffer server a storm with aborts and
    a long session, each a quarter / a third of Nemotron-H's (the same code path: their sizes keep
    CI under its hour); tokens identical to the family's no-cache server on all of it, captures
    published with none incomplete and no cut, nothing leaked at idle."""
    ref = NoCacheReference(tmp_path_factory.mktemp(f"nocache_{arch}"), arch=arch, **MODEL)
    try:
        want = patterns(ref)["outputs"]
        for strategy, extra in (("no_buffer", SPARSE), ("extra_buffer", ["--page-size", str(PAGE), *SPARSE])):
            with _server(ref.model_dir, strategy, extra, state_slots=30) as srv:
                got = patterns(srv)
                assert got["outputs"] == want, (arch, strategy)
                if strategy == "extra_buffer":
                    prompts = storm_prompts(OTHER_STORM, toks)
                    done = run_storm(srv, prompts)
                    assert srv.alive(), srv.log_tail()
                    srv.wait_sparse_idle()
                    chain = run_sessions(
                        lambda p, n: srv.generate(p, n), sessions=1, turns=OTHER_TURNS, seed=1
                    )
                s = srv.wait_sparse_idle()
                log = srv.log_tail(5_000_000)
            print(
                f"{arch} {strategy}:", {k: v for k, v in s.items() if "capture" in k or k == "cuts_applied"}
            )
            assert s["capture_layout"] == "flat" and s["captures_published"] > 0, s
            assert s["captures_incomplete"] == 0 and s["captures_pending"] == 0 and s["cuts_applied"] == 0, s
            assert_one_tree(s)
            assert s["kv_protected"] == 0 and s["mamba_protected"] == 0, s
            assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
            assert "leaked_mamba_pages={" not in log and "Traceback" not in log
        assert len(done) >= OTHER_STORM // 2, len(done)
        assert done == {k: ref.generate(prompts[k], new_tokens(k)).output_ids for k in sorted(done)}
        assert sum(chain.cached[0][1:]) >= 0.9 * sum(len(p) for p in chain.prompts[0][1:])
        assert mismatches(chain, ref.generate, sample_turns(OTHER_TURNS, head=4, every=25), [0]) == []
    finally:
        ref.stop()

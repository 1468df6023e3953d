"""The scheduler-cache harness of ``benchmarks/scheduler_cache.py`` drives SGLang's real caches
correctly: native (default tree core) and ``sparse`` (built through its registered factory), a few
hundred tokens per prompt, tiny pools. One subprocess (its own published ``ServerArgs``), ~30 s."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sparse_testing.child import REPO, child_env, run_tagged_child
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(("torch", "sglang", "transformers"))

CONFIGS = ("native", "native_python", "sparse")


@pytest.fixture(scope="module")
def smoke() -> dict[str, dict]:
    args = [str(REPO / "benchmarks" / "scheduler_cache.py"), "--smoke", "--configs", ",".join(CONFIGS)]
    return run_tagged_child(args, "SMOKE", drop_env=("SGLANG_SPARSE_",))


@pytest.mark.parametrize("name", CONFIGS)
def test_hits_after_repeat_and_turn(smoke: dict[str, dict], name: str) -> None:
    r = smoke[name]
    assert r["first"] == 0, r  # an empty cache
    assert r["repeat"] > 0, r  # the repeat resumes from a cached state
    assert r["turn"] > 0, r  # so does the next turn
    if name.startswith("native"):
        # no_buffer checkpoints the state at the finish: the next turn resumes there
        assert r["turn"] == r["turn_prefix_len"], r
    assert r["repeat_after_pressure"] > 0, r  # the most recent prompt survived eviction


@pytest.mark.parametrize("name", CONFIGS)
def test_pools_free_after_evict_all_and_flush(smoke: dict[str, dict], name: str) -> None:
    r = smoke[name]
    assert r["evict_ms"] > 0, r  # the small pools made the harness evict
    assert r["free_after_evict_all"] == r["pool_sizes"], r  # nothing leaked: the tree held it all
    assert r["free_after_flush"] == r["pool_sizes"], r


def test_cores_and_backends(smoke: dict[str, dict]) -> None:
    assert smoke["native_python"]["tree_core"] == "UnifiedTreeCore"
    assert smoke["native"]["cache_class"] == "UnifiedRadixCache"
    assert smoke["sparse"]["cache_class"] != "UnifiedRadixCache"  # the registered factory's class


def test_request_path_tool_traces_a_warm_request_through_the_adapter() -> None:
    """``tools/request_path.py`` (the count in docs/architecture.md): a repeat of a cached
    document resumes from a state, and its calls reach the adapter, the mirror and the policy."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "request_path.py"), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(("SGLANG_SPARSE_",)),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert 0 < res["cached_tokens"] < res["prompt_tokens"]
    files = set(res["files"])
    for f in (
        "sglang_adapter/cache.py",
        "sglang_adapter/tree_policy.py",
        "tree/mirror.py",
        "policy/cache.py",
        "policy/choose.py",
        "policy/evict.py",
    ):
        assert f"sglang_sparse/{f}" in files, sorted(files)
    assert all(a in files and b in files and a != b for a, b in res["cross_file_edges"])
    # a stage per module: every file the request reaches is a module of one of the layers, and
    # the adapter hands over to the policy layer only through tree_policy.py (the other edges of
    # sglang_adapter/ stay inside it); module sizes: tests/test_import_graph.py
    layers = ("placement", "tree", "policy", "sim", "sglang_adapter")
    assert all(f.split("/")[1] in layers for f in files), sorted(files)
    out_of_adapter = {
        a
        for a, b in res["cross_file_edges"]
        if a.startswith("sglang_sparse/sglang_adapter/") and "/sglang_adapter/" not in b
    }
    assert out_of_adapter == {"sglang_sparse/sglang_adapter/tree_policy.py"}, res["cross_file_edges"]

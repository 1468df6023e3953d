"""``benchmarks/serving_load.py`` end to end on the CPU: a tiny cell (doc_qa, 4 short requests,
``sparse`` vs ``nocache`` as the ratio baseline, 2 interleaved repetitions, one Poisson rate) through
SGLang's own client; checks the JSON fields, token equality (under load and the sequential greedy
pass) and the spread/ratio bookkeeping. About 2 minutes on 2 cores (two server starts dominate)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack()

from benchmarks import serving_load  # noqa: E402


def _ensure_doc_qa_trace() -> None:
    """Build the doc_qa trace into ``traces/build`` (git-ignored, what the main job does) when a
    clean checkout has not built it yet; skip only when the real data is not on this machine."""
    if (serving_load.TRACES / "doc_qa.jsonl").exists():
        return
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "sglang_sparse.traces", "build", "doc_qa", "--quiet"]
    proc = subprocess.run(cmd + ["--out", str(serving_load.TRACES)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(
            f"doc_qa trace not built and cannot be built here: {proc.stderr.strip()[-500:]}",
            allow_module_level=True,
        )


_ensure_doc_qa_trace()


def test_tiny_cell_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "serving_load.json"
    argv = [
        "--workloads", "doc_qa",
        "--configs", "sparse,nocache",
        "--baselines", "nocache",
        "--reps", "2",
        "--requests", "4",
        "--target-len", "128",
        "--output-len", "8",
        "--rates", "4",
        "--max-concurrency", "0",
        "--equality", "always",
        "--work-dir", str(tmp_path / "work"),
        "--out", str(out),
    ]  # fmt: skip
    assert serving_load.main(argv) == 0
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    assert doc["benchmark"] == "serving_load" and doc["reps"] == 2 and doc["command"].startswith("python -m")
    assert set(doc["configs"]) == {"sparse", "nocache"} and doc["baselines"] == ["nocache"]
    w = doc["workloads"]["doc_qa"]

    # workload, accounting and pools
    assert w["dataset"] == "custom" and w["requests"] == 4
    acc, pools = w["accounting"], w["pools"]
    assert 0 < acc["perfect_prefilled"] <= acc["prompt_tokens"]
    assert acc["perfect_prefilled"] <= acc["footprint_tokens"] <= acc["prompt_tokens"] + 4 * 8
    assert pools["max_total_tokens"] >= 2 * acc["max_seq"]
    assert pools["kv_fraction"] == pytest.approx(pools["max_total_tokens"] / acc["footprint_tokens"])
    assert pools["max_mamba_cache_size"] == pools["state_working_slots"] + math_ceil(
        0.4 * acc["reuse_points"]
    )
    assert w["perfect_cache"]["prefilled_tokens"] == acc["perfect_prefilled"]

    # runs: every (config, rep), rotated, requests in trace order, tokens consistent
    runs = w["runs"]
    assert sorted((r["config"], r["rep"]) for r in runs) == [
        ("nocache", 0),
        ("nocache", 1),
        ("sparse", 0),
        ("sparse", 1),
    ]
    first = {r["rep"]: r["config"] for r in runs if r["position"] == 0}
    assert first[0] != first[1]  # the order rotates between repetitions
    for r in runs:
        assert r["completed"] == 4 and r["order_mismatches"] == 0
        assert r["prompt_tokens"] == acc["prompt_tokens"]
        assert r["prefilled_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        assert r["prefilled_tokens"] >= acc["perfect_prefilled"]
        for k in serving_load.METRICS:
            assert r[k] is not None, k
        if r["config"] == "nocache":
            assert r["cached_tokens"] == 0 and "sparse" not in r
        else:
            assert r["sparse"]["finished"] == 4 and r["sparse"]["mirror_errors"] == 0
            assert r["sparse"]["resume_tokens"] == r["cached_tokens"]

    # token equality: under load and in the sequential greedy pass
    eq = w["equality"]
    assert eq["load"]["sparse"] == {"compared": 8, "mismatched": 0}
    assert eq["nocache_self"]["mismatched"] == 0 and eq["all_equal"] is True
    assert w["sequential_equality"]["configs"]["sparse"] == {"compared": 4, "mismatched": 0}

    # summary: medians/spreads over the repetitions, ratios from per-repetition pairs
    cell = w["summary"]["4/s"]
    ttft = cell["configs"]["sparse"]["median_ttft_ms"]
    assert ttft["n"] == 2 and ttft["lo"] <= ttft["median"] <= ttft["hi"]
    assert ttft["median"] == pytest.approx(statistics.median(ttft["values"]))
    ratio = cell["ratios"]["nocache"]["sparse"]["median_ttft_ms"]
    by = {(r["config"], r["rep"]): r["median_ttft_ms"] for r in runs}
    expect = [by[("sparse", i)] / by[("nocache", i)] for i in range(2)]
    assert ratio["per_rep"] == pytest.approx(expect)
    assert ratio["lo"] == pytest.approx(min(expect)) and ratio["hi"] == pytest.approx(max(expect))
    excl = min(expect) > 1 or max(expect) < 1
    assert ratio["claim"] == ("n.s." if not excl else "higher" if min(expect) > 1 else "lower")
    assert ratio["sign_test_p"] == 0.5
    pre = cell["ratios"]["nocache"]["sparse"]["prefilled_tokens"]
    assert pre["hi"] <= 1.0  # a cache never prefills more than no cache


def math_ceil(x: float) -> int:
    import math

    return max(1, math.ceil(x))

"""Pure helpers of the serving benchmark (no server): the trace shrink and the perfect-cache bound."""

from __future__ import annotations

from benchmarks.serving import ideal_prefilled, shrink


def test_perfect_cache_bound_counts_only_tokens_no_earlier_prompt_shares() -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 9], [1, 2, 3, 4], [7]]
    # 4 new; 1 new after the shared [1, 2]; a repeat still computes its last token; 1 new
    assert ideal_prefilled(prompts) == 4 + 1 + 1 + 1
    assert ideal_prefilled([]) == 0


def test_shrink_keeps_shared_heads_shared_and_tails_verbatim() -> None:
    head = list(range(100, 400))
    a = shrink(head + [1, 2, 3], stride=3, tail=3, max_len=1000, vocab=50)
    b = shrink(head + [4, 5, 6], stride=3, tail=3, max_len=1000, vocab=50)
    assert len(a) == 100 + 3 and a[:100] == b[:100] and a[100:] != b[100:]
    assert all(4 <= x < 50 for x in a + b)


def test_summary_compares_each_config_with_both_native_baselines() -> None:
    from benchmarks.serving import baseline_of, summarize

    def rows(cached: list[int], strategy: str = "no_buffer") -> dict:
        r = [{"ttft": 1.0, "prompt": 100, "cached": c, "token": [1]} for c in cached]
        return {"strategy": strategy, "t": {"rows": r}}

    results = {
        "nocache": rows([0, 0, 0]),
        "native": rows([0, 50, 50]),
        "native_eb": rows([0, 40, 64], "extra_buffer"),
        "sparse": rows([0, 0, 90], "extra_buffer"),
    }
    s = summarize(results, ["t"], {"t": 150})["t"]
    # cumulative prefilled: native 100, 150, 200; sparse 100, 200, 210 -> worse at prefixes 2 and 3
    assert s["sparse"]["prefixes_worse_than_native"] == [2, 3]
    assert s["native"]["prefixes_worse_than_native"] == []
    # native prefills 200, a perfect cache 150: sparse (210) saves -10 of the 50 possible
    assert s["sparse"]["share_of_perfect_saving_vs_native"] == -10 / 50
    # native_eb prefills 100, 160, 196: sparse is worse at 2 and 3, and saves -14 of the 46 possible
    assert s["sparse"]["prefixes_worse_than_native_eb"] == [2, 3]
    assert s["sparse"]["share_of_perfect_saving_vs_native_eb"] == -14 / 46
    assert s["sparse"]["strategy"] == "extra_buffer" and baseline_of("extra_buffer") == "native_eb"
    assert s["perfect_cache_bound"]["prefilled_vs_native_eb"] == 150 / 196


def test_footprint_counts_each_distinct_prefix_once() -> None:
    from benchmarks.serving import footprint_tokens

    # [1,2,3,4] 4; [1,2,9] adds 9; a repeat adds nothing; [7] 1
    assert footprint_tokens([[1, 2, 3, 4], [1, 2, 9], [1, 2, 3, 4], [7]]) == 6
    assert footprint_tokens([]) == 0


def test_hicache_sizing_shares_with_a_device_floor_of_one_request() -> None:
    from benchmarks.serving import hicache_sizing

    # 20 disjoint 500-token prompts: footprint 10,000; 10% = 1,000 >= 500 + 64; host 5,000
    big = [[i * 1000 + j for j in range(500)] for i in range(20)]
    s = hicache_sizing(big)
    assert s["footprint_tokens"] == 10_000 and s["device_tokens"] == 1024  # 1,000 rounded up to 64
    assert s["hicache_ratio"] == round(5000 / 1024, 2) and s["state_slots"] == 8
    # one long prompt: the device holds it (+ margin, aligned), the ratio never falls to 1
    s = hicache_sizing([list(range(3000))])
    assert s["device_tokens"] == 3072 and s["hicache_ratio"] == 1.25
    assert hicache_sizing(big * 10)["state_slots"] == 20


def test_hicache_summary_acceptance() -> None:
    from benchmarks.serving import hicache_summary

    def rows(cached: list[int], tok: int = 1) -> dict:
        return {"rows": [{"ttft": 1.0, "prompt": 100, "cached": c, "token": [tok]} for c in cached]}

    results = {
        "nocache": rows([0, 0, 0]),
        "native_eb_hicache": rows([0, 40, 64]),  # 100, 160, 196
        "sparse_hicache": rows([0, 50, 50]),  # 100, 150, 200: above at prefix 3
        "sparse_small": rows([0, 30, 30]),  # 100, 170, 240
    }
    s = hicache_summary(results, ideal=150)
    a = s["acceptance"]
    assert s["configs"]["sparse_hicache"]["prefixes_worse_than_native_eb_hicache"] == [3]
    assert a["first_prefix_above"] == 3 and not a["sparse_hicache_never_above_native_eb_hicache"]
    assert a["sparse_hicache_below_sparse_small"] and a["tokens_equal_nocache"]
    assert s["configs"]["sparse_hicache"]["share_of_perfect_saving_vs_native_eb_hicache"] == -4 / 46
    results["sparse_hicache"] = rows([0, 50, 70], tok=2)
    a = hicache_summary(results)["acceptance"]
    assert a["sparse_hicache_never_above_native_eb_hicache"] and a["first_prefix_above"] is None
    assert not a["tokens_equal_nocache"]


def test_ttft_fit_names_requests_far_above_the_no_cache_line() -> None:
    """The no-cache server's TTFT is fit as ``a + b * prefilled``; a cached configuration's request
    is an outlier when its TTFT exceeds 3x the line at its own prefilled tokens."""
    from benchmarks.serving import ttft_fit

    def row(prompt: int, cached: int, ttft: float) -> dict:
        return {"prompt": prompt, "cached": cached, "ttft": ttft, "token": [1]}

    line = lambda n: 0.03 + 70e-6 * n  # noqa: E731 - 30 ms + 70 us/token
    nocache = [row(n, 0, line(n)) for n in (100, 400, 800, 1600)]
    cached = [row(900, 800, line(100)), row(900, 850, 4 * line(50)), row(900, 0, 2.5 * line(900))]
    fit = ttft_fit({"nocache": {"t": {"rows": nocache}}, "sparse": {"t": {"rows": cached}}}, ["t"])
    assert abs(fit["intercept_s"] - 0.03) < 1e-9 and abs(fit["slope_s_per_token"] - 70e-6) < 1e-12
    assert fit["r2"] > 0.999
    out = fit["configs"]["sparse"]["t"]
    assert [o[0] for o in out["outliers"]] == [1] and abs(out["max_ratio"] - 4.0) < 1e-9
    assert fit["configs"]["nocache"]["t"]["outliers"] == []


def test_parse_time_stats_reads_sglangs_request_time_lines() -> None:
    from benchmarks.serving import parse_time_stats

    log = (
        "[2026-12-02 03:00:00] ReqTimeStats(rid=doc_qa-3, input_len=936, cached_input_len=832, "
        "output_len=1, attempts=1, type=unified): queue_duration=1.25ms, forward_duration=40.50ms, "
        "entry_time=2026-12-02 03:00:00.000\n"
        "[2026-12-02 03:00:01] Prefill batch, #new-seq: 1\n"
        "[2026-12-02 03:00:02] ReqTimeStats(rid=system_prompts-10, input_len=5, cached_input_len=0, "
        "output_len=1, attempts=1, type=unified): queue_duration=0.10ms, "
        "forward_duration=3.00ms, entry_time=x\n"
    )
    got = parse_time_stats(log)
    assert got.keys() == {"doc_qa-3", "system_prompts-10"}
    assert got["doc_qa-3"] == (0.00125, 0.0405) and got["system_prompts-10"] == (0.0001, 0.003)


def test_foreign_load_counts_other_processes_and_the_server_once() -> None:
    """A busy process that is not the server is foreign load even when this benchmark launched it;
    the server's CPU is its own column, not subtracted twice (which hid all foreign load)."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from benchmarks.serving import ForeignLoad

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\ntime.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", busy])
    other = subprocess.Popen([sys.executable, "-c", busy])
    try:
        load = ForeignLoad(SimpleNamespace(proc=server))
        time.sleep(2.5)
        got = load.stop()
    finally:
        for p in (server, other):
            p.kill()
            p.wait()
    assert got["server_cpu_s"] > 0.5, got
    assert got["foreign_cpu_s"] > 0.5, got
    assert 0 < got["share"] <= 1, got

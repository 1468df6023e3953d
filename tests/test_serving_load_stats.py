"""Pure helpers of ``benchmarks/serving_load.py`` and ``benchmarks/stats.py``: spread, paired
ratios, the "n.s." rule, the bootstrap, the client-order trick, cache accounting, pool sizing and
the summaries (no server)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from benchmarks.bench_client import check_row
from benchmarks.serving_load import (
    RatePoint,
    client_file_order,
    config_base,
    equality_summary,
    is_sparse_backend,
    prefix_accounting,
    rate_points,
    rotated,
    server_args,
    size_pools,
    summarize_workload,
    text_mismatches,
)
from benchmarks.stats import (
    Spread,
    bootstrap_ci,
    claim,
    fmt_ratio,
    paired_ratios,
    ratio_spread,
    sign_test_p,
    spread,
)


def test_spread_minmax_and_iqr() -> None:
    s = spread([3.0, 1.0, 2.0])
    assert s == Spread(2.0, 1.0, 3.0, 3, "minmax")
    q = spread([1.0, 2.0, 3.0, 4.0, 100.0], "iqr")
    assert q is not None and q.median == 3.0 and q.lo == 2.0 and q.hi == 4.0 and q.n == 5
    # two values: the IQR is the range
    assert spread([1.0, 5.0], "iqr") == Spread(3.0, 1.0, 5.0, 2, "iqr")
    with pytest.raises(ValueError, match="unknown spread"):
        spread([1.0], "std")


def test_spread_drops_missing_values() -> None:
    assert spread([]) is None
    assert spread([None, math.nan, math.inf]) is None
    s = spread([None, 2.0, math.nan, 4.0])
    assert s is not None and (s.median, s.lo, s.hi, s.n) == (3.0, 2.0, 4.0, 2)


def test_paired_ratios_are_per_repetition() -> None:
    assert paired_ratios([2.0, 3.0, 4.0], [1.0, 3.0, 8.0]) == [2.0, 1.0, 0.5]
    # a missing value or a zero denominator drops that repetition only
    assert paired_ratios([2.0, None, 4.0, 1.0], [1.0, 1.0, 0.0, 2.0]) == [2.0, 0.5]
    with pytest.raises(ValueError, match="equal lengths"):
        paired_ratios([1.0], [1.0, 2.0])
    # the ratio spread comes from per-repetition ratios, not from the ratio of medians
    s = ratio_spread([10.0, 20.0, 30.0], [10.0, 10.0, 60.0])
    assert s is not None and (s.median, s.lo, s.hi) == (1.0, 0.5, 2.0)


def test_claim_only_when_spread_excludes_one() -> None:
    assert claim(spread([0.5, 0.6, 0.7])) == "lower"
    assert claim(spread([1.2, 1.5, 1.3])) == "higher"
    assert claim(spread([0.8, 1.1, 0.9])) == "n.s."
    assert claim(spread([0.8, 1.0, 0.9])) == "n.s."  # touching 1 is not excluding it
    assert claim(spread([0.5])) == "n.s."  # one repetition has no spread
    assert claim(None) == "n.s."
    assert fmt_ratio(spread([0.5, 0.6, 0.7])) == "0.60x [0.50-0.70]"
    assert fmt_ratio(spread([0.8, 1.1, 0.9])) == "0.90x [0.80-1.10] n.s."
    assert fmt_ratio(spread([0.996, 0.998, 0.999])) == "0.998x [0.996-0.999]"
    assert fmt_ratio(None) == "-"


def test_sign_test_p() -> None:
    assert sign_test_p(1) == 1.0
    assert sign_test_p(3) == 0.25
    assert sign_test_p(5) == 0.0625


def test_bootstrap_ci_is_seeded_and_brackets_the_statistic() -> None:
    vals = [float(v) for v in range(1, 41)]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    lo, hi = bootstrap_ci(vals, mean, n=500, seed=3)
    assert lo < 20.5 < hi and hi - lo < 15
    assert bootstrap_ci(vals, mean, n=500, seed=3) == (lo, hi)
    # objects that are not numbers resample by index (pairs of rows in ttft_paired)
    pairs = [({"t": v}, {"t": 2 * v}) for v in vals]
    plo, phi = bootstrap_ci(pairs, lambda ps: sum(b["t"] for _, b in ps) / sum(a["t"] for a, _ in ps), n=200)
    assert plo == pytest.approx(2.0) and phi == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci([], mean)


def test_rotation_and_rate_points() -> None:
    names = ["a", "b", "c"]
    assert rotated(names, 0) == names and rotated(names, 1) == ["b", "c", "a"]
    assert rotated(names, 4) == ["b", "c", "a"] and rotated([], 3) == []
    # over len(names) consecutive offsets every name takes every position once
    for pos in range(3):
        assert sorted(rotated(names, k)[pos] for k in range(3)) == names
    pts = rate_points([1.0, 2.5], 4)
    assert [p.label for p in pts] == ["1/s", "2.5/s", "cap4"]
    assert pts[-1].rate == math.inf and pts[-1].max_concurrency == 4
    assert [p.label for p in rate_points([3.0], None)] == ["3/s"]


def test_text_mismatches() -> None:
    assert text_mismatches([" w5 w6", "w7"], ["w5  w6", "w7"]) == 0
    assert text_mismatches(["w5", "w7"], ["w5", "w8"]) == 1
    assert text_mismatches(["w5"], ["w5", "w8"]) == 1


def test_client_file_order_undoes_the_clients_shuffle() -> None:
    trace = [f"row{i}" for i in range(37)]
    order = client_file_order(len(trace), seed=7)
    file_rows = [""] * len(trace)
    for i, pos in enumerate(order):
        file_rows[pos] = trace[i]
    random.seed(7)  # what sglang.benchmark.serving does before loading the custom dataset
    random.shuffle(file_rows)
    assert file_rows == trace


def test_prefix_accounting_single_turn_matches_ideal_prefilled() -> None:
    from benchmarks.serving import ideal_prefilled

    doc = list(range(10, 110))
    prompts = [doc + [500, 501], doc + [600], [7, 8, 9], doc + [500, 502]]
    seqs = [p + [-(i + 1)] * 4 for i, p in enumerate(prompts)]
    acc = prefix_accounting(prompts, seqs)
    assert acc["perfect_prefilled"] == ideal_prefilled(prompts) == 102 + 1 + 3 + 1
    assert acc["prompt_tokens"] == sum(len(p) for p in prompts)
    # distinct tokens of prompts + outputs: the doc once, then each tail and output
    assert acc["footprint_tokens"] == 102 + 4 + (1 + 4) + (3 + 4) + (1 + 4)
    assert acc["reuse_points"] == 2  # doc (depth 100), doc + [500] (depth 101)
    assert acc["max_seq"] == 106


def test_prefix_accounting_multi_turn_reuses_outputs() -> None:
    d0, d1 = list(range(10, 60)), list(range(100, 120))
    out0 = [-1] * 8
    prompts = [d0, d0 + out0 + d1]
    seqs = [d0 + out0, d0 + out0 + d1 + [-2] * 8]
    acc = prefix_accounting(prompts, seqs)
    assert acc["perfect_prefilled"] == 50 + 20  # turn 2 reuses turn 1's prompt *and* output
    assert acc["footprint_tokens"] == 50 + 8 + 20 + 8
    assert acc["reuse_points"] == 1


def test_size_pools_fraction_and_floors() -> None:
    acc = {"footprint_tokens": 10000, "reuse_points": 20, "max_seq": 900}
    p = size_pools(acc, 0.4, 4)
    assert p["max_total_tokens"] == 4000 and p["kv_fraction"] == pytest.approx(0.4)
    assert not p["kv_floor_applied"]
    # 5 slots per running request (extra_buffer + overlap: working + two ping-pong) + 40% of reuse points
    assert p["max_mamba_cache_size"] == 20 + 8 and p["state_fraction"] == pytest.approx(0.4)
    assert p["max_running_requests"] == 28 // 5
    small = size_pools({"footprint_tokens": 2000, "reuse_points": 3, "max_seq": 900}, 0.25, 2)
    assert small["max_total_tokens"] == 1800 and small["kv_floor_applied"]
    assert small["kv_fraction"] == pytest.approx(0.9)
    with pytest.raises(ValueError):
        size_pools(acc, 0.0, 4)


def _run(rate: str, config: str, rep: int, ttft: float, texts: list[str]) -> dict:
    return {
        "rate": rate,
        "config": config,
        "rep": rep,
        "median_ttft_ms": ttft,
        "request_throughput": 1.0,
        "prefilled_tokens": 100,
        "texts": texts,
    }


def test_summarize_workload_ratios_and_claims() -> None:
    pt = RatePoint("2/s", 2.0)
    runs = []
    for rep, (nat, sp, lr) in enumerate([(100.0, 60.0, 95.0), (120.0, 80.0, 130.0), (90.0, 50.0, 80.0)]):
        runs += [
            _run("2/s", "native", rep, nat, ["a"]),
            _run("2/s", "sparse", rep, sp, ["a"]),
            _run("2/s", "lru", rep, lr, ["a"]),
        ]
    s = summarize_workload(runs, ["native", "sparse", "lru"], ["native", "lru"], [pt], 3, "minmax")
    cell = s["2/s"]["configs"]["native"]["median_ttft_ms"]
    assert (cell["median"], cell["lo"], cell["hi"], cell["values"]) == (
        100.0,
        90.0,
        120.0,
        [100.0, 120.0, 90.0],
    )
    r = s["2/s"]["ratios"]["native"]["sparse"]["median_ttft_ms"]
    assert r["per_rep"] == pytest.approx([0.6, 80 / 120, 50 / 90])
    assert r["claim"] == "lower" and r["sign_test_p"] == 0.25
    lru = s["2/s"]["ratios"]["native"]["lru"]["median_ttft_ms"]
    assert lru["claim"] == "n.s."  # 0.95, 1.08, 0.89: the spread includes 1
    assert s["2/s"]["ratios"]["native"]["sparse"]["request_throughput"]["claim"] == "n.s."  # all 1.0
    # every config vs the first baseline, only sparse vs the others
    assert set(s["2/s"]["ratios"]["lru"]) == {"sparse"} and "marconi" not in s["2/s"]["ratios"]


def test_equality_summary() -> None:
    pt = RatePoint("1/s", 1.0)
    runs = [
        _run("1/s", "nocache", 0, 1.0, ["w5 w6", "w7"]),
        _run("1/s", "nocache", 1, 1.0, ["w5 w6", "w7"]),
        _run("1/s", "sparse", 0, 1.0, ["w5 w6", "w7"]),
        _run("1/s", "sparse", 1, 1.0, ["w5 w6", "w9"]),
    ]
    eq = equality_summary(runs, ["sparse", "nocache"], [pt], 2)
    assert eq["load"]["sparse"] == {"compared": 4, "mismatched": 1}
    assert eq["nocache_self"] == {"compared": 2, "mismatched": 0}
    assert eq["all_equal"] is False
    assert equality_summary(runs, ["sparse"], [pt], 2)["reference"] is None


def test_check_row_rejects_non_measurements() -> None:
    good = {"completed": 2, "median_ttft_ms": 12.0, "generated_texts": [" w5", " w6"], "errors": ["", ""]}
    assert check_row(good) is good
    with pytest.raises(RuntimeError, match="skip-tokenizer-init"):
        check_row({**good, "median_ttft_ms": 0.0, "generated_texts": ["", ""]})
    with pytest.raises(RuntimeError, match="failed"):
        check_row({**good, "errors": ["", "boom"]})
    with pytest.raises(RuntimeError, match="no request"):
        check_row({**good, "completed": 0})


def test_ttft_vs_prefill_gap_is_paired_per_repetition() -> None:
    pt = RatePoint("2/s", 2.0)
    runs = []
    # (sparse mean TTFT, sparse prefilled, lru mean TTFT, lru prefilled) per repetition
    for rep, (st, sp, lt, lp) in enumerate(
        [(50.0, 600, 100.0, 1000), (66.0, 600, 100.0, 1000), (30.0, 300, 60.0, 500)]
    ):
        a = _run("2/s", "sparse", rep, 1.0, ["x"])
        b = _run("2/s", "lru", rep, 1.0, ["x"])
        a.update(mean_ttft_ms=st, prefilled_tokens=sp)
        b.update(mean_ttft_ms=lt, prefilled_tokens=lp)
        runs += [a, b]
    s = summarize_workload(runs, ["sparse", "lru"], ["lru"], [pt], 3, "minmax")
    v = s["2/s"]["ttft_vs_prefill"]
    assert set(v) == {"sparse/lru"}  # pairs whose configs are absent are skipped
    g = v["sparse/lru"]
    assert g["ttft_ratio"]["median"] == pytest.approx(0.5)
    assert g["prefilled_ratio"]["median"] == pytest.approx(0.6)
    # gaps: 0.5/0.6-1, 0.66/0.6-1, 0.5/0.6-1
    assert g["gap"]["per_rep"] == pytest.approx([0.5 / 0.6 - 1, 0.1, 0.5 / 0.6 - 1])
    assert g["gap"]["hi"] == pytest.approx(0.1) and g["gap"]["median"] == pytest.approx(0.5 / 0.6 - 1)


def test_second_instance_runs_its_base_config_and_gets_an_aa_gap() -> None:
    assert config_base("lru#2") == "lru" and config_base("sparse") == "sparse"
    assert is_sparse_backend("lru#2") and not is_sparse_backend("native#b")
    assert server_args("lru#2", 512, Path("t.jinja")) == server_args("lru", 512, Path("t.jinja"))
    pt = RatePoint("2/s", 2.0)
    runs = []
    for rep, (t1, t2) in enumerate([(100.0, 110.0), (100.0, 90.0), (100.0, 105.0)]):
        a = _run("2/s", "lru", rep, 1.0, ["x"])
        b = _run("2/s", "lru#2", rep, 1.0, ["x"])
        a.update(mean_ttft_ms=t1, prefilled_tokens=500)
        b.update(mean_ttft_ms=t2, prefilled_tokens=500)
        runs += [a, b]
    v = summarize_workload(runs, ["lru", "lru#2"], ["lru"], [pt], 3, "minmax")["2/s"]["ttft_vs_prefill"]
    assert set(v) == {"lru#2/lru"}
    assert v["lru#2/lru"]["gap"]["per_rep"] == pytest.approx([0.10, -0.10, 0.05])


def test_pooled_gap_uses_the_repetitions_totals() -> None:
    from benchmarks.stats import pooled_gap

    # TTFT totals 300 vs 300, prefilled 500 vs 1000: TTFT did not follow a halved prefill
    assert pooled_gap([100.0, 200.0], [150.0, 150.0], [250, 250], [500, 500]) == pytest.approx(1.0)
    assert pooled_gap([None, 50.0], [60.0, 50.0], [1, 1], [1, 1]) == pytest.approx(0.0)  # rep 0 dropped
    assert pooled_gap([], [], [], []) is None


def test_table_right_aligns_and_keeps_preformatted_cells() -> None:
    from benchmarks._common import table

    out = table(
        [["native_eb", "17.9 [16.6-20.5]", 0.123456, "1e5"], ["sparse", "-", 12.5, "276318"]],
        ["config", "req/s", "x", "s"],
    )
    assert out.splitlines() == [
        "   config             req/s      x       s",
        "---------  ----------------  -----  ------",
        "native_eb  17.9 [16.6-20.5]  0.123     1e5",
        "   sparse                 -   12.5  276318",
    ]

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

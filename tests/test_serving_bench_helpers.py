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

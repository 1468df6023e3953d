"""Summary maths of ``benchmarks/ttft_paired.py`` (no server): pooled ratios, the gap, the
same-work difference and the seeded bootstrap intervals."""

from __future__ import annotations

import pytest

from benchmarks.ttft_paired import pair_summary


def _row(**cfg: tuple[float, int, int]) -> dict:
    return {c: {"ttft_ms": t, "prompt_tokens": p, "cached_tokens": k} for c, (t, p, k) in cfg.items()}


def test_gap_is_zero_when_ttft_follows_prefill_exactly() -> None:
    # b prefills everything; a prefills half of each prompt and takes half the time
    rows = [_row(a=(10.0 * i, 100 * i, 50 * i), b=(20.0 * i, 100 * i, 0)) for i in range(1, 9)]
    s = pair_summary(rows, "a", "b")
    assert s["ttft_ratio"] == pytest.approx(0.5) and s["prefilled_ratio"] == pytest.approx(0.5)
    assert s["gap"] == pytest.approx(0.0)
    lo, hi = s["gap_ci95"]
    assert lo == pytest.approx(0.0) and hi == pytest.approx(0.0)
    assert s["equal_work_requests"] == 0 and "equal_work_ms" not in s


def test_overhead_on_equal_work_shows_in_gap_and_same_work_difference() -> None:
    rows = [_row(a=(33.0, 500, 0), b=(30.0, 500, 0)) for _ in range(10)]
    s = pair_summary(rows, "a", "b", seed=3)
    assert s["gap"] == pytest.approx(0.1)
    assert s["equal_work_requests"] == 10 and s["equal_work_ms"] == pytest.approx(3.0)
    lo, hi = s["gap_ci95"]
    assert lo <= s["gap"] <= hi
    assert pair_summary(rows, "a", "missing") is None
    assert pair_summary(rows, "a", "b", seed=3) == s  # seeded: reproducible

"""Unit tests of the Prometheus export of ``sparse_stats()`` (no server)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import REGISTRY  # noqa: E402

from sglang_sparse.sglang_adapter import metrics  # noqa: E402


class _Cache:
    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def sparse_stats(self) -> dict:
        return self.stats


def test_numeric_items_filters_and_sanitizes() -> None:
    got = metrics.numeric_items({"policy": "lru", "hits": 3, "alpha": 0.5, "ok": True, "x-y": 1, "e": None})
    assert got == {"hits": 3.0, "alpha": 0.5, "ok": 1.0, "x_y": 1.0}


def test_update_sets_gauges() -> None:
    n = metrics.update({"policy": "unit", "unit_hit_requests": 7, "unit_alpha": 0.25, "last_error": "x"})
    assert n == 2
    labels = {"policy": "unit"}
    assert REGISTRY.get_sample_value("sglang:sparse_unit_hit_requests", labels) == 7.0
    assert REGISTRY.get_sample_value("sglang:sparse_unit_alpha", labels) == 0.25


def test_maybe_update_rate_limited_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_last_update", float("-inf"))
    monkeypatch.setattr(metrics, "_disabled", False)
    cache = _Cache({"policy": "unit2", "unit2_states_held": 4})
    assert metrics.maybe_update(cache)
    assert not metrics.maybe_update(cache)  # within the interval
    assert metrics.maybe_update(cache, force=True)

    class _Broken:
        def sparse_stats(self) -> dict:
            raise RuntimeError("boom")

    assert not metrics.maybe_update(_Broken(), force=True)
    assert not metrics.maybe_update(cache, force=True)  # disabled after a failure

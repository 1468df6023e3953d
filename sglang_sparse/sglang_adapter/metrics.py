"""Prometheus export of the ``sparse`` cache statistics (``--enable-metrics``).

Every numeric entry of the cache's ``sparse_stats()`` dict (hits, resume vs KV-hit tokens, states
held, bytes, evictions, checkpoints admitted/captured, alpha, ...) becomes a gauge
``sglang:sparse_<key>`` labelled with the policy name; cumulative counts are exported as gauges of
their running value (the dict is a snapshot, not a stream of increments). Gauges use
``multiprocess_mode="mostrecent"`` because SGLang serves ``/metrics`` from the HTTP process while the
cache lives in the scheduler process (``PROMETHEUS_MULTIPROC_DIR``).

:func:`maybe_update` is called from the plugin's scheduler hook; it is rate limited by wall time
(metrics only, never a cache decision) and never raises.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("sglang_sparse")

PREFIX = "sglang:sparse_"
"""Metric name prefix (SGLang's own metrics are ``sglang:*``)."""

UPDATE_INTERVAL_S = 0.5
"""Minimum wall time between two updates."""

_gauges: dict[str, Any] = {}
_last_update = float("-inf")
_disabled = False


def numeric_items(stats: Mapping[str, Any]) -> dict[str, float]:
    """The exportable entries of a stats dict: ints and floats (bools as 0/1), names sanitized."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, int | float):
            out[re.sub(r"[^a-zA-Z0-9_]", "_", str(key))] = float(value)
    return out


def _gauge(name: str) -> Any:
    g = _gauges.get(name)
    if g is None:
        from prometheus_client import Gauge

        g = Gauge(
            PREFIX + name,
            f"sparse prefix cache statistic '{name}' (sparse_stats())",
            labelnames=["policy"],
            multiprocess_mode="mostrecent",
        )
        _gauges[name] = g
    return g


def update(stats: Mapping[str, Any]) -> int:
    """Set one gauge per numeric entry of ``stats``; returns how many were set."""
    policy = str(stats.get("policy", "unknown"))
    items = numeric_items(stats)
    for name, value in items.items():
        _gauge(name).labels(policy=policy).set(value)
    return len(items)


def maybe_update(cache: Any, *, force: bool = False) -> bool:
    """Export ``cache.sparse_stats()`` when metrics are on and the interval elapsed; never raises."""
    global _last_update, _disabled
    if _disabled:
        return False
    now = time.monotonic()
    if not force and now - _last_update < UPDATE_INTERVAL_S:
        return False
    _last_update = now
    try:
        update(cache.sparse_stats())
    except Exception:  # noqa: BLE001 - metrics must never break scheduling
        logger.exception("sparse cache metrics failed; metrics export disabled")
        _disabled = True
        return False
    return True

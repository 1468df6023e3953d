"""Trace replay of the published Marconi-paper baselines (:mod:`sglang_sparse.sim.published_caches`).

Same request loop as the reference's ``policy_exploration.py: run_trace_with_config`` (match the
input, insert input + output) and the same :class:`SimResult` fields as :func:`.simulate`, with the
reference's definitions: ``resume_depth`` = reused input tokens, ``kv_depth`` = its "actual prefix
length" (blocks matched for vLLM+), FLOPs from the model's ``request_flops_saved``. Bytes may exceed
``cache_bytes`` (the reference evicts by an estimate before inserting, then always inserts).
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_sparse.policy import ModelCostModel

from .common import RequestRecord, SimResult, prepare_requests, progress_range
from .published_caches import PublishedModel, as_published_model, make_published_cache
from .trace import SimRequest


def simulate_published(
    requests: Sequence[SimRequest],
    policy: str,
    cache_bytes: float,
    cost: ModelCostModel | PublishedModel,
    *,
    alpha: float | None = None,
    keep_records: bool = True,
    progress: bool = False,
    check: bool = False,
    **cache_kwargs: object,
) -> SimResult:
    """Replay ``requests`` through the published baseline ``policy`` of ``cache_bytes`` bytes. ``cost``:
    a :class:`ModelCostModel` (bytes and FLOPs of that model) or a
    :class:`~sglang_sparse.sim.published_caches.MarconiModel` (the reference's own formulas). ``alpha``
    fixes Marconi's weight (no tuning); ``check`` asserts the tree's counters per request;
    ``cache_kwargs`` go to the cache (e.g. ``bootstrap_multiplier``, ``tuner_workers``)."""
    model = as_published_model(cost)
    cache = make_published_cache(policy, cache_bytes, model, alpha=alpha, **cache_kwargs)
    res = SimResult(policy, int(cache_bytes))
    prepared = prepare_requests(requests)
    for i in progress_range(len(prepared), progress, policy, cache_bytes):
        inp, full = prepared[i]
        s = cache.serve(inp, full)
        if check:
            cache.check()
        saved = float(model.request_flops_saved(s.hit))
        total = float(model.request_flops_saved(len(inp)))
        kv, used = s.prefix_len, int(s.bytes_used)
        rec = RequestRecord(i, len(inp), kv, s.hit, kv - s.hit, s.created, saved, total, used)
        res.add(rec, keep_records)
    res.alphas = list(getattr(cache, "tunings", []))
    return res

"""Trace replay through a :class:`HybridCache` of a given byte size (the same policy code as serving).

Per request (input ``I``, output ``O``), definitions in tokens / FLOPs:

* ``kv_depth``: KV-matched prefix of ``I``; ``resume_depth``: deepest checkpoint ``<= kv_depth``.
* **token hit** = ``resume_depth`` (only a prefix ending at a recurrent checkpoint is usable).
* **recomputed recurrent tokens** = ``kv_depth - resume_depth`` (KV cached but not resumable:
  re-prefilled because the recurrent state is missing).
* **FLOPs saved** = ``cost.flops_saved(len(I), resume_depth)`` (= ``prefill_flops(resume_depth)``);
  the baseline is ``prefill_flops(len(I))``.
* Then: observe the match, take the policy's capture plan, insert ``I + O`` with a state handle at
  every planned position, evict to the byte budget. The cached sequence is ``I + O`` (the state
  after the last decoded token is the ``len(I + O)`` checkpoint).

FLOP-aware policies start with ``alpha = 0`` for a bootstrap window of ``bootstrap`` requests, then
tune alpha by replaying that window over the alpha grid (:class:`AlphaTuner`, process pool, grid
order) from a snapshot of the cache taken when the window began, and re-tune when the windowed hit
rate drifts. The SGLang adapter tunes with the same :func:`warm_replay_score`.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from sglang_sparse.policy import (
    PUBLISHED_POLICIES,
    AlphaTuner,
    CacheSnapshot,
    HybridCache,
    ModelCostModel,
    PolicySpec,
    get_policy,
)
from sglang_sparse.policy.host_tier import HostCost, HostTierConfig

from .common import Observer, RequestRecord, SimResult, prepare_requests, progress_range
from .host_tier import TwoTierCache
from .oracle import OracleLaw
from .trace import SimRequest

#: simulator-only policies with future knowledge (:mod:`.offline`); not cache policies of the
#: registry, so the serving adapter (``SGLANG_SPARSE_POLICY``) rejects them as unknown
OFFLINE_POLICIES: tuple[str, ...] = ("offline",)


def simulate(
    requests: Sequence[SimRequest],
    policy: str | PolicySpec,
    cache_bytes: int,
    cost: ModelCostModel,
    *,
    alpha: float | None = None,
    bootstrap: int | None = None,
    oracle: OracleLaw | None = None,
    keep_records: bool = True,
    progress: bool = False,
    check: bool = False,
    retune: bool = False,
    observer: Observer | None = None,
    host: HostTierConfig | None = None,
    **cache_kwargs,
) -> SimResult:
    """Replay ``requests`` through a ``policy`` cache of ``cache_bytes`` bytes for model ``cost``.

    ``alpha`` fixes the FLOP-aware weight (no tuning); otherwise FLOP-aware policies bootstrap with
    LRU for ``bootstrap`` requests (default ``min(200, n // 5)``) and tune once (``retune``: again
    whenever a window's hit rate drifts, see :class:`AlphaTuner`). ``oracle``: the law of the
    ``oracle`` policy (built when omitted). ``observer`` (registry policies and ``offline``) is
    called once per request, after its eviction, with ``(index, match, {position: state handle}
    captured, insert result, freed)``: read-only instrumentation (:mod:`.gap`). ``check`` asserts
    tree invariants. ``host`` adds a host tier of ``host.budget_bytes`` below a device of
    ``cache_bytes`` (registry policies only; the model and the result's load fields:
    :mod:`.host_tier`); FLOP-aware policies then value a state net of its expected load
    (:class:`~sglang_sparse.policy.host_tier.HostCost`); alpha tuning replays ignore loads.

    ``offline`` runs through :func:`.offline.simulate_offline` (only ``keep_records``, ``progress``,
    ``check``, ``observer`` and its own ``grid`` / ``future`` in ``cache_kwargs`` apply); the
    published baselines (``PUBLISHED_POLICIES``) through :func:`.published.simulate_published`
    (``bootstrap``, ``oracle``, ``retune`` do not apply; ``cost`` may be a ``MarconiModel``)."""
    if host is not None and isinstance(policy, str) and policy in (*OFFLINE_POLICIES, *PUBLISHED_POLICIES):
        raise ValueError(f"policy {policy!r} has no host tier model; give a registry policy")
    if isinstance(policy, str) and policy in OFFLINE_POLICIES:
        from .offline import simulate_offline

        return simulate_offline(
            requests,
            cache_bytes,
            cost,
            keep_records=keep_records,
            progress=progress,
            check=check,
            observer=observer,
            **cache_kwargs,
        )
    if isinstance(policy, str) and policy in PUBLISHED_POLICIES:
        if observer is not None:
            raise ValueError(f"policy {policy!r}: the published baselines take no observer")
        from .published import simulate_published

        return simulate_published(
            requests,
            policy,
            cache_bytes,
            cost,
            alpha=alpha,
            keep_records=keep_records,
            progress=progress,
            check=check,
            **cache_kwargs,
        )
    spec = get_policy(policy)
    if spec.needs_law_provider and oracle is None:
        oracle = OracleLaw(requests)
    if not spec.needs_law_provider:
        # Only the oracle policy sees the whole trace's law, in its replays too: a caller passing
        # one oracle for every policy (benchmarks/sim_compare.py) must not hand it to the others'
        # alpha tuning (docs/architecture.md, "Simulator and tree notes").
        oracle = None
    prepared = prepare_requests(requests)
    n = len(prepared)
    logical, cache_cost = int(cache_bytes), cost
    if host is not None:
        logical = host.logical_bytes(cache_bytes)
        if spec.flop_aware:
            cache_cost = HostCost(cost, host, host.host_share(cache_bytes))
        if cost.kv_bytes_per_token and "fit_tokens" not in cache_kwargs:  # the forward runs on the device
            cache_kwargs["fit_tokens"] = (int(cache_bytes) - cost.state_bytes) // cost.kv_bytes_per_token
    cache = HybridCache(
        spec,
        budget_bytes=logical,
        cost=cache_cost,
        law_provider=oracle if spec.needs_law_provider else None,
        **cache_kwargs,
    )
    res = SimResult(spec.name, int(cache_bytes))
    tier = TwoTierCache(cache, int(cache_bytes), host) if host is not None else None
    if host is not None:
        res.host_bytes = host.budget_bytes
    tuning = spec.flop_aware and alpha is None
    if spec.flop_aware and alpha is not None:
        cache.alpha = alpha
    window = bootstrap if bootstrap is not None else max(1, min(200, n // 5))
    if tuning:
        tuner = AlphaTuner(window=window, retune=retune)
    hits: list[float] = []
    since_tune = 0
    ids = itertools.count(1)
    snapshot = _snapshot(cache, oracle) if tuning else None
    for i in progress_range(n, progress, spec.name, cache_bytes):
        inp, full = prepared[i]
        c, kv, saved, total, captured, load = _serve(cache, inp, full, cost, ids, observer, i, tier)
        if load:
            res.host_hit_tokens += c
            res.load_bytes += load
            res.load_flops += host.load_flops(load)
        if check:
            cache.tree.check()
        rec = RequestRecord(i, len(inp), kv, c, kv - c, captured, saved, total, cache.bytes_used)
        res.add(rec, keep_records)
        hits.append(c / max(len(inp), 1))
        since_tune += 1
        if tuning and since_tune >= window and i + 1 < n:
            hr = float(np.mean(hits[-window:]))
            if not res.alphas or tuner.should_retune(hr):
                lo = max(0, i + 1 - window)
                evaluate = functools.partial(
                    warm_replay_score, snapshot, prepared[lo : i + 1], cost, law_provider=oracle
                )
                a = tuner.tune(evaluate, at_request=i + 1, current=cache.alpha if res.alphas else None)
                cache.alpha = a
                res.alphas.append((i + 1, a))
            since_tune = 0
            if tuner.retune:  # the next window may re-tune: it replays from here
                snapshot = _snapshot(cache, oracle)
    return res


def _serve(
    cache: HybridCache,
    inp: np.ndarray,
    full: np.ndarray,
    cost: ModelCostModel,
    ids: Iterator[int],
    observer: Observer | None = None,
    index: int = -1,
    tier: TwoTierCache | None = None,
) -> tuple[int, int, float, float, int, int]:
    """One request: match, observe, capture plan, insert input+output, evict to budget.

    Returns ``(resume_depth, kv_depth, FLOPs saved, prefill FLOPs, states captured, bytes loaded
    from the host tier)``. ``observer``: see :func:`simulate` (``index``: the request's position in
    the trace). ``tier``: the two-tier residency of ``cache`` (``None``: one tier, nothing loaded)."""
    m = cache.match(inp)
    load = 0
    if tier is not None:
        m, load = tier.resume(m, inp)
    c, kv = m.resume_depth, m.kv_depth
    saved = cost.flops_saved(len(inp), c)
    total = cost.prefill_flops(len(inp))
    cache.observe(m)
    plan = cache.plan(m, len(inp), len(full))
    cache.lock(m.node)
    handles = {p: next(ids) for p in plan.positions}
    res = cache.insert(full, None, handles, probation=plan.probation, tail=plan.tail)
    cache.unlock(m.node)
    freed = cache.evict_to_budget()
    if observer is not None:
        observer(index, m, handles, res, freed)
    return c, kv, saved, total, len(plan.positions), load


def _snapshot(cache: HybridCache, oracle: OracleLaw | None) -> CacheSnapshot:
    """The cache's flat snapshot (no node objects: pickled to the tuner's worker processes without
    recursing per tree level); the oracle law provider is passed separately, not copied."""
    del oracle  # not part of the snapshot: warm_replay_score receives it as ``law_provider``
    return cache.snapshot()


def warm_replay_score(
    snapshot: CacheSnapshot | HybridCache,
    window: Sequence[tuple[np.ndarray, np.ndarray]],
    cost: ModelCostModel,
    alpha: float,
    *,
    law_provider: OracleLaw | None = None,
) -> float:
    """Tuner target: FLOPs saved replaying ``window`` (prepared ``(input, input+output)`` pairs) from
    a copy of the cache as it was when the window began, with ``alpha`` applied. Warm starts make
    the score reflect the contention that alpha will actually face (a cold replay from an empty
    cache, as in Marconi's bootstrap, mostly measures warm-up)."""
    if isinstance(snapshot, CacheSnapshot):  # flat form: rebuilt iteratively, never modified
        cache = HybridCache.from_snapshot(snapshot, law_provider=law_provider)
    else:  # a cache, or any object whose deep copy is one (the SGLang adapter's engine snapshot)
        cache = copy.deepcopy(snapshot)
    cache.alpha = alpha
    # New states get handles above every handle the snapshot holds (an engine's handles, e.g.
    # SGLang node ids, may be any ints), so a new state is never mistaken for a probation one.
    held = [h for _, _, h in cache.tree.iter_checkpoints() if isinstance(h, int)]
    held += [h for h in cache.probation if isinstance(h, int)]
    ids = itertools.count(max(held, default=0) + 1)
    return float(sum(_serve(cache, inp, full, cost, ids)[2] for inp, full in window))

"""The product policy's own pieces: the learned tail prior, the sparse admission it drives, and the
warm-start replay the alpha tuner scores settings with."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from sglang_sparse.policy import HybridCache
from sglang_sparse.policy.choose import TailPrior
from sglang_sparse.sim import cost_model, simulate, synthetic_trace
from sglang_sparse.sim.common import prepare_requests
from sglang_sparse.sim.simulator import _serve, warm_replay_score

COST = cost_model("qwen3-next-80b-a3b")


def test_tail_prior_places_a_checkpoint_just_before_where_leaves_diverge() -> None:
    t = TailPrior(gamma=1.0, min_share=0.2)
    assert t.positions(0, 5000, 2) == []  # nothing observed: no opinion
    for s in (90, 100, 110, 120):
        t.observe_suffix(s)
    # depths 5000 - s in [4880, 4910]: the deepest grid point at or below all of them
    assert t.positions(0, 5000, 2) == [4864]
    assert t.continuation_share() == 0.0
    for _ in range(12):
        t.observe_suffix(0)  # continuations dominate: the last-token state becomes worth keeping
    pos = t.positions(0, 5000, 2)
    assert 5000 in pos and t.continuation_share() == pytest.approx(0.75)
    assert t.positions(4990, 5000, 2) == [5000]  # only what lies on the new leaf
    with pytest.raises(ValueError, match="min_share"):
        TailPrior(min_share=0)


def test_exact_tail_grid_places_the_state_at_the_predicted_divergence() -> None:
    """With a capture free at any page (``exact_grid``), the tail prior's positions are the
    predicted depths themselves, page-aligned: a fixed-length question after a document gets its
    state at the document's end, not at the 64-token grid point below; the same number of states,
    and the grid-only prior is unchanged."""
    grid_only = TailPrior(gamma=1.0, min_share=0.2)
    exact = TailPrior(gamma=1.0, min_share=0.2, exact_grid=1)
    paged = TailPrior(gamma=1.0, min_share=0.2, exact_grid=16)
    for t in (grid_only, exact, paged):
        for _ in range(3):
            t.observe_suffix(48)
    assert grid_only.positions(0, 955, 2) == [896]
    assert exact.positions(0, 955, 2) == [907]
    assert paged.positions(0, 955, 2) == [896]  # 907 aligned down to 16-token pages
    assert paged.positions(0, 1000, 2) == [944]
    for t in (exact, grid_only):
        for _ in range(12):
            t.observe_suffix(0)
    assert exact.positions(0, 955, 2) == [907, 955] and grid_only.positions(0, 955, 2) == [896, 955]
    assert exact.positions(910, 955, 2) == [955]  # only what lies on the new leaf
    # two predicted depths 3 tokens apart, each with half the mass: one state at the shallower
    # (a second one would save 3 tokens per hit for a whole state), not one per depth
    near = TailPrior(gamma=1.0, min_share=0.2, exact_grid=1)
    for s in (48, 51) * 3:
        near.observe_suffix(s)
    assert near.positions(0, 2032, 2) == [1981]
    with pytest.raises(ValueError, match="exact_grid"):
        TailPrior(exact_grid=0)


def test_exact_tail_prior_keeps_a_question_prefix_state_past_min_gap() -> None:
    """Questions that share their first 25 tokens diverge 23 tokens before the end, the others at
    the document's end (48): two clusters 25 tokens apart each get a state with the default
    ``min_gap`` (16 tokens on the 64-token grid); a ``min_gap`` of one grid step keeps only the
    document's end, the old rule, which recomputed those 25 tokens on every such request."""
    default = TailPrior(gamma=1.0, min_share=0.2, exact_grid=1)
    wide = TailPrior(gamma=1.0, min_share=0.2, exact_grid=1, min_gap=64)
    for t in (default, wide):
        for s in (48, 23) * 3:
            t.observe_suffix(s)
    assert default.min_gap == 16
    assert default.positions(0, 955, 2) == [907, 932]
    assert wide.positions(0, 955, 2) == [907]
    with pytest.raises(ValueError, match="min_gap"):
        TailPrior(min_gap=0)


def test_min_share_drops_rare_positions() -> None:
    t = TailPrior(gamma=1.0, min_share=0.3)
    for s in [0] * 8 + [1000] * 2:  # 20% of divergences far from the end
        t.observe_suffix(s)
    assert t.positions(0, 4000, 2) == [4000]


def test_min_cut_gain_skips_prefill_captures_that_save_only_a_few_tokens() -> None:
    """Engine cost of the chunk-cut path: a capture inside the prefill fewer than ``min_cut_gain``
    tokens after the resume point (or the previous capture) is not worth its extra forward."""

    def plan(gain: int) -> list[int]:
        c = HybridCache("lru", budget_bytes=10**12, cost=COST, min_cut_gain=gain)
        c.insert(np.arange(1000, dtype=np.int32), None, {1000: 1, 900: 2})
        m = c.match(np.concatenate([np.arange(980), [7, 7, 7]]).astype(np.int32))  # diverges at 980
        assert m.resume_depth == 900
        return c.capture_plan(m, 983, 1010)

    assert plan(0) == [960, 1010]  # Marconi: branch point + last token
    assert plan(60) == [960, 1010]  # the branch point saves 60 tokens per hit over the resume point
    assert plan(61) == [1010]  # not enough; the state after the last token is never a cut
    with pytest.raises(ValueError, match="min_cut_gain"):
        HybridCache("lru", budget_bytes=10**12, cost=COST, min_cut_gain=-1)


def _prompt_stream(
    rng: np.random.Generator, prompts: int, repeats: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """System-prompt-like stream: each prompt P_k (1-3k tokens) is used ``repeats`` times in a row,
    each time with a fresh 40-token question and a 60-token answer."""
    out = []
    for _ in range(prompts):
        p = rng.integers(10, 50_000, int(rng.integers(1_000, 3_000)))
        for _ in range(repeats):
            inp = np.concatenate([p, rng.integers(10, 50_000, 40)])
            out.append(
                (inp.astype(np.int32), np.concatenate([inp, rng.integers(10, 50_000, 60)]).astype(np.int32))
            )
    return out


@pytest.mark.parametrize("policy", ["sparse", "marconi"])
def test_second_use_of_a_new_prompt_hits_only_with_the_learned_prior(policy: str) -> None:
    stream = _prompt_stream(np.random.default_rng(0), prompts=12, repeats=2)
    cache = HybridCache(policy, budget_bytes=10**14, cost=COST)
    ids = itertools.count(1)
    second_hits = []
    for i, (inp, full) in enumerate(stream):
        c, kv, *_ = _serve(cache, inp, full, COST, ids)
        if i % 2 == 1:
            assert kv >= len(inp) - 40  # the prompt's KV is always there
            second_hits.append(c)
    late = second_hits[6:]  # after the prior's warm-up
    if policy == "marconi":  # only the last token was checkpointed: the second use recomputes it all
        assert all(c == 0 for c in late)
    else:  # a checkpoint within one grid step + the answer length of the divergence point
        assert all(c > 0 for c in late)
        for (inp, _), c in zip(stream[13::2], late, strict=True):
            assert len(inp) - 40 - c < 64 + 100


def test_warm_replay_score_starts_from_the_snapshot_and_leaves_it_untouched() -> None:
    trace = synthetic_trace("doc_qa", 40, seed=1, scale=0.3)
    prepared = prepare_requests(trace)
    budget = 6 * COST.state_bytes + 20_000 * COST.kv_bytes_per_token
    cache = HybridCache("sparse", budget_bytes=budget, cost=COST)
    ids = itertools.count(1)
    for inp, full in prepared[:20]:
        _serve(cache, inp, full, COST, ids)
    snap = copy.deepcopy(cache)
    before = (snap.bytes_used, snap.tree.num_nodes, snap.tree.clock)
    a = warm_replay_score(snap, prepared[20:], COST, 0.5)
    assert a == warm_replay_score(snap, prepared[20:], COST, 0.5)  # deterministic
    assert (snap.bytes_used, snap.tree.num_nodes, snap.tree.clock) == before
    cold = simulate(trace[20:], "sparse", budget, COST, alpha=0.5, keep_records=False).flops_saved
    assert a > cold  # the warm cache already holds the documents the window asks about


def test_fit_state_keeps_the_longest_prefix_that_fits_a_small_cache() -> None:
    """A document longer than the whole cache: its end state can never be kept (its prefix does not
    fit), so without the fit state nothing survives eviction and the next question on the document
    misses. ``sparse`` also captures the deepest grid position within ``fit_tokens``; eviction
    drops the unservable end state and cuts the leaf back to it, and the next visit resumes there."""
    kv, st = COST.kv_bytes_per_token, COST.state_bytes
    budget = st + 3000 * kv  # 3000 tokens of KV next to one state
    doc = np.arange(10_000, 15_000, dtype=np.int32)  # 5000 tokens > fit
    q1 = np.concatenate([doc, np.arange(20, 40, dtype=np.int32)])
    q2 = np.concatenate([doc, np.arange(50, 70, dtype=np.int32)])
    results = {}
    cases = (("fit", None, 2), ("no_fit", 10**9, 0), ("no_fit_probation", 10**9, 2))
    for name, fit, probation in cases:
        c = HybridCache("sparse", budget_bytes=budget, cost=COST, fit_tokens=fit, probation_budget=probation)
        assert name != "fit" or c.fit_tokens == 3000
        m = c.match(q1)
        c.observe(m)
        plan = c.capture_plan(m, len(q1), len(q1) + 8)
        assert (2944 in plan) == (name == "fit")  # 3000 // 64 * 64
        c.insert(np.concatenate([q1, np.arange(8, dtype=np.int32)]), None, {p: p for p in plan})
        c.evict_to_budget()
        assert c.bytes_used <= budget
        results[name] = c.match(q2).resume_depth
    # Without the fit state (and without probation) nothing survives; first-sight probation states
    # spread over the document hedge it (one of them fits next to its prefix), the fit state wins.
    assert results["fit"] == 2944 and results["no_fit"] == 0, results
    assert 0 < results["no_fit_probation"] < 2944, results
    with pytest.raises(ValueError, match="fit_tokens"):
        HybridCache("sparse", budget_bytes=budget, cost=COST, fit_tokens=-1)


def test_fit_state_survives_a_snapshot_copy() -> None:
    c = HybridCache("sparse", budget_bytes=10**12, cost=COST, fit_tokens=1234)
    assert HybridCache.from_snapshot(c.snapshot()).fit_tokens == 1234
    d = HybridCache("sparse", budget_bytes=COST.state_bytes + 100 * COST.kv_bytes_per_token, cost=COST)
    assert d.fit_tokens == 100 and HybridCache.from_snapshot(d.snapshot()).fit_tokens == 100


def test_fit_state_leaves_room_for_the_branch_point_and_replaces_learned_positions() -> None:
    kv, st = COST.kv_bytes_per_token, COST.state_bytes
    state_tok = -(-st // kv)
    c = HybridCache("sparse", budget_bytes=st + 8000 * kv, cost=COST)
    assert c.fit_tokens == 8000
    a = np.arange(100_000, 109_000, dtype=np.int32)
    c.insert(a, None, {})
    b = np.concatenate([a[:1000], np.arange(200_000, 208_000, dtype=np.int32)])  # splits A at 1000
    m = c.match(b)
    assert m.kv_depth == 1000 and m.resume_depth == 0
    plan = c.capture_plan(m, len(b), len(b) + 4)
    fit_pos = ((8000 - state_tok) // 64) * 64  # room for the branch point's state too
    assert 960 in plan and fit_pos in plan
    assert [p for p in plan if p <= 8000] == [960, fit_pos]  # nothing else below the fit


#: unused states of the tail prior (gamma 0.99) before its hit rate (one pseudo-hit) is below 2%
MISSES_TO_DISTRUST = 40


def test_tail_prior_hit_rate_counts_states_served_before_they_are_freed() -> None:
    t = TailPrior(gamma=1.0)
    assert t.hit_rate == 1.0  # no outcome yet: the prior's positions are trusted
    for hit in (True, False, False, False):
        t.observe_outcome(hit)
    assert t.hit_rate == pytest.approx(2 / 5)  # one pseudo-hit, then 1 of 4
    decayed = TailPrior(gamma=0.5)
    decayed.observe_outcome(False)
    decayed.observe_outcome(True)  # each outcome weighs twice the one before
    assert decayed.hit_rate == pytest.approx((0.25 + 1) / (0.25 + 0.5 + 1))
    assert t.trusted()
    strict = TailPrior(gamma=1.0, min_hit_rate=0.25)
    for _ in range(3):
        strict.observe_outcome(False)
    assert strict.hit_rate == 0.25 and strict.trusted()
    strict.observe_outcome(False)
    assert not strict.trusted()
    with pytest.raises(ValueError, match="min_hit_rate"):
        TailPrior(min_hit_rate=1.0)


def test_tail_positions_go_on_probation_while_the_priors_states_go_unused() -> None:
    """A stream of new documents with one question each (most RAG leaves are never revisited): the
    tail prior's states at each document's end are freed unused, its hit rate falls below its
    ``min_hit_rate`` (2%) and its positions become first-sight guesses (probation, evicted before every
    used state). A request that resumes from one promotes it and counts as a hit."""
    c = HybridCache("sparse", budget_bytes=10**12, cost=COST, tail_grid=1)
    for _ in range(4):
        c.tail.observe_suffix(48)  # questions of 48 tokens after a document
    ids = itertools.count(1)
    rng = np.random.default_rng(0)

    def serve(tokens: np.ndarray):
        m = c.match(tokens)
        c.observe(m)
        plan = c.plan(m, len(tokens), len(tokens))
        handles = {p: next(ids) for p in plan.positions}
        c.insert(tokens, None, handles, probation=plan.probation, tail=plan.tail)
        return plan, handles

    doc = rng.integers(100, 50_000, 907).astype(np.int32)
    plan, handles = serve(np.concatenate([doc, rng.integers(0, 99, 48).astype(np.int32)]))
    assert plan.tail == {907} and 907 not in plan.probation  # trusted: a normal state
    assert handles[907] in c.tail_states
    misses = 0
    while c.tail.trusted():
        c.evict(c.bytes_used)  # the pool needs the room before anyone comes back
        misses += 1
        assert not c.tail_states and misses < 100
        doc = rng.integers(100, 50_000, 907).astype(np.int32)
        plan, handles = serve(np.concatenate([doc, rng.integers(0, 99, 48).astype(np.int32)]))
    assert misses == MISSES_TO_DISTRUST
    assert plan.tail == {907} and 907 in plan.probation  # now a guess, evicted first
    h = handles[907]
    assert c.probation.get(h) and h in c.tail_states
    # a second question on the last document resumes from it: a hit, promoted
    before = c.tail.hit_rate
    serve(np.concatenate([doc, rng.integers(0, 99, 60).astype(np.int32)]))
    assert h not in c.probation and h not in c.tail_states
    assert c.tail.hit_rate > before


def test_untrusted_tail_positions_do_not_bring_back_what_the_fit_state_displaced() -> None:
    """A sequence longer than the cache can hold next to one state gets a fit state; the tail
    prior's positions below it give way. When the prior is not trusted its positions go on
    probation, but only those still planned: a displaced one does not come back as a guess."""
    c = HybridCache("sparse", budget_bytes=10**12, cost=COST, tail_grid=1, fit_tokens=600)
    c.tail = TailPrior(exact_grid=1, min_hit_rate=0.9)
    for _ in range(4):
        c.tail.observe_suffix(400)  # predicted divergence at 955 - 400 = 555, below the fit (600)
    c.tail.observe_outcome(False)
    assert not c.tail.trusted()
    tokens = np.arange(1000, 1955, dtype=np.int32)
    plan = c.plan(c.match(tokens), len(tokens), len(tokens))
    assert 576 in plan.positions  # the fit state
    assert 555 not in plan.positions and not plan.tail

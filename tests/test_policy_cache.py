"""Policies: registry errors, budgets, admission positions, eviction order, alpha tuner determinism."""

from __future__ import annotations

import pytest

from sglang_sparse.policy import POLICY_NAMES, AlphaTuner, HybridCache, get_policy, marconi_branch_point
from sglang_sparse.sim import cost_model

COST = cost_model("qwen3-next-80b-a3b")


def small(policy: str, budget: int = 1000, **kw) -> HybridCache:
    return HybridCache(policy, budget_bytes=budget, cost=COST, kv_bytes_per_token=1, state_bytes=10, **kw)


def test_registry_and_errors():
    assert set(POLICY_NAMES) >= {"lru", "block32", "marconi", "sglang_native", "sparse_dp", "sparse"}
    with pytest.raises(ValueError, match="valid: lru, block32"):
        get_policy("nope")
    with pytest.raises(ValueError, match="smaller than one recurrent state"):
        small("lru", budget=5)
    with pytest.raises(ValueError, match="law_provider"):
        small("oracle")
    with pytest.raises(ValueError, match="not FLOP-aware"):
        small("lru").alpha = 1.0


def test_marconi_admission_branch_point_and_last_token():
    c = small("lru", grid=4)
    c.insert(list(range(20)), None, {20: 1})
    seq = list(range(10)) + [99, 98]
    m = c.match(seq)
    assert marconi_branch_point(m, len(seq), 4) == 8
    assert c.capture_plan(m, len(seq), len(seq) + 3) == [8, 15]
    ext = list(range(20)) + [7]  # extends a leaf: no branch
    m = c.match(ext)
    assert marconi_branch_point(m, len(ext), 4) is None
    assert c.capture_plan(m, len(ext), 25) == [25]


def test_block32_every_32_tokens():
    c = small("block32")
    m = c.match(list(range(100)))
    assert c.capture_plan(m, 100, 130) == [32, 64, 96, 128]


def test_lru_evicts_least_recent_leaf_and_respects_locks():
    c = small("lru", budget=100)
    a = c.insert([1] * 30, None, {30: "a"})
    c.insert([2] * 30, None, {30: "b"})
    c.observe(c.match([2] * 30))
    c.lock(a.node)
    c.insert([3] * 30, None, {30: "c"})
    freed = c.evict_to_budget()
    assert freed.states == ["b"]  # "a" is older but locked
    c.unlock(a.node)
    freed = c.evict(1)
    assert freed.states == ["a"]
    c.tree.check()


def test_sglang_native_evicts_states_independently_of_kv():
    c = small("sglang_native", budget=10_000)
    c.insert([1] * 50, None, {20: "s20", 50: "s50"})
    c.observe(c.match([1] * 50 + [2]))  # uses s50 -> s20 is the older state
    freed = c.evict(5)
    assert freed.states == ["s20"] and c.tree.kv_tokens == 50


def test_evicting_the_deepest_state_of_a_leaf_drops_its_dead_kv():
    """As SGLang's MambaComponent: a leaf whose last state goes loses the KV nobody can resume from."""
    c = small("sglang_native", budget=10_000)
    c.insert([1] * 50, None, {20: "s20", 50: "s50"})
    c.observe(c.match([1] * 20))  # s20 used as a resume point -> s50 is the older state
    freed = c.evict(5)
    assert freed.states == ["s50"]
    assert c.tree.kv_tokens == 20 and freed.kv_tokens == 30  # truncated to the s20 checkpoint
    c.tree.check()
    c.observe(c.match([1] * 50))  # s20 fresher than nothing else: it goes next, with all the KV
    freed = c.evict(5)
    assert freed.states == ["s20"] and c.tree.kv_tokens == 0
    c.tree.check()


def test_sparse_evicts_what_can_never_fit_before_anything_else():
    """A state whose path KV + state exceed the whole cache cannot be kept with its prefix: evicting
    older servable entries to make room for it would only empty the cache."""
    c = HybridCache("sparse", budget_bytes=100, cost=COST, kv_bytes_per_token=1, state_bytes=10)
    c.alpha = 8.0
    c.insert([1] * 60, None, {60: "old"})  # 70 bytes
    c.observe(c.match([2] * 95))
    c.insert([2] * 95, None, {95: "new"})  # 105 bytes alone: never fits
    freed = c.evict_to_budget()
    assert freed.states == ["new"] and c.bytes_used == 70
    assert c.match([1] * 60).resume_depth == 60
    c.tree.check()


def _score(alpha: float) -> float:
    return -((alpha - 0.5) ** 2)


def test_alpha_tuner_grid_order_and_drift():
    t = AlphaTuner((0.0, 0.5, 1.0, 0.5), workers=2, drift=0.1, retune=True)
    assert t.tune(_score) == 0.5 and t.history[0][2] == (-0.25, 0.0, -0.25, 0.0)
    flat = AlphaTuner((0.0, 1.0, 2.0), workers=1)
    assert flat.tune(lambda a: min(a, 1.0)) == 1.0  # tie between 1 and 2: the first
    assert flat.tune(lambda a: min(a, 1.0), current=2.0) == 2.0  # a tie keeps the alpha in use
    assert flat.tune(lambda a: min(a, 1.0), current=0.0) == 1.0  # a better one still wins
    assert not t.should_retune(0.5)
    assert not t.should_retune(0.55)
    assert t.should_retune(0.7)
    once = AlphaTuner((0.0, 1.0), workers=1)  # the default: tune once, never again
    once.tune(lambda a: a)
    assert not once.should_retune(0.5) and not once.should_retune(0.0) and not once.should_retune(1.0)
    with pytest.raises(ValueError):
        AlphaTuner(())


def test_branch_grid_puts_the_branch_point_at_the_exact_divergence():
    """An engine that captures inside a prefill at any depth (``branch_grid=1``) plans the branch
    point where the request splits the edge, not on the chunk grid; the rest of the plan and the
    flat snapshot (alpha tuner replay) keep it."""
    seq = list(range(10)) + [99, 98]
    plans = {}
    for bg in (None, 1, 2):
        c = small("marconi", grid=4, branch_grid=bg)
        c.insert(list(range(20)), None, {20: 1})
        m = c.match(seq)
        plans[bg] = c.capture_plan(m, len(seq), len(seq) + 3)
        assert HybridCache.from_snapshot(c.snapshot()).branch_grid == c.branch_grid
    assert plans == {None: [8, 15], 1: [10, 15], 2: [10, 15]}
    c = small("marconi", grid=4, branch_grid=4)
    c.insert(list(range(20)), None, {20: 1})
    seq = list(range(11)) + [99]  # diverges at 11: 8 on a 4-grid, 10 on a 2-grid
    assert c.capture_plan(c.match(seq), len(seq), len(seq)) == [8, 12]
    c = small("marconi", grid=4, branch_grid=2)
    c.insert(list(range(20)), None, {20: 1})
    assert c.capture_plan(c.match(seq), len(seq), len(seq)) == [10, 12]
    with pytest.raises(ValueError, match="branch_grid"):
        small("marconi", branch_grid=0)


def test_sparse_exact_branch_keeps_the_grid_point_below_on_probation():
    """``sparse`` with a branch grid finer than its grid: the branch point is exact, the grid point
    below it is planned on probation (a request that diverges a few tokens earlier resumes there);
    a branch above the first grid step (a shared header) plans no state at all."""
    c = small("sparse", budget=10_000, grid=4, branch_grid=1)
    c.insert(list(range(20)), None, {20: 1})
    seq = list(range(11)) + [99]  # diverges at 11
    m = c.match(seq)
    plan = c.plan(m, len(seq), len(seq))
    assert 11 in plan.positions and 11 not in plan.probation
    assert 8 in plan.positions and 8 in plan.probation
    same = small("sparse", budget=10_000, grid=4)  # branch on the grid: no extra fallback
    same.insert(list(range(20)), None, {20: 1})
    p2 = same.plan(same.match(seq), len(seq), len(seq))
    assert 8 in p2.positions and 8 not in p2.probation and 11 not in p2.positions
    header = small("sparse", budget=10_000, grid=4, branch_grid=1)
    header.insert(list(range(20)), None, {20: 1})
    short = [0, 1, 2, 77, 78, 79]  # diverges at 3, above the first grid step
    p3 = header.plan(header.match(short), len(short), len(short))
    assert 3 not in p3.positions

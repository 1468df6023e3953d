"""Unit tests of the radix tree: match purity, splits, checkpoint moves, unused handles, locks,
merges, observations/plans, bad input, and the convexity of the DP cost in the budget."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_sparse.placement import DepthLaw, grid_candidates, solve_dp
from sglang_sparse.tree import RadixTree


def mk(**kw) -> RadixTree:
    return RadixTree(kv_bytes_per_token=2, state_bytes=10, **kw)


def test_empty_tree_and_empty_inputs():
    t = mk()
    m = t.match([])
    assert (m.kv_depth, m.resume_depth, m.path) == (0, 0, ())
    with pytest.raises(ValueError, match="empty"):
        t.insert([], None)
    with pytest.raises(ValueError, match="outside"):
        t.insert([1, 2], None, {3: "s"})
    with pytest.raises(ValueError):
        RadixTree(2, 0)
    with pytest.raises(ValueError):
        t.match(np.zeros((2, 2), dtype=np.int32))


def test_insert_split_moves_checkpoints_right_and_returns_duplicates():
    t = mk()
    kv = np.arange(8)
    r = t.insert([1, 2, 3, 4, 5, 6, 7, 8], kv, {2: "s2", 4: "s4", 6: "s6", 8: "s8"})
    assert r.prefix_len == 0 and r.unused_kv == [] and r.unused_states == []
    # diverge at depth 4 -> split at 4: checkpoints <= 4 go up, deeper ones stay on the lower part
    r2 = t.insert([1, 2, 3, 4, 9, 9], np.arange(100, 106), {4: "dup4", 6: "n6"})
    assert r2.prefix_len == 4
    assert [a.tolist() for a in r2.unused_kv] == [[100, 101, 102, 103]]
    assert r2.unused_states == ["dup4"]
    t.check()
    up = t.root.children[1]
    assert (up.start, up.end) == (0, 4) and dict(up.checkpoints) == {2: "s2", 4: "s4"}
    low = up.children[5]
    assert (low.start, low.end) == (4, 8) and dict(low.checkpoints) == {6: "s6", 8: "s8"}
    assert up.kv.tolist() == [0, 1, 2, 3] and low.kv.tolist() == [4, 5, 6, 7]
    assert t.bytes_used == (8 + 2) * 2 + 5 * 10


def test_match_is_pure_and_finds_deepest_checkpoint():
    t = mk()
    t.insert(list(range(10)), None, {3: "a", 7: "b"})
    before = (t.clock, t.num_nodes)
    m = t.match([0, 1, 2, 3, 4, 5, 6, 99])
    assert (m.kv_depth, m.resume_depth, m.ckpt_handle) == (7, 7, "b")
    m2 = t.match([0, 1, 2, 3, 4, 5, 88])
    assert (m2.kv_depth, m2.resume_depth, m2.ckpt_handle) == (6, 3, "a")
    assert (t.clock, t.num_nodes) == before and t.num_nodes == 1  # no split by match
    assert t.kv_handles(m2) == [None]


def test_kv_offset_requires_cached_prefix():
    t = mk()
    with pytest.raises(ValueError, match="already be cached"):
        t.insert([1, 2, 3], np.arange(1), kv_offset=2)


def test_locks_protect_and_unbalanced_unlock_errors():
    t = mk()
    r = t.insert([1, 2, 3], None, {3: "s"})
    t.lock(r.node)
    with pytest.raises(ValueError):
        t.drop_leaf(r.node)
    with pytest.raises(ValueError):
        t.drop_checkpoint(r.node, 3)
    t.unlock(r.node)
    with pytest.raises(ValueError, match="unlock"):
        t.unlock(r.node)
    f = t.drop_leaf(r.node)
    assert f.states == ["s"] and f.bytes == 3 * 2 + 10 and t.bytes_used == 0
    t.check()


def test_merge_with_child_concatenates():
    t = mk()
    t.insert([1, 2, 3, 4], np.arange(4), {2: "a"})
    t.insert([1, 2, 7], np.arange(10, 13), {})
    t.check()
    up = t.root.children[1]
    leaf7 = up.children[7]
    t.drop_leaf(leaf7)
    merged = t.merge_with_child(up)
    t.check()
    assert merged.key.tolist() == [1, 2, 3, 4] and merged.kv.tolist() == [0, 1, 2, 3]
    assert dict(merged.checkpoints) == {2: "a"} and t.num_nodes == 1


def test_observe_feeds_histograms_and_plans_on_grid():
    t = mk(refresh=3, plan_budget=2, grid=4)
    t.insert(list(range(40)), None, {})
    for d in (9, 9, 21, 21, 30):
        seq = list(range(d)) + [1000 + d]
        m = t.match(seq)
        assert m.kv_depth == d
        t.observe(m)
    node = t.root.children[0]
    assert node.hist.observations == 5 and node.last_access == t.clock
    assert set(node.plan) <= {8, 20} | set(range(4, 41, 4))
    m = t.match(list(range(30)) + [5000])
    caps = t.planned_captures(m)
    assert all(0 < p <= 30 for p in caps) and caps


def test_ancestors_observe_their_end_depth():
    t = mk(refresh=100)
    t.insert([1, 2, 3, 4], None)
    t.insert([1, 2, 9, 9], None)
    m = t.match([1, 2, 3, 4, 5])
    t.observe(m)
    up = t.root.children[1]
    d, w = up.hist.items()
    assert d.tolist() == [2]  # clipped to the ancestor's end
    d, w = up.children[3].hist.items()
    assert d.tolist() == [4]


def test_dp_cost_is_convex_in_budget():
    """Thinning by marginal gain relies on cost(M) being convex for a fixed law on a line."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        n = int(rng.integers(200, 3000))
        depths = np.concatenate([rng.integers(1, n, size=50), rng.normal(n / 2, n / 8, size=200).clip(1, n)])
        law = DepthLaw.from_depths(depths, None, grid_candidates(n, 64, include_end=True), 0)
        costs = np.array([solve_dp(law, m).cost for m in range(0, 12)])
        gains = -np.diff(costs)
        assert np.all(gains >= -1e-6 * costs[0]), trial
        assert np.all(np.diff(gains) <= 1e-6 * max(costs[0], 1.0)), (trial, gains)

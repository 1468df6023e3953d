"""Unit tests of the radix tree: match purity, splits, checkpoint moves, unused handles, locks,
merges, observations/plans, bad input, and the convexity of the DP cost in the budget."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_sparse.placement import DepthLaw, grid_candidates, solve_dp
from sglang_sparse.policy.choose import PlanTable, _merge_hist, _split_hist
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
    t = mk()
    t.listener = plans = PlanTable(refresh=3, plan_budget=2, grid=4)
    t.insert(list(range(40)), None, {})
    for d in (9, 9, 21, 21, 30):
        seq = list(range(d)) + [1000 + d]
        m = t.match(seq)
        assert m.kv_depth == d
        plans.observe(t, m)
    node = t.root.children[0]
    assert plans.hist(node).observations == 5 and node.last_access == t.clock
    assert set(plans.plan(node)) <= {8, 20} | set(range(4, 41, 4))
    m = t.match(list(range(30)) + [5000])
    caps = plans.planned_captures(t, m)
    assert all(0 < p <= 30 for p in caps) and caps


def test_ancestors_observe_their_end_depth():
    t = mk()
    t.listener = plans = PlanTable(refresh=100)
    t.insert([1, 2, 3, 4], None)
    t.insert([1, 2, 9, 9], None)
    m = t.match([1, 2, 3, 4, 5])
    plans.observe(t, m)
    up = t.root.children[1]
    d, w = plans.hist(up).items()
    assert d.tolist() == [2]  # clipped to the ancestor's end
    d, w = plans.hist(up.children[3]).items()
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


# ---------------------------------------------------------------------- hot paths (issue 4)


def _dump(t: RadixTree) -> list:
    """Canonical structure of a tree (edges, checkpoints, locks), independent of uids."""
    out = []
    for n in t.nodes():
        out.append((n.start, n.key.tolist(), dict(n.checkpoints), n.lock_ref, n.last_access))
    return sorted(out, key=lambda e: (e[0], e[1]))


@pytest.mark.parametrize("where", [0, 1, 15, 16, 17, 100, 16_383, 16_384, 16_385, 32_768, 39_999, None])
def test_lcp_chunked_matches_naive(where):
    from sglang_sparse.tree.lcp import _LCP_HEAD, lcp, lcp_near, lcp_numpy

    rng = np.random.default_rng(0)
    key = rng.integers(0, 2**31 - 1, size=40_000, dtype=np.int32)
    toks = np.concatenate([rng.integers(0, 9, size=7, dtype=np.int32), key])
    if where is not None:
        toks[7 + where] ^= 1
    expect = 40_000 if where is None else where
    for f in (lcp, lcp_near, lcp_numpy, lambda *a: lcp_numpy(*a, first=_LCP_HEAD)):
        assert f(key, toks, 7) == expect
        assert f(key, toks, 7, 0) == expect
        s = 5
        assert f(key, toks, 7 + s, s) == max(expect - s, 0) if expect >= s else True
        assert f(key[:10], toks, 7) == min(10, expect)
        assert f(key, toks[: 7 + 3], 7) == min(3, expect)
        assert f(key, toks, len(toks)) == 0


def test_as_tokens_fast_paths_and_validation():
    from array import array

    from sglang_sparse.tree import as_tokens

    for src in ([3, 1, 2], (3, 1, 2), array("q", [3, 1, 2]), np.array([3, 1, 2], dtype=np.int64)):
        a = as_tokens(src)
        assert a.dtype == np.int32 and a.tolist() == [3, 1, 2]
    x = np.array([1, 2], dtype=np.int32)
    assert as_tokens(x) is x
    assert as_tokens([]).size == 0
    with pytest.raises(ValueError):
        as_tokens([2**40, 1])
    with pytest.raises(ValueError):
        as_tokens([1.5, 2.0])
    with pytest.raises(ValueError):
        as_tokens(np.zeros((2, 2), dtype=np.int32))
    t = mk()
    t.insert([5, 6, 7, 8], None)
    assert t.match([5, 6, 9]).kv_depth == 2 and t.match((5, 6, 7, 8, 1)).kv_depth == 4


def test_match_result_fast_constructor_is_a_plain_match_result():
    import dataclasses

    from sglang_sparse.tree import MatchResult

    t = mk()
    t.insert([1, 2, 3], None, {2: "s"})
    m = t.match([1, 2, 9])
    ref = MatchResult(2, 2, m.node, m.node, "s", (m.node,))
    assert m == ref and hash(m) == hash(ref) and type(m) is MatchResult
    assert m.versions == (m.node.version,) and m.tokens.tolist() == [1, 2, 9]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.kv_depth = 3  # type: ignore[misc]
    assert "tokens" not in repr(m)


def test_insert_hint_equals_plain_insert_randomised():
    """insert(hint=match) gives the same results and tree as a plain insert, for fresh hints, hints
    of a shorter prompt (insert prompt + output), stale hints (tree changed) and wrong hints."""
    rng = np.random.default_rng(1)
    a, b = mk(), mk()
    old_hints = []
    for step in range(400):
        n = int(rng.integers(1, 30))
        seq = rng.integers(0, 3, size=n).tolist()
        prompt = seq[: int(rng.integers(1, n + 1))]
        mode = step % 4
        if mode == 0:
            hint = a.match(seq)
        elif mode == 1:
            hint = a.match(prompt)  # hint of a prefix; the insert is longer
        elif mode == 2:
            hint = old_hints[int(rng.integers(len(old_hints)))] if old_hints else None
        else:
            hint = a.match(rng.integers(0, 3, size=n).tolist())  # unrelated tokens
        old_hints.append(a.match(prompt))
        ck = {int(p): ("s", step, int(p)) for p in rng.integers(1, n + 1, size=2)}
        ra = a.insert(seq, np.arange(n), ck, hint=hint)
        rb = b.insert(seq, np.arange(n), ck)
        assert ra.prefix_len == rb.prefix_len
        assert [u.tolist() for u in ra.unused_kv] == [u.tolist() for u in rb.unused_kv]
        assert ra.unused_states == rb.unused_states
        if step % 7 == 0:  # evict an LRU leaf in both (makes old hints stale)
            for t in (a, b):
                leaf = t.lru_leaf()
                if leaf is not None:
                    t.drop_leaf(leaf)
        if step % 5 == 0:
            a.check()
            b.check()
        assert _dump(a) == _dump(b)


def test_hint_from_another_tree_or_mutated_path_is_ignored():
    a, b = mk(), mk()
    for t in (a, b):
        t.insert([1, 2, 3, 4], None)
    h = b.match([1, 2, 3, 4, 5])
    r = a.insert([1, 2, 3, 4, 5], None, hint=h)  # foreign hint: full walk
    assert r.prefix_len == 4
    a.check()
    h = a.match([1, 2, 7])
    a.insert([1, 2, 3, 9], None)  # splits the edge the hint points into
    r = a.insert([1, 2, 7], None, hint=h)
    assert r.prefix_len == 2
    a.check()
    assert sorted(n.key.tolist() for n in a.nodes()) == [[1, 2], [3], [4], [5], [7], [9]]


def test_checkpoint_map_behaves_like_sorted_dict():
    import pickle

    from sortedcontainers import SortedDict

    from sglang_sparse.tree.core import CheckpointMap

    rng = np.random.default_rng(2)
    cm, sd = CheckpointMap(), SortedDict()
    for _ in range(2000):
        op = int(rng.integers(6))
        k = int(rng.integers(0, 40))
        if op <= 1:
            cm[k] = sd[k] = ("h", k)
        elif op == 2 and k in sd:
            del cm[k], sd[k]
        elif op == 3 and sd:
            i = int(rng.integers(-len(sd), len(sd)))
            assert cm.peekitem(i) == sd.peekitem(i)
            assert cm.popitem(i) == sd.popitem(i)
        elif op == 4:
            assert cm.pop(k, None) == sd.pop(k, None)
        else:
            assert cm.bisect_left(k) == sd.bisect_left(k) and cm.bisect_right(k) == sd.bisect_right(k)
        assert list(cm) == list(sd) and cm.keys() == list(sd.keys()) and cm.items() == list(sd.items())
        assert cm.values() == list(sd.values()) and len(cm) == len(sd) and bool(cm) == bool(sd)
        assert cm == dict(sd) and dict(cm) == dict(sd)
    cp = pickle.loads(pickle.dumps(cm))
    assert type(cp) is CheckpointMap and cp.items() == cm.items()
    cm.update({100: 1, -1: 2})
    cm.setdefault(50, 3)
    assert cm.keys() == sorted(cm.keys()) and cm.copy().items() == cm.items()
    cm.clear()
    assert not cm and cm.keys() == []
    n = mk().root
    assert isinstance(n.checkpoints, CheckpointMap)


def test_eviction_index_tracks_leaves_locks_and_recency():
    t = mk()
    r1 = t.insert([1, 2, 3], None, {3: "a"})
    r2 = t.insert([1, 2, 4], None, {2: "b"})
    r3 = t.insert([5, 6], None)
    t.check()
    up = t.root.children[1]
    assert t.evictable_leaves == {r1.node, r2.node, r3.node} and t.evictable_ckpt_nodes == {up}

    def lru_order() -> list:
        return sorted(t.evictable_leaves, key=lambda n: (n.last_access, n.uid))

    assert lru_order() == [r1.node, r2.node, r3.node] and t.lru_leaf() is r1.node
    t.touch(t.match([1, 2, 3]))  # r1 becomes the most recent
    assert lru_order() == [r2.node, r3.node, r1.node] and t.lru_leaf() is r2.node
    t.lock(r2.node)
    assert r2.node not in t.evictable_leaves and up not in t.evictable_ckpt_nodes
    assert t.lru_leaf() is r3.node
    t.check()
    t.unlock(r2.node)
    assert t.lru_leaf() is r2.node and up in t.evictable_ckpt_nodes
    t.drop_leaf(r2.node)
    t.drop_leaf(r1.node)  # up becomes a leaf (with its checkpoint)
    t.check()
    assert up in t.evictable_leaves and up not in t.evictable_ckpt_nodes
    t.drop_checkpoint(up, 2)
    t.check()
    for _ in range(200):  # heap stays compact under churn
        t.touch(t.match([5, 6]))
        t.touch(t.match([1, 2]))
    assert len(t.leaf_heap) <= 2 * len(t.evictable_leaves) + 64
    t.check()
    while (leaf := t.lru_leaf()) is not None:
        t.drop_leaf(leaf)
    assert t.num_nodes == 0 and not t.evictable_leaves
    t.check()


def test_split_at_and_truncate_are_exact_and_validated() -> None:
    t = RadixTree(2, 10)
    t.insert(list(range(100)), None, {30: "a", 60: "b", 100: "c"})
    leaf = t.match(list(range(100))).node
    up = t.split_at(leaf, 40)
    assert (up.start, up.end, leaf.start, leaf.end) == (0, 40, 40, 100)
    assert list(up.checkpoints) == [30] and list(leaf.checkpoints) == [60, 100]
    assert t.bytes_used == 100 * 2 + 3 * 10
    t.check()
    freed, top = t.truncate(leaf, 70)
    assert top.end == 70 and not top.children and list(top.checkpoints) == [60]
    assert freed.states == ["c"] and freed.kv_tokens == 30 and freed.bytes == 30 * 2 + 10
    assert t.bytes_used == 70 * 2 + 2 * 10 and t.match(list(range(100))).kv_depth == 70
    t.check()
    with pytest.raises(ValueError, match="strictly inside"):
        t.split_at(top, 70)
    with pytest.raises(ValueError, match="not a live leaf"):
        t.truncate(up, 20)  # has a child
    t.lock(top)
    with pytest.raises(ValueError, match="locked"):
        t.truncate(top, 50)


def test_split_merge_cycles_keep_observation_count() -> None:
    """An edge split and merged again (a live session's path, turn after turn) keeps its
    observation count: a sum on merge doubled it every cycle and overflowed int64 in snapshots."""
    from sglang_sparse.placement.dp import DepthHistogram

    h = DepthHistogram(0.99, 10)
    for d in (64, 128, 128, 300):
        h.observe(d)
    total = h.total
    for _ in range(200):
        up, down = _split_hist(h, 100)
        h = _merge_hist(up, down, 100)
    assert h.observations == 4
    d, w = h.items()
    assert d.tolist() == [64, 128, 300] and abs(w.sum() - total) < 1e-9 * total  # mass kept

"""Flat tree snapshots (issue 9): nothing recursive in tree depth -- snapshot, copy, pickle, tuning.

A 100,000-level chain (far beyond the ~250 levels where per-level recursion used to fail) goes
through every path under the default recursion limit, and every round trip (``to_snapshot`` ->
``from_snapshot``, ``copy.deepcopy``, ``pickle``) takes exactly the same future decisions.
"""

from __future__ import annotations

import copy
import functools
import itertools
import pickle
import sys

import numpy as np
import pytest

from sglang_sparse.placement import DepthHistogram
from sglang_sparse.policy import AlphaTuner, CacheSnapshot, HybridCache
from sglang_sparse.policy.choose import EdgePlan, PlanTable
from sglang_sparse.sim import cost_model, synthetic_trace
from sglang_sparse.sim.common import prepare_requests
from sglang_sparse.sim.simulator import _serve, _snapshot, warm_replay_score
from sglang_sparse.tree import RadixTree, SnapshotError, TreeSnapshot, TreeSnapshotBuilder

COST = cost_model("qwen3-next-80b-a3b")
DEPTH = 100_000
EDGE = 2  # tokens per chain edge


def _snap_equal(a: TreeSnapshot, b: TreeSnapshot) -> None:
    """Assert two snapshots describe the same tree (every field, handles by value)."""
    for name in TreeSnapshot.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert np.array_equal(np.asarray(x), np.asarray(y)), name
        else:
            assert x == y, name


def _chain_snapshot(depth: int = DEPTH) -> TreeSnapshot:
    """A ``depth``-node chain (one multi-turn session) built directly, with a checkpoint every 3rd
    edge and increasing access clocks."""
    b = TreeSnapshotBuilder(COST.kv_bytes_per_token, COST.state_bytes)
    p = 0
    for i in range(depth):
        end = EDGE * (i + 1)
        p = b.add_node(p, [i % 7 + 1, 9], checkpoints={end: i} if i % 3 == 2 else None, last_access=i + 1)
    return b.build()


def _plans_equal(a: PlanTable, b: PlanTable) -> None:
    """Assert two plan tables hold the same entries (histograms bit-exact) and configuration."""
    assert (a.gamma, a.refresh, a.plan_budget, a.grid) == (b.gamma, b.refresh, b.plan_budget, b.grid)
    assert a.entries.keys() == b.entries.keys()
    for u, x in a.entries.items():
        y = b.entries[u]
        assert (x.plan, x.fresh) == (y.plan, y.fresh), u
        hx, hy = x.hist, y.hist
        assert (hx is None) == (hy is None), u
        if hx is not None:
            assert list(hx._bins.items()) == list(hy._bins.items()), u  # noqa: SLF001 - exact
            assert (hx._scale, hx._since_refresh, hx._n) == (hy._scale, hy._since_refresh, hy._n)  # noqa: SLF001


def _chain_plans(depth: int = DEPTH) -> PlanTable:
    """The chain's plan table (node uids 2 .. depth + 1): every edge mature, every past request
    continued the session past it, so each plans its end."""
    table = PlanTable()
    for i in range(depth):
        end = EDGE * (i + 1)
        hist = DepthHistogram(0.99, 10)
        for _ in range(12):
            hist.observe(end)
        hist.mark_refreshed()
        table.entries[i + 2] = EdgePlan(hist, (end,), True)
    return table.snapshot()


@pytest.fixture(scope="module")
def chain() -> RadixTree:
    assert sys.getrecursionlimit() <= 1000  # the default: any per-level recursion would fail
    return RadixTree.from_snapshot(_chain_snapshot())


def test_deep_chain_snapshot_copy_and_pickle_round_trip(chain: RadixTree) -> None:
    chain.check()
    assert chain.num_nodes == DEPTH and chain.kv_tokens == EDGE * DEPTH
    assert chain.num_states == DEPTH // 3
    snap = chain.to_snapshot()
    assert snap.num_nodes == DEPTH + 1 and int(snap.parent.max()) == DEPTH - 1
    for copied in (
        RadixTree.from_snapshot(snap),
        copy.deepcopy(chain),
        pickle.loads(pickle.dumps(chain)),
    ):
        copied.check()
        assert copied.num_nodes == chain.num_nodes and copied.bytes_used == chain.bytes_used
        _snap_equal(copied.to_snapshot(), snap)
        assert copied.lru_leaf().uid == chain.lru_leaf().uid
    # the copy is independent: mutating it leaves the original untouched
    cp = copy.deepcopy(chain)
    leaf = cp.lru_leaf()
    cp.drop_leaf(leaf)
    cp.check()
    assert cp.num_nodes == DEPTH - 1 and chain.num_nodes == DEPTH


def test_deep_chain_cache_is_tuned_from_its_flat_snapshot(chain: RadixTree) -> None:
    path = chain.path_tokens(chain.lru_leaf())
    assert len(path) == EDGE * DEPTH
    budget = chain.bytes_used + 2 * COST.state_bytes + 200 * COST.kv_bytes_per_token  # evicts
    plans = _chain_plans()
    snap = CacheSnapshot(chain.to_snapshot(), "sparse", budget, cost=COST, plans=plans)
    cache = HybridCache.from_snapshot(snap)
    cache.tree.check()
    assert len(cache.plans.entries) == DEPTH and cache.plans.plan(chain.lru_leaf()) == (EDGE * DEPTH,)
    # copies of the whole cache (tree + evictor + tail prior) are flat as well
    for cp in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert cp.evictor.tree is cp.tree and cp.tree.listener is cp.plans
        _snap_equal(cp.tree.to_snapshot(), snap.tree)
        _plans_equal(cp.plans, plans)
    # a small window of continuations of the deep session and a branch half-way up
    rng = np.random.default_rng(0)
    window = []
    for base in (len(path), len(path) // 2):
        inp = np.concatenate([path[:base], rng.integers(100, 200, 300).astype(np.int32)])
        window.append((inp, np.concatenate([inp, rng.integers(100, 200, 50).astype(np.int32)])))
    blob = pickle.dumps(_snapshot(cache, None))  # what the process-pool tuner ships: flat data
    score = warm_replay_score(pickle.loads(blob), window, COST, 0.5)
    assert score > 0
    tuner = AlphaTuner(grid=(0.0, 0.5), window=len(window), workers=2)  # process pool: pickles snap
    alpha = tuner.tune(functools.partial(warm_replay_score, snap, window, COST), current=0.0)
    scores = tuner.history[-1][2]
    assert alpha in (0.0, 0.5) and scores[1] == score and scores[0] > 0  # = a replay in this process
    # the snapshot itself was never modified by the replays
    _snap_equal(snap.tree, chain.to_snapshot())
    _plans_equal(snap.plans, plans)


def _random_ops(cache: HybridCache, prepared: list, rng: np.random.Generator) -> list:
    """Serve requests, with random locks and external evictions in between; returns the decisions."""
    out = []
    ids = itertools.count(10_000)
    for inp, full in prepared:
        out.append(_serve(cache, inp, full, COST, ids))
        r = rng.random()
        if r < 0.2 and cache.tree.lru_leaf() is not None:
            freed = cache.tree.drop_leaf(cache.tree.lru_leaf())
            out.append(("drop", len(freed.kv), len(freed.states)))
        elif r < 0.3:
            m = cache.match(inp[: len(inp) // 2])
            out.append(("match", m.kv_depth, m.resume_depth, m.node.uid))
        out.append(cache.evict(int(cache.bytes_used * 0.1)).states)
    out.append(cache.tree.to_snapshot().uid.tolist())
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_caches_round_trip_to_the_same_future_decisions(seed: int) -> None:
    kind = ("doc_qa", "system_prompts", "agent")[seed % 3]
    prepared = prepare_requests(synthetic_trace(kind, 120, seed=seed, scale=0.2))
    budget = 8 * COST.state_bytes + 12_000 * COST.kv_bytes_per_token
    cache = HybridCache("sparse", budget_bytes=budget, cost=COST, alpha=0.5)
    ids = itertools.count(1)
    for inp, full in prepared[:60]:
        _serve(cache, inp, full, COST, ids)
    m = cache.match(prepared[0][0])
    cache.lock(m.node)  # a held lock survives the round trip
    snap = cache.snapshot()
    copies = [
        HybridCache.from_snapshot(snap),
        HybridCache.from_snapshot(pickle.loads(pickle.dumps(snap))),
        copy.deepcopy(cache),
        pickle.loads(pickle.dumps(cache)),
    ]
    ref_snap = cache.tree.to_snapshot()
    if kind == "agent":  # online sessions: chain ids on the nodes, their statistics in the cache
        assert cache.chains.chains and (ref_snap.chain >= 0).any()
    for cp in copies:
        cp.tree.check()
        assert cp.tree.listener is cp.plans
        _snap_equal(cp.tree.to_snapshot(), ref_snap)
        _plans_equal(cp.plans, cache.plans)
        assert cp.alpha == cache.alpha and cp.tail.hist._bins == cache.tail.hist._bins  # noqa: SLF001
        assert _chain_state(cp) == _chain_state(cache)
        assert cp.evictor.chains is cp.chains and cp.evictor.probation is cp.probation
    expected = _random_ops(cache, prepared[60:], np.random.default_rng(seed + 100))
    for cp in copies:
        assert _random_ops(cp, prepared[60:], np.random.default_rng(seed + 100)) == expected
        cp.tree.check()
        _snap_equal(cp.tree.to_snapshot(), cache.tree.to_snapshot())
        _plans_equal(cp.plans, cache.plans)
        assert _chain_state(cp) == _chain_state(cache)


def _chain_state(cache: HybridCache) -> tuple:
    """Everything the online sessions' tracker holds (:mod:`sglang_sparse.policy.choose`)."""
    ch = cache.chains
    return (ch.chains, ch.next_id, ch.gap_sum, ch.gaps, ch.continuation_share, ch.prior_gap(), ch.collect_at)


def test_builder_builds_an_engine_tree() -> None:
    b = TreeSnapshotBuilder(2, 100)
    a = b.add_node(0, [1, 2, 3], checkpoints={3: "s"}, last_access=1, lock_ref=1)
    b.add_node(a, [4], kv="kv", last_access=2, lock_ref=1)
    b.add_node(a, [7, 8], kv="kv2", checkpoints={5: "t"}, ckpt_access={5: 1}, last_access=3)
    t = RadixTree.from_snapshot(b.build())
    t.check()
    assert (t.num_nodes, t.num_states, t.kv_tokens, t.clock) == (3, 2, 6, 3)
    m = t.match([1, 2, 3, 7, 8, 9])
    assert (m.kv_depth, m.resume_depth, m.node.kv) == (5, 5, "kv2")
    assert t.lru_leaf() is m.node and t.evictable_leaves == {m.node}  # the other leaf is locked


def test_builder_rejects_bad_snapshots() -> None:
    def fresh() -> TreeSnapshot:
        b = TreeSnapshotBuilder(2, 100)
        a = b.add_node(0, [1, 2, 3], checkpoints={3: "s"}, last_access=1, lock_ref=1)
        b.add_node(a, [4], last_access=2, lock_ref=1)
        b.add_node(a, [5], last_access=3)
        return b.build()

    RadixTree.from_snapshot(fresh()).check()
    cases = {
        "parent index": lambda s: s.parent.__setitem__(2, 3),
        "same token": lambda s: s.keys.__setitem__(4, 4),
        "outside its node": lambda s: s.ckpt_pos.__setitem__(0, 4),
        "lock_ref below": lambda s: s.lock_ref.__setitem__(1, 0),
        "start must equal": lambda s: s.start.__setitem__(2, 2),
        "uids must be unique": lambda s: s.uid.__setitem__(2, 1),
        "newer than clock": lambda s: s.last_access.__setitem__(1, 99),
        "one per node": lambda s: s.kv.append(None),
    }
    for msg, breaker in cases.items():
        s = fresh()
        breaker(s)
        with pytest.raises(SnapshotError, match=msg):
            RadixTree.from_snapshot(s)
    with pytest.raises(SnapshotError, match="non-empty edge"):
        TreeSnapshotBuilder(2, 100).add_node(0, [])

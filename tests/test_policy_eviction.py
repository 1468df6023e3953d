"""The incremental :class:`Evictor` makes exactly the decisions of :class:`ReferenceEvictor`.

Differential tests: the same random workload (insert with random checkpoints, match + observe, lock,
unlock, evict to budget / by bytes, alpha changes, eviction primitives called from outside the
evictor as the SGLang shadow does, deep copies) runs on two deep copies of one cache, one evicting
with :class:`Evictor`, the other with :class:`ReferenceEvictor`. After every step the freed handles
(KV slices, state ids, in order), the byte counts and the whole trees (structure, handles, clocks,
locks, versions, eviction index) must be identical, and the evictor's candidate index must equal a
from-scratch computation (:meth:`CandidateIndex.verify`). Configs: every eviction config of the
registry plus both ``ckpt_recency`` modes for every candidate scope, min-max and decayed recency,
chain recency (online sessions, :mod:`sglang_sparse.policy.choose`) with and without the
superseded demotion, alpha 0 and > 0, budgets small enough for ``drop_unservable`` to fire. The
workloads continue sequences from their end (sessions) and keep states on probation, so chains,
superseded states, provisional leaves and probation states all reach the eviction rounds.
"""

from __future__ import annotations

import copy
import math
import pickle
import zlib
from dataclasses import replace

import numpy as np
import pytest
from eviction_reference import ReferenceEvictor  # tests/eviction_reference.py
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_sparse.policy import POLICIES, HybridCache, PolicySpec
from sglang_sparse.policy.evict import (
    CKPT,
    LEAF,
    CandidateTerms,
    EvictionConfig,
    Evictor,
    ScoredCandidate,
    det_log1p,
    effective_recency,
)
from sglang_sparse.sim import cost_model
from sglang_sparse.tree import Freed

COST = cost_model("qwen3-next-80b-a3b")
KV_B, STATE_B = 1, 4

# Every eviction config of the registry, and both recency modes for every candidate scope.
_REGISTRY = {p.eviction for p in POLICIES.values()}
_EXTRA = {
    EvictionConfig(node_states=ns, ckpt_scope=scope, ckpt_recency=rec, drop_unservable=du)
    for ns in (True, False)
    for scope in ("none", "interior", "all")
    for rec in ("node", "own")
    for du in (True, False)
}
# Decayed recency (recency_scale, ticks) on every per-checkpoint-clock config.
_DECAYED = {replace(c, recency_scale=3.0) for c in _EXTRA if c.ckpt_recency == "own"}
# Chain recency (online sessions) on the decayed configs that score checkpoints, with and without
# a superseded demotion (ticks).
_CHAINED = {
    replace(c, chain_recency=True, superseded_demotion=d)
    for c in _DECAYED
    if c.ckpt_scope != "none"
    for d in (0.0, 5.0)
}
CONFIGS = sorted(_REGISTRY | _EXTRA | _DECAYED | _CHAINED, key=repr)


def make_cache(
    cfg: EvictionConfig, budget: int, admission: str = "sparse", evictor: type[CandidateTerms] = Evictor
) -> HybridCache:
    spec = PolicySpec("test", admission, cfg, flop_aware=True)
    return HybridCache(
        spec,
        budget_bytes=budget,
        cost=COST,
        kv_bytes_per_token=KV_B,
        state_bytes=STATE_B,
        refresh=2,
        grid=4,
        evictor=evictor,
    )


def pair(
    cfg: EvictionConfig, budget: int, alpha: float, admission: str = "sparse"
) -> tuple[HybridCache, HybridCache]:
    """Two identical empty caches: ``new`` evicts with :class:`Evictor`, ``ref`` with the reference."""
    new = make_cache(cfg, budget, admission)
    ref = make_cache(cfg, budget, admission, evictor=ReferenceEvictor)
    new.alpha = ref.alpha = alpha
    assert type(new.evictor) is Evictor and type(ref.evictor) is ReferenceEvictor
    return new, ref


def dump(cache: HybridCache) -> tuple:
    """Everything observable about a tree (uids are allocated identically in both copies)."""
    t = cache.tree
    nodes = [
        (
            n.uid,
            n.parent.uid,
            n.start,
            n.end,
            n.key.tolist(),
            None if n.kv is None else np.asarray(n.kv).tolist(),
            n.checkpoints.items(),
            sorted(n.ckpt_access.items()),
            n.last_access,
            n.lock_ref,
            n.version,
            cache.plans.plan(n),
            n.seq_end,
            n.chain,
        )
        for n in t.nodes()
    ]
    lru = t.lru_leaf()
    ch = cache.chains
    return (
        nodes,
        sorted(cache.probation),
        sorted(ch.chains.items()),
        (ch.next_id, ch.gap_sum, ch.gaps, ch.continuation_share, ch.prior_gap()),
        t.clock,
        t.kv_tokens,
        t.num_states,
        t.num_nodes,
        t._uid,  # noqa: SLF001
        sorted(n.uid for n in t.evictable_leaves),
        sorted(n.uid for n in t.evictable_ckpt_nodes),
        None if lru is None else lru.uid,
    )


def freed_key(f: Freed) -> tuple:
    return ([np.asarray(h).tolist() for h in f.kv], list(f.states), f.kv_tokens, f.bytes)


def by_uid(cache: HybridCache, uid: int):
    return next(n for n in cache.tree.nodes() if n.uid == uid)


def reference_scores(ev: Evictor) -> dict[tuple[int, int, int], tuple[float, bool]]:
    """What ``PolicyShadow.state_scores`` computed before ``Evictor.scores`` existed."""
    raw = [(k, n, p, ev._candidate(k, n, p)) for k, n, p in ev.candidates()]  # noqa: SLF001
    raw = [r for r in raw if r[3] is not None]
    if not raw:
        return {}
    cfg = ev.config
    clock = ev.chain_clock()
    # a chain candidate's recency comes from its session's due tick (a provisional one's from the
    # tracker's prior gap)
    rs = [effective_recency(c[0], c[5], c[6], c[7], clock) for *_, c in raw]
    vs = [c[1] for *_, c in raw]
    rmin, rspan = min(rs), (max(rs) - min(rs)) or 1.0
    vmin, vspan = min(vs), (max(vs) - min(vs)) or 1.0
    tau = cfg.recency_scale
    if tau is not None:  # decayed recency: (t - t_min) / tau + ln(1 + alpha * e)
        return {
            (n.uid, p, k): (
                (r - rmin) / tau + float(det_log1p(np.array([ev.alpha * (c[1] - vmin) / vspan]))[0]),
                c[3],
            )
            for (k, n, p, c), r in zip(raw, rs, strict=True)
        }
    return {
        (n.uid, p, k): ((c[0] - rmin) / rspan + ev.alpha * (c[1] - vmin) / vspan, c[3]) for k, n, p, c in raw
    }


class Workload:
    """Applies one op to both caches and checks they stay identical."""

    def __init__(self, cfg: EvictionConfig, budget: int, alpha: float, admission: str = "sparse") -> None:
        self.new, self.ref = pair(cfg, budget, alpha, admission)
        self.next_slot = 0
        self.next_state = 0
        self.locked: list[int] = []  # uids locked in both
        self.evictions = 0

    # -- ops (``self.both(fn)`` runs ``fn(cache)`` on both and returns the two results)
    def both(self, fn):
        return fn(self.new), fn(self.ref)

    def insert(self, seq: list[int], ckpt_mask: int, full_kv: bool, observe: bool) -> None:
        kv = np.arange(self.next_slot, self.next_slot + len(seq), dtype=np.int64)
        self.next_slot += len(seq)

        def run(c: HybridCache):
            m = c.match(seq)
            if observe:
                c.observe(m)
            c.lock(m.node)
            off = 0 if full_kv else m.kv_depth
            plan = c.plan(m, len(seq))
            extra = [p for p in range(1, len(seq) + 1) if (ckpt_mask >> (p % 16)) & 1]
            ck = {p: 1000 * self.next_state + p for p in sorted(set(plan.positions) | set(extra))}
            res = c.insert(seq, kv[off:], ck, kv_offset=off, probation=plan.probation)
            c.unlock(m.node)
            return res.prefix_len, [np.asarray(h).tolist() for h in res.unused_kv], res.unused_states

        a, b = self.both(run)
        self.next_state += 1
        assert a == b

    def extend(self, i: int, tail: list[int], ckpt_mask: int) -> None:
        """A session's next turn: the ``i``-th sequence-end leaf's whole path plus ``tail`` (a
        continuation from its end, so chains form), inserted as :meth:`insert` does."""
        ends = sorted(n.uid for n in self.new.tree.nodes() if n.seq_end and not n.children)
        if not ends:
            return
        uid = ends[i % len(ends)]
        seq = self.new.tree.path_tokens(by_uid(self.new, uid)).tolist() + tail
        self.insert(seq, ckpt_mask, False, True)

    def observe(self, seq: list[int]) -> None:
        self.both(lambda c: c.observe(c.match(seq)))

    def lock(self, seq: list[int]) -> None:
        m = self.new.match(seq)
        if m.kv_depth:
            uid = m.node.uid
            self.both(lambda c: c.lock(by_uid(c, uid)))
            self.locked.append(uid)

    def unlock(self, i: int) -> None:
        if self.locked:
            uid = self.locked.pop(i % len(self.locked))
            self.both(lambda c: c.unlock(by_uid(c, uid)))

    def evict(self, nbytes: int | None) -> None:
        if nbytes is None:
            a, b = self.both(lambda c: c.evict_to_budget())
        else:
            a, b = self.both(lambda c: c.evict(nbytes))
        assert freed_key(a) == freed_key(b)
        self.evictions += 1

    def set_alpha(self, alpha: float) -> None:
        def run(c: HybridCache) -> None:
            c.alpha = alpha

        self.both(run)

    def external(self, op: str, i: int) -> None:
        """An eviction primitive called from outside the evictor (the SGLang shadow does this)."""
        t = self.new.tree
        if op == "drop_ckpt":
            cands = [(n.uid, p) for n in t.nodes() if n.lock_ref == 0 for p in n.checkpoints]
            if cands:
                uid, p = cands[i % len(cands)]
                a, b = self.both(lambda c: c.tree.drop_checkpoint(by_uid(c, uid), p))
                assert freed_key(a) == freed_key(b)
        elif op == "split":
            cands = [(n.uid, d) for n in t.nodes() for d in range(n.start + 1, n.end)]
            if cands:
                uid, d = cands[i % len(cands)]
                self.both(lambda c: c.tree.split_at(by_uid(c, uid), d))
        elif op == "truncate":
            cands = [(n.uid, d) for n in t.evictable_leaves for d in range(n.start + 1, n.end)]
            if cands:
                uid, d = sorted(cands)[i % len(cands)]
                a, b = self.both(lambda c: c.tree.truncate(by_uid(c, uid), d)[0])
                assert freed_key(a) == freed_key(b)
        elif op == "drop_leaf":
            cands = sorted(n.uid for n in t.evictable_leaves)
            if cands:
                uid = cands[i % len(cands)]
                a, b = self.both(lambda c: c.tree.drop_leaf(by_uid(c, uid)))
                assert freed_key(a) == freed_key(b)
        elif op == "merge":
            cands = sorted(n.uid for n in t.nodes() if n.lock_ref == 0 and len(n.children) == 1)
            if cands:
                uid = cands[i % len(cands)]
                self.both(lambda c: c.tree.merge_with_child(by_uid(c, uid)))

    def copy_new(self) -> None:
        """Continue with a deep copy / pickle round trip of the new cache (its index is rebuilt)."""
        self.new = pickle.loads(pickle.dumps(copy.deepcopy(self.new)))

    # -- checks
    def check(self) -> None:
        assert dump(self.new) == dump(self.ref)
        self.new.tree.check()
        ev = self.new.evictor
        ev._index.sync()  # noqa: SLF001
        ev._index.verify()  # noqa: SLF001
        got = {(c.node.uid, c.pos, c.kind): (c.score, c.unservable) for c in ev.scores()}
        assert got == reference_scores(ev)


SEQS = st.lists(st.integers(0, 3), min_size=1, max_size=24)
_INSERT = st.tuples(st.just("insert"), SEQS, st.integers(0, 2**16 - 1), st.booleans(), st.booleans())
_EVICT = st.tuples(st.just("evict"), st.one_of(st.none(), st.integers(0, 60)))
_EXTEND = st.tuples(st.just("extend"), st.integers(0, 99), SEQS, st.integers(0, 2**16 - 1))
OPS = st.one_of(  # one_of draws its branches uniformly: inserts and evictions are listed thrice
    _INSERT,
    _INSERT,
    _INSERT,
    _EXTEND,
    _EXTEND,
    _EVICT,
    _EVICT,
    _EVICT,
    st.tuples(st.just("observe"), SEQS),
    st.tuples(st.just("lock"), SEQS),
    st.tuples(st.just("unlock"), st.integers(0, 99)),
    st.tuples(st.just("alpha"), st.sampled_from([0.0, 0.5, 2.0])),
    st.tuples(
        st.just("external"),
        st.sampled_from(["drop_ckpt", "split", "truncate", "drop_leaf", "merge"]),
        st.integers(0, 999),
    ),
    st.tuples(st.just("copy")),
)


def run_ops(w: Workload, ops: list[tuple]) -> None:
    for op in ops:
        name, *args = op
        if name == "insert":
            w.insert(*args)
        elif name == "extend":
            w.extend(*args)
        elif name == "observe":
            w.observe(*args)
        elif name == "lock":
            w.lock(*args)
        elif name == "unlock":
            w.unlock(*args)
        elif name == "evict":
            w.evict(*args)
        elif name == "alpha":
            w.set_alpha(*args)
        elif name == "external":
            w.external(*args)
        elif name == "copy":
            w.copy_new()
        w.check()


@pytest.mark.parametrize(
    "cfg",
    CONFIGS,
    ids=lambda c: (
        f"{c.node_states}-{c.ckpt_scope}-{c.ckpt_recency}-{c.drop_unservable}-{c.recency_scale}"
        + (f"-chain{c.superseded_demotion:g}" if c.chain_recency else "")
    ),
)
@settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    budget=st.sampled_from([24, 60, 120]),
    alpha=st.sampled_from([0.0, 1.0, 4.0]),
    ops=st.lists(OPS, min_size=10, max_size=80),
)
def test_same_decisions_as_reference(
    cfg: EvictionConfig, budget: int, alpha: float, ops: list[tuple]
) -> None:
    w = Workload(cfg, budget, alpha)
    run_ops(w, ops)


@pytest.mark.parametrize("name", sorted(n for n in POLICIES if n != "oracle"))
@pytest.mark.parametrize("alpha", [0.0, 2.0])
def test_long_random_workloads_per_policy(name: str, alpha: float) -> None:
    """Longer runs (bigger trees, many evictions per round) with each registry policy's admission."""
    spec = POLICIES[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}-{alpha}".encode()))
    w = Workload(spec.eviction, budget=400, alpha=alpha if spec.flop_aware else 0.0, admission=spec.admission)
    prefixes = [rng.integers(0, 4, size=int(rng.integers(5, 40))).tolist() for _ in range(6)]
    for step in range(400):
        r = rng.random()
        seq = (
            prefixes[int(rng.integers(len(prefixes)))]
            + rng.integers(0, 5, size=int(rng.integers(1, 30))).tolist()
        )
        if r < 0.2:  # a session's next turn (chains, superseded states)
            w.extend(int(rng.integers(100)), rng.integers(0, 5, size=int(rng.integers(1, 12))).tolist(), 0)
        elif r < 0.55:
            w.insert(seq, int(rng.integers(0, 2**16)), bool(rng.random() < 0.5), bool(rng.random() < 0.7))
        elif r < 0.65:
            w.observe(seq)
        elif r < 0.72:
            w.lock(seq)
        elif r < 0.8:
            w.unlock(int(rng.integers(100)))
        elif r < 0.83:
            w.external(
                ["drop_ckpt", "split", "truncate", "drop_leaf", "merge"][int(rng.integers(5))],
                int(rng.integers(1000)),
            )
        elif r < 0.84 and spec.flop_aware:
            w.set_alpha(float(rng.choice([0.0, 0.25, 2.0, 8.0])))
        else:
            w.evict(None if rng.random() < 0.7 else int(rng.integers(0, 200)))
        if step % 10 == 0 or r >= 0.84:
            w.check()
    w.check()
    assert w.evictions > 40


@pytest.mark.parametrize("alpha", [0.0, 2.0])
def test_sessions_same_decisions_as_reference(alpha: float) -> None:
    """Interleaved multi-turn sessions (each turn continues the previous one's whole sequence, as
    the agent trace does) under the product config: chains form, superseded states and provisional
    leaves are ranked by the sessions' due ticks, and both evictors still agree at every step."""
    w = Workload(POLICIES["sparse"].eviction, budget=220, alpha=alpha)
    rng = np.random.default_rng(11)
    gap = [1, 1, 2, 3, 6]  # session k comes back about every gap[k] requests
    seqs: dict[int, list[int]] = {}
    idx = w.new.evictor._index  # noqa: SLF001
    seen_chain = seen_superseded = 0
    for step in range(300):
        k = int(rng.integers(5))
        if rng.random() > 1.0 / gap[k]:
            continue
        if len(seqs.get(k, ())) > 60:  # the session ends; a new one takes its place
            del seqs[k]
        head = seqs.get(k, [9, k, step % 4] + rng.integers(0, 4, size=5).tolist())
        seqs[k] = head + rng.integers(0, 4, size=int(rng.integers(2, 9))).tolist()
        w.insert(seqs[k], 0, False, True)
        w.evict(None)
        if step % 3 == 0:
            w.check()
            seen_chain += bool(idx.chn[: idx.n].any())
            seen_superseded += bool(idx.sup[: idx.n].any())
    w.check()
    ch = w.new.chains
    assert ch.arrivals > 50 and ch.joins > 50 and ch.prior_gap() is not None
    assert seen_chain > 20 and seen_superseded > 5, (seen_chain, seen_superseded)


def test_scores_api() -> None:
    """``Evictor.scores``: eviction order, unservable flag, no tree change."""
    c = make_cache(replace(POLICIES["sparse"].eviction), budget=60)
    c.alpha = 1.0
    c.insert([1] * 10, None, {10: "a"})
    c.insert([2] * 58, None, {58: "far"})  # 58 KV + 4 state bytes > 60: unservable
    c.insert([1] * 5 + [3] * 5, None, {10: "b"})
    before = dump(c)
    sc = c.evictor.scores()
    assert dump(c) == before
    assert all(isinstance(s, ScoredCandidate) for s in sc)
    assert [s.unservable for s in sc][:2] == [True, True]  # the far leaf and its state come first
    assert {s.node.checkpoints.get(s.pos) for s in sc if s.kind == CKPT} == {"a", "far", "b"}
    assert {s.kind for s in sc} == {LEAF, CKPT}
    key = [(-math.inf if s.unservable else s.score, s.node.uid, s.pos, s.kind) for s in sc]
    assert key == sorted(key)
    assert all(0.0 <= s.score <= 2.0 for s in sc)
    assert make_cache(EvictionConfig(), budget=60).evictor.scores() == []


def _stale_efficient_prefix(cfg: EvictionConfig, alpha: float, rounds: int) -> list[int]:
    """An efficient leaf (a long prefix: more FLOPs saved per byte) cached once, then ``rounds``
    requests on new short prefixes, each inserted and evicted to a budget that holds the long leaf
    or one short leaf but not both. Returns the rounds whose short leaf survived its eviction."""
    c = make_cache(cfg, budget=110)
    c.alpha = alpha
    c.insert([9] * 100, None, {100: "long"})
    kept = []
    for i in range(rounds):
        seq = [i + 10] * 20
        c.observe(c.match(seq))
        c.insert(seq, None, {20: f"short{i}"})
        c.evict_to_budget()
        if c.match(seq).resume_depth == 20:
            kept.append(i)
    return kept


def test_decayed_recency_bounds_how_long_efficiency_keeps_an_item() -> None:
    """Min-max recency with two candidates is a rank: with ``alpha > 1`` the efficient old leaf
    outscores every new one forever (each new leaf is evicted as soon as it is inserted). Decayed
    recency evicts the old leaf once its clock is more than ``tau * ln(1 + alpha)`` ticks older (two
    ticks per round here: match + insert); with ``alpha = 0`` both forms are LRU."""
    minmax = replace(POLICIES["sparse"].eviction, recency_scale=None)
    decayed = replace(POLICIES["sparse"].eviction, recency_scale=4.0)
    assert _stale_efficient_prefix(minmax, 8.0, 30) == []
    kept = _stale_efficient_prefix(decayed, 8.0, 30)
    bound = 4.0 * math.log1p(8.0)  # ticks
    first = kept[0]
    assert kept == list(range(first, 30))  # once the old leaf is gone, the newest short leaf stays
    # the old leaf (clock 1) goes at the first round whose insert (clock 2i + 3) is > bound newer
    assert 2 * (first - 1) + 2 <= bound < 2 * first + 2
    assert (
        _stale_efficient_prefix(decayed, 0.0, 5) == _stale_efficient_prefix(minmax, 0.0, 5) == list(range(5))
    )


def test_det_log1p_is_log1p_and_length_independent() -> None:
    """The decayed score's logarithm: within 1e-15 of ``math.log1p``, exactly 0 at 0, monotone, and
    the same bits for a value whatever array it is computed in (the scalar path of a round uses a
    1-element array, the index the whole column)."""
    rng = np.random.default_rng(3)
    x = np.concatenate([[0.0, 5e-324, 1e-17, 1e-9, 0.5, 1.0, 8.0, 1e6], rng.random(20000) * 8])
    got = det_log1p(x)
    assert np.max(np.abs(got - np.array([math.log1p(v) for v in x]))) < 1e-15
    assert got[0] == 0.0
    dense = det_log1p(np.linspace(0.0, 8.0, 200001))
    assert np.all(np.diff(dense) >= 0)
    singles = np.array([det_log1p(np.array([v]))[0] for v in x[:500]])
    assert np.array_equal(singles, got[:500])
    assert np.array_equal(det_log1p(x[3:1003]), got[3:1003])


def test_invalidate_after_direct_field_writes() -> None:
    """Writing node fields directly is invisible to the index until :meth:`Evictor.invalidate`."""
    new, ref = pair(POLICIES["sparse"].eviction, budget=1000, alpha=0.0)
    for c in (new, ref):
        c.insert([1] * 10, None, {10: "a"})
        c.insert([2] * 10, None, {10: "b"})
    new.evictor.scores()  # index built
    for c in (new, ref):
        n = by_uid(c, 2)  # "a" becomes the most recent without a clock tick
        n.last_access = n.ckpt_access[10] = 100
    new.evictor.invalidate()
    a, b = new.evict(1), ref.evict(1)
    assert freed_key(a) == freed_key(b) and a.states == ["b"]


@pytest.mark.parametrize("name", ["sparse", "marconi", "sglang_native", "sparse_dp"])
def test_index_is_incremental(name: str) -> None:
    """Through insert / observe / lock / unlock / evict the index never rescans or rebuilds (both are
    O(n)); only eviction primitives called from outside (or an alpha > 0 after alpha = 0) do."""
    spec = POLICIES[name]
    w = Workload(spec.eviction, budget=300, alpha=2.0 if spec.flop_aware else 0.0, admission=spec.admission)
    rng = np.random.default_rng(7)
    for _ in range(300):
        seq = rng.integers(0, 3, size=int(rng.integers(1, 30))).tolist()
        r = rng.random()
        if r < 0.5:
            w.insert(seq, int(rng.integers(0, 2**16)), bool(rng.random() < 0.5), True)
        elif r < 0.6:
            w.observe(seq)
        elif r < 0.7:
            w.lock(seq)
        elif r < 0.8:
            w.unlock(int(rng.integers(100)))
        else:
            w.evict(None if r < 0.9 else int(rng.integers(0, 100)))
    w.check()
    idx = w.new.evictor._index  # noqa: SLF001
    assert (idx.builds, idx.rescans) == (1, 0)
    for k, op in enumerate(["drop_ckpt", "split", "truncate", "drop_leaf", "merge", "split"]):
        w.external(op, 3)
        w.check()
        assert idx.builds == 1 and idx.rescans <= k + 1, op  # localised by a rescan, no rebuild

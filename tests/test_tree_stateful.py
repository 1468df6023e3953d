"""Randomised reliability test: >= 10k insert/match/observe/lock/unlock/evict operations.

A fake pool hands out KV slot ids (numpy arrays, one id per token) and state ids. Invariants after
every step: tree structure/accounting (``RadixTree.check``), every allocated KV slot and state is
either in the tree or was returned for freeing exactly once (no orphans, no double frees), bytes are
accounted exactly, locked items survive eviction, the budget holds after eviction unless only locked
items remain, match is pure.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglang_sparse.policy import POLICY_NAMES, HybridCache
from sglang_sparse.sim import cost_model

KV_B, STATE_B, BUDGET = 1, 4, 120
COST = cost_model("qwen3-next-80b-a3b")
STEPS = [0]  # invariant checks == operations executed (incl. setup), summed over all examples
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=24)


class FakePool:
    def __init__(self) -> None:
        self.next_slot = 0
        self.next_state = 0
        self.kv_live: set[int] = set()
        self.states_live: set[int] = set()

    def alloc_kv(self, n: int) -> np.ndarray:
        a = np.arange(self.next_slot, self.next_slot + n, dtype=np.int64)
        self.next_slot += n
        self.kv_live.update(a.tolist())
        return a

    def alloc_state(self) -> int:
        self.next_state += 1
        self.states_live.add(self.next_state)
        return self.next_state

    def free_kv(self, handles) -> None:
        for h in handles:
            for s in np.asarray(h).tolist():
                assert s in self.kv_live, f"double free / unknown KV slot {s}"
                self.kv_live.remove(s)

    def free_states(self, handles) -> None:
        for h in handles:
            assert h in self.states_live, f"double free / unknown state {h}"
            self.states_live.remove(h)


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from([p for p in POLICY_NAMES if p != "oracle"]), alpha=st.sampled_from([0.0, 1.0])
    )
    def setup(self, policy: str, alpha: float) -> None:
        self.pool = FakePool()
        self.cache = HybridCache(
            policy, budget_bytes=BUDGET, cost=COST, kv_bytes_per_token=KV_B, state_bytes=STATE_B, refresh=2
        )
        if self.cache.spec.flop_aware:
            self.cache.alpha = alpha
        self.locked: list = []
        self.old_match = None

    def _insert(self, seq: list[int], ckpt_mask: int, full_kv: bool, hint_mode: str = "none") -> None:
        c = self.cache
        m = c.match(seq)
        c.lock(m.node)
        off = 0 if full_kv else m.kv_depth
        kv = self.pool.alloc_kv(len(seq) - off)
        plan = c.capture_plan(m, len(seq))
        extra = [p for p in range(1, len(seq) + 1) if (ckpt_mask >> (p % 16)) & 1]
        ck = {p: self.pool.alloc_state() for p in sorted(set(plan) | set(extra))}
        if hint_mode == "none":
            res = c.insert(seq, kv, ck, kv_offset=off)
        else:  # the tree's insert hint: fresh, of a prefix (prompt), or stale/unrelated
            hint = {"fresh": m, "prefix": c.match(seq[: max(1, len(seq) // 2)]), "stale": self.old_match}
            res = c.tree.insert(seq, kv, ck, kv_offset=off, hint=hint[hint_mode])
        self.old_match = m
        assert res.prefix_len == m.kv_depth
        self.pool.free_kv(res.unused_kv)
        self.pool.free_states(res.unused_states)
        c.unlock(m.node)

    @rule(
        seq=seqs,
        ckpt_mask=st.integers(0, 2**16 - 1),
        full_kv=st.booleans(),
        hint_mode=st.sampled_from(["none", "fresh", "prefix", "stale"]),
    )
    def insert(self, seq, ckpt_mask, full_kv, hint_mode):
        self._insert(seq, ckpt_mask, full_kv, hint_mode)

    @rule(seq=seqs)
    def match_is_pure(self, seq):
        t = self.cache.tree
        before = (t.num_nodes, t.bytes_used, t.clock)
        a, b = self.cache.match(seq), self.cache.match(seq)
        assert (a.kv_depth, a.resume_depth, a.node) == (b.kv_depth, b.resume_depth, b.node)
        assert (t.num_nodes, t.bytes_used, t.clock) == before
        assert a.resume_depth <= a.kv_depth <= len(seq)
        assert list(seq[: a.kv_depth]) == t.path_tokens(a.node)[: a.kv_depth].tolist()
        if a.ckpt_node is not None:
            assert a.ckpt_node.checkpoints[a.resume_depth] == a.ckpt_handle

    @rule(seq=seqs)
    def observe(self, seq):
        self.cache.observe(self.cache.match(seq))

    @rule(seq=seqs)
    def lock(self, seq):
        m = self.cache.match(seq)
        if m.kv_depth:
            self.cache.lock(m.node)
            self.locked.append(m.node)

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 10**6))
    def unlock(self, i):
        node = self.locked.pop(i % len(self.locked))
        self.cache.unlock(node)

    def _protected(self):
        kv, states = set(), set()
        for n in self.cache.tree.nodes():
            if n.lock_ref > 0:
                kv.update(np.asarray(n.kv).tolist())
                states.update(n.checkpoints.values())
        return kv, states

    def _evict(self, fn) -> None:
        kv_p, st_p = self._protected()
        freed = fn()
        self.pool.free_kv(freed.kv)
        self.pool.free_states(freed.states)
        assert not (kv_p & {s for h in freed.kv for s in np.asarray(h).tolist()}), "locked KV evicted"
        assert not (st_p & set(freed.states)), "locked state evicted"

    @rule()
    def evict_to_budget(self):
        self._evict(self.cache.evict_to_budget)
        c = self.cache
        if c.bytes_used > c.budget_bytes:
            assert not c.evictor.candidates() or all(
                c.evictor._candidate(k, n, p) is None for k, n, p in c.evictor.candidates()
            ), "over budget with evictable items left"

    @rule(nbytes=st.integers(0, 60))
    def evict_bytes(self, nbytes):
        before = self.cache.bytes_used
        self._evict(lambda: self.cache.evict(nbytes))
        assert self.cache.bytes_used <= before

    @invariant()
    def accounting(self):
        if not hasattr(self, "cache"):
            return
        STEPS[0] += 1
        t = self.cache.tree
        t.check()
        tree_kv: list[int] = []
        tree_states: list[int] = []
        for n in t.nodes():
            slots = np.asarray(n.kv).tolist()
            assert len(slots) == n.num_tokens
            tree_kv.extend(slots)
            tree_states.extend(n.checkpoints.values())
        assert len(tree_kv) == len(set(tree_kv)) and set(tree_kv) == self.pool.kv_live, "orphan/dup KV"
        assert len(tree_states) == len(set(tree_states)) and set(tree_states) == self.pool.states_live
        assert t.bytes_used == len(tree_kv) * KV_B + len(tree_states) * STATE_B


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase


def test_at_least_10k_operations_ran():
    """Runs after the state machine (file order): the random walk covered >= 10k operations."""
    if STEPS[0] == 0:
        TestCacheMachine("runTest").runTest()
    print(f"state-machine operations: {STEPS[0]}")
    assert STEPS[0] >= 10_000, STEPS[0]

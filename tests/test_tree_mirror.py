"""MirrorTree + TreePolicy driven by :class:`~sparse_testing.mini_engine.MiniEngine`, a small
token radix tree with SGLang's structural-event semantics (no SGLang)."""

from __future__ import annotations

import itertools
import math
import random
import sys

import numpy as np
import pytest
from sparse_testing.mini_engine import MiniEngine

from sglang_sparse.policy import HybridCache
from sglang_sparse.policy.choose import EdgePlan, PlanTable
from sglang_sparse.policy.evict import CKPT
from sglang_sparse.sglang_adapter.config import SparseConfig
from sglang_sparse.sglang_adapter.tree_policy import TreePolicy
from sglang_sparse.sim import cost_model
from sglang_sparse.tree import MirrorError, MirrorTree, RadixTree

KV_B, STATE_B = 10, 500


def _policy(name: str = "sparse", **kw) -> TreePolicy:
    cost = cost_model("qwen3-next-80b-a3b")
    cfg = SparseConfig(policy=name, **kw)
    return TreePolicy(cfg, budget_bytes=50_000, cost=cost, kv_bytes_per_token=KV_B, state_bytes=STATE_B)


def _random_ops(eng: MiniEngine, rng: random.Random, steps: int) -> None:
    bases = [[rng.randrange(50) for _ in range(rng.randrange(5, 120))] for _ in range(6)]
    for step in range(steps):
        op = rng.random()
        if op < 0.6:
            b = bases[rng.randrange(len(bases))]
            cut = rng.randrange(1, len(b) + 1)
            toks = b[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
            node, d, resume = eng.match(toks)
            rid = f"r{step}"
            eng.policy.plan(rid, len(toks), 4, kv_node_id=node.id, engine_kv=d, engine_prefix=resume)
            eng.insert(toks)
            eng.policy.finish(rid, toks, [1, 2])
        elif op < 0.8:
            leaves = [n for n in eng.nodes() if not n.children]
            if leaves:
                eng.remove_leaf(rng.choice(leaves))
        else:
            held = [n for n in eng.nodes() if n.state]
            if held:
                eng.free_state(rng.choice(held))
        eng.policy.check(eng.export())


@pytest.mark.parametrize("name", ["sparse", "lru", "marconi", "sglang_native"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mirror_follows_engine_events(name: str, seed: int) -> None:
    pol = _policy(name)
    eng = MiniEngine(pol)
    _random_ops(eng, random.Random(seed), 300)
    assert pol.stats.mirror_errors == 0
    assert pol.mirror.num_states == sum(n.state for n in eng.nodes())
    # The eviction order covers exactly the states the policy scores, each once, all held.
    order = list(pol.eviction_order())
    assert len(order) == len(set(order))
    held = {n.id for n in eng.nodes() if n.state}
    assert set(order) <= held


@pytest.mark.parametrize("name", ["sparse", "lru", "marconi", "sglang_native"])
def test_eviction_order_equals_simulator_evictor(name: str) -> None:
    """The mirror's order is the simulator's: a simulator cache built from the engine's tree
    (tokens, node by node) scores the same candidates identically."""
    pol = _policy(name, alpha=1.0 if name in ("sparse", "marconi") else 0.0)
    eng = MiniEngine(pol)
    _random_ops(eng, random.Random(7), 200)
    sim = HybridCache.from_snapshot(pol.engine_snapshot(eng.export()))
    sim.tree.check()
    want: list[int] = []
    best: dict[int, float] = {}  # lowest key per handle (-inf: unservable)
    for c in sim.evictor.scores():
        for h in c.node.checkpoints.values() if c.kind != CKPT else [c.node.checkpoints[c.pos]]:
            k = -math.inf if c.unservable else c.score
            best[h] = min(best.get(h, math.inf), k)
            if h not in want:
                want.append(h)
    assert want, "the random workload should leave evictable states"
    assert list(pol.eviction_order()) == want
    key = pol.state_key_fn()
    scored = {h: s for h in want if (s := key(h)) is not None}
    assert scored == best
    keys = [scored[h] for h in want]
    assert keys == sorted(keys)  # a handle comes at its lowest candidate key


def test_mirror_rejects_events_that_do_not_fit() -> None:
    pol = _policy()
    eng = MiniEngine(pol)
    eng.insert([1, 2, 3])
    with pytest.raises(MirrorError):
        pol.mirror.add_node(999, 12345, 3, 7)  # unknown parent
    pol.on_node_added(999, 12345, 3, 7)  # through the policy: counted, not raised
    assert pol.stats.mirror_errors == 1
    eng.root.children[1].state = False  # the engine changed without telling the mirror
    with pytest.raises(MirrorError, match="holds a state"):
        pol.check(eng.export())


def test_mirror_holds_no_tokens_and_is_o_nodes() -> None:
    pol = _policy()
    eng = MiniEngine(pol)
    doc = list(range(32_000))
    for q in range(50):
        eng.insert(doc + [40_000 + q])
    m = pol.mirror
    assert m.num_nodes == 51 and m.kv_tokens == 32_050
    for n in m.nodes():
        assert not isinstance(n.key, np.ndarray) and len(n.key) == n.num_tokens
    for token_op in ("match", "insert", "path_tokens", "kv_handles"):
        assert not hasattr(m, token_op), token_op  # a CheckpointTree, not a RadixTree


def test_deep_chain_no_recursion() -> None:
    """A 100,000-turn session is a 100,000-node chain: events, paths, checks and the tuning
    snapshot stay iterative (far below the default recursion limit)."""
    depth = 100_000
    assert depth > 10 * sys.getrecursionlimit()
    m = MirrorTree(KV_B, STATE_B, root_id=0)
    for i in range(1, depth + 1):
        m.add_node(i, i - 1, 2, i)
        m.set_state(i)
    assert len(m.path_to(depth)) == depth
    m.touch_path(depth)
    m.check_against((i, i - 1, 2, True) for i in range(1, depth + 1))
    mr = m.match_result(depth, 2 * depth, 2 * depth)
    assert mr.resume_depth == 2 * depth and len(mr.path) == depth
    m.remove_leaf(depth)
    assert m.num_nodes == depth - 1


def test_alpha_tuning_on_a_deep_chain() -> None:
    """A 3,000-turn session (a 3,000-node chain, 3x the default recursion limit): windows snapshot
    the engine's tree, the replay runs in the worker and its alpha is applied at its logical time,
    without a failure."""
    depth, window = 3000, 10
    pol = _policy("sparse", tune_window=window, retune=True)  # every window snapshots
    pol.reset(0)
    keys: dict[int, list[int]] = {}

    def export():
        return [(i, i - 1, keys[i], True) for i in range(1, len(keys) + 1)]

    d = 0
    for i in range(1, depth + 1):
        pol.plan(f"r{i}", d + 10, 2, kv_node_id=i - 1 if i > 1 else None, engine_kv=d, engine_prefix=d)
        keys[i] = [i % 50_000 + 1] + [7] * 9
        pol.on_node_added(i, i - 1, 10, keys[i][0])
        pol.on_state_set(i)
        pol.on_insert(i)
        d += 10
        if i > depth - 3 * window:  # tune near the bottom of the chain
            pol.finish(f"r{i}", list(range(d - 10)), [1, 2], export)
        else:
            pol.finish(f"r{i}", [], [])
    pol.close()
    s = pol.stats
    assert s.tune_windows >= 2 and s.tune_runs >= 1 and s.tune_failures == 0, s
    assert s.alpha_tunes and s.alpha_tunes[0][0] > depth - 2 * window, s.alpha_tunes


def test_match_result_after_a_later_split() -> None:
    """SGLang's match is recorded before the request is planned; another request may split the
    matched edge in between (the child keeps its id): the depth is found in the upper part."""
    m = MirrorTree(KV_B, STATE_B, root_id=0)
    m.add_node(1, 0, 100, 5)
    m.set_state(1)
    m.split_node(1, 2, 40, 9)  # node 2 = depths (0, 40], node 1 = (40, 100]
    r = m.match_result(1, 30, 0)
    assert r.node.uid == 2 and r.kv_depth == 30 and r.resume_depth == 0
    r = m.match_result(1, 100, 100)
    assert r.node.uid == 1 and r.resume_depth == 100 and [n.uid for n in r.path] == [2, 1]


def test_admission_decides_every_offered_state_and_probation_goes_first() -> None:
    """Admission governs every state the engine offers: a planned position is a normal state, a
    first-sight position of the plan or an unplanned chunk end (computed anyway) is kept on
    probation (evicted before every other state, although the newest; promoted once a request
    resumes from it); with probation off an unplanned chunk end is rejected whatever the room."""
    pol = _policy("sparse")
    eng = MiniEngine(pol)
    old = eng.insert(list(range(100, 200)))  # a state the engine holds before (no plan: SGLang's)
    doc = list(range(1000, 1300))
    node, d, r = eng.match(doc)
    plan = pol.plan("a", len(doc), 2, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert plan.probation, plan  # first sight of the document: probation states on it
    first = min(plan.probation)
    assert first % 64 == 0 and 64 <= first < len(doc)
    assert pol.admit("a", first, finished=False, free_slots=0)  # probation, whatever the room
    state = eng.insert(doc[:first])
    pol.end_checkpoint()
    assert pol.is_speculative(state.id) and not pol.is_speculative(old.id)
    assert next(pol.eviction_order()) == state.id  # first to go, although the newest
    assert pol.stats.ckpt_probation == 1 and pol.stats.ckpt_rejected == 0
    # A second request on the same document resumes from it: promoted, a normal state.
    q = doc[:first] + [7, 7, 7]
    node, d, r = eng.match(q)
    assert r == first
    pol.plan("b", len(q), 2, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert not pol.is_speculative(state.id) and pol.stats.probation_hits == 1
    assert pol.mirror.num_states == 2 and next(pol.eviction_order()) == old.id
    # An unplanned chunk end the engine computed anyway: a spare state while a slot is free (or an
    # older spare state can make room), evicted before even the first-sight probation states ...
    unplanned = next(q for q in range(64, len(doc), 64) if q not in plan.positions and q != first)
    assert not pol.admit("a", unplanned, finished=False, free_slots=0)  # no room, no older spare
    assert pol.admit("a", unplanned, finished=False, free_slots=1)
    spare = eng.insert(doc[:unplanned])
    pol.end_checkpoint()
    assert pol.is_speculative(spare.id) and pol.stats.ckpt_spare == 1
    second = max(plan.probation - {first}, default=None)
    if second is not None and second not in (unplanned,) and second < len(doc):
        assert pol.admit("a", second, finished=False, free_slots=0)
        guess = eng.insert(doc[:second])
        pol.end_checkpoint()
        order = list(pol.eviction_order())
        assert order.index(spare.id) < order.index(guess.id) < order.index(old.id), order
    assert pol.admit("a", unplanned + 1, finished=False, free_slots=0)  # an older spare makes room
    pol.end_checkpoint()
    # ... rejected with probation off, whatever the free slots; no first-sight positions either.
    off = _policy("sparse", probation=0)
    MiniEngine(off)
    p0 = off.plan("c", 300, 2, kv_node_id=None, engine_kv=0, engine_prefix=0)
    assert not (p0.probation - {302}), p0
    unplanned = next(q for q in range(64, 300, 64) if q not in p0.positions)
    assert not off.admit("c", unplanned, finished=False, free_slots=100)
    assert off.stats.ckpt_rejected == 1


def test_a_plans_own_states_are_protected_from_its_own_captures() -> None:
    """The states a request's plan stored (planned, probation, finish; not spare ones) are its
    own while it runs: an eviction walk inside ``protecting`` skips them (a capture does not evict
    the same plan's earlier states), outside it they go in the usual order; finishing forgets them."""
    pol = _policy("sparse")
    eng = MiniEngine(pol)
    doc = list(range(1000, 1300))
    node, d, r = eng.match(doc)
    plan = pol.plan("a", len(doc), 2, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    first = min(plan.probation)
    assert pol.admit("a", first, finished=False, free_slots=0)
    guess = eng.insert(doc[:first])
    pol.end_checkpoint()
    unplanned = next(q for q in range(64, len(doc), 64) if q not in plan.positions)
    assert pol.admit("a", unplanned, finished=False, free_slots=1)  # a spare: not the plan's own
    spare = eng.insert(doc[:unplanned])
    pol.end_checkpoint()
    other = eng.insert(list(range(100, 200)))  # no plan: SGLang's own state
    assert pol.own_states(["a"]) == {guess.id} and pol.own_states(["b"]) == frozenset()
    order = list(pol.eviction_order())
    assert order.index(spare.id) < order.index(guess.id) < order.index(other.id), order
    with pol.protecting(pol.own_states(["a"])):
        assert list(pol.eviction_order()) == [h for h in order if h != guess.id]
    assert list(pol.eviction_order()) == order and pol.protected == frozenset()
    pol.finish("a", doc, [1, 2])
    assert pol.own_states(["a"]) == frozenset()


def test_a_session_turn_wants_an_exact_finish_even_when_the_warm_prior_does_not() -> None:
    """Exact finish (extra_buffer: the finish state at the key's end, not on the grid) needs
    evidence of a continuation. A warm tail prior that saw only mid-leaf divergences plans no
    normal state past the prompt, so the finish is on probation; a request that itself continues a
    sequence's end (a session turn) still wants it exact, a first-sight prompt does not."""
    pol = _policy("sparse")
    eng = MiniEngine(pol)
    for i in range(3):  # documents with two questions each: the prior learns ~100-token suffixes
        doc = [10_000 * (i + 1) + k for k in range(300)]
        for q in range(2):
            toks = doc + [9_000 + 100 * q + k for k in range(100)]
            node, d, r = eng.match(toks)
            pol.plan(f"d{i}{q}", len(toks), 1, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
            eng.insert(toks, finished=True)
            pol.finish(f"d{i}{q}", toks, [1])
    assert pol.cache.tail.observations >= 2 and pol.cache.tail.continuation_share() == 0.0
    turn1 = [5_000 + k for k in range(250)]
    node, d, r = eng.match(turn1)
    p1 = pol.plan("t1", len(turn1), 16, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert 265 in p1.positions and 265 in p1.probation and not p1.exact_finish  # first sight
    # extra_buffer keeps turn 1's KV and state up to its grid point 256 of its 265-token key
    kept = eng.insert((turn1 + [1] * 15)[:256])
    pol.on_insert(kept.id, finished=True, seq_len=265)
    pol.finish("t1", turn1, [1] * 16)
    turn2 = turn1 + [1] * 16 + [7] * 30
    node, d, r = eng.match(turn2)
    assert d == 256 and not node.children  # continues turn 1's sequence, as far as it was kept
    p2 = pol.plan("t2", len(turn2), 16, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert 311 in p2.probation and p2.exact_finish, p2


def test_a_finish_that_offers_a_planned_depth_inside_the_prompt_keeps_it() -> None:
    """extra_buffer: a request that finishes in the extend that computed its prompt
    (max_new_tokens=1) offers SGLang's own grid snapshot inside the prompt with its finish. If the
    plan wants that depth (here the branch point) it is kept as a planned state, not judged as a
    finish (which wants a state past the prompt: there is none with one new token)."""
    pol = _policy("sparse")
    eng = MiniEngine(pol)
    doc = list(range(1000, 1300))
    eng.insert(doc + [1] * 40)
    q = doc + [2] * 40
    node, d, r = eng.match(q)
    assert d == 300
    plan = pol.plan("b", len(q), 1, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert 256 in plan.positions and 256 not in plan.probation, plan  # the branch point
    assert pol.admit("b", 256, finished=True, free_slots=0)
    state = eng.insert(q[:256])
    pol.end_checkpoint()
    assert not pol.is_speculative(state.id) and pol.stats.ckpt_admitted == 1
    assert pol.own_states(["b"]) == {state.id}
    assert not pol.admit("b", 192, finished=True, free_slots=0)  # unplanned, nothing past the prompt


def test_alpha_tuned_once_by_default() -> None:
    """Default ``retune=0``: one tuning replay, then no more windows (no snapshots of SGLang's
    tree, no replays) however the hit rate moves."""
    window = 10
    pol = _policy("sparse", tune_window=window)
    pol.reset(0)
    exports = 0

    def export():
        nonlocal exports
        exports += 1
        return [(1, 0, 10, True)] if pol.mirror.num_nodes else []

    for i in range(1, 12 * window):
        pol.plan(f"r{i}", 10, 2, kv_node_id=None, engine_kv=0, engine_prefix=0)
        pol.finish(f"r{i}", list(range(10)), [1, 2], export)
    pol.close()
    s = pol.stats
    assert s.tune_runs == 1 and len(s.alpha_tunes) == 1 and s.tune_failures == 0, s
    assert s.tune_windows <= 2 and exports <= 2, (s.tune_windows, exports)  # the apply lags a quarter window
    # the replay ran in the worker: its CPU is read (psutil) when the run is applied
    assert s.tune_worker_cpu_s > 0 and s.tune_wait_s >= 0, s


def test_structural_edge_ends_are_not_planned() -> None:
    """SGLang's tree keeps a node boundary at every state it ever inserted. Requests passing such a
    single-child boundary count at its end, so the per-edge DP plans it; the mirror skips that end
    unless it is a branch point or a sequence end (else every old chunk-end state position would
    come back as a planned state, and the state pool churns with the chunk size)."""
    t = MirrorTree(KV_B, STATE_B, root_id=0)
    t.add_node(1, 0, 256, 11)  # (0, 256]: a boundary left by an old chunk-end state
    t.add_node(2, 1, 344, 12)  # (256, 600]
    a = t.node(1)
    plans = PlanTable()
    plans.entries = {1: EdgePlan(plan=(256,)), 2: EdgePlan(plan=(448,))}
    m = t.match_result(2, 500, 0)
    assert plans.planned_captures(t, m) == [448]  # 256 is structural: skipped
    # the simulator's tree plans edge ends (its edges end only at branches and sequence ends)
    assert RadixTree.edge_ends_diverge and not t.edge_ends_diverge
    a.seq_end = True  # a sequence ended at 256: a real stopping point
    assert plans.planned_captures(t, m) == [256, 448]
    a.seq_end = False
    t.add_node(3, 1, 100, 13)  # a second child: 256 is a branch point
    assert plans.planned_captures(t, t.match_result(2, 500, 0)) == [256, 448]


def test_a_match_that_ends_on_an_edge_end_plans_that_branch_point() -> None:
    """SGLang splits an edge where a match ends, so a request diverging inside an old edge finds a
    single-child edge ending exactly at its divergence: a branch point (this request makes the
    second child), planned at its exact depth, not skipped as a structural boundary."""
    t = MirrorTree(KV_B, STATE_B, root_id=0)
    t.add_node(1, 0, 300, 11)  # (0, 300]: SGLang's split where the match ends
    t.add_node(2, 1, 40, 12)  # (300, 340]: the earlier request's tail, the only child so far
    plans = PlanTable()
    plans.entries[1] = EdgePlan(plan=(256, 300))
    assert plans.planned_captures(t, t.match_result(1, 300, 0)) == [256, 300]
    # a match that passes through the same boundary to a deeper depth: structural, skipped
    plans.entries[2] = EdgePlan(plan=(320,))
    assert plans.planned_captures(t, t.match_result(2, 330, 0)) == [256, 320]


def test_a_first_sight_guess_gives_way_to_the_exact_divergence_it_led_to() -> None:
    """A second request on a document resumes from a first-sight probation state inside it and
    diverges at the document's end: its plan captures that exact depth (a normal state), and the
    guess it resumed from becomes a spare state, first to be evicted (it only serves divergences
    between the two depths, none seen), so learning where a prefix ends adds no state net."""
    pol = _policy("sparse")
    eng = MiniEngine(pol)
    doc = list(range(1000, 1300))
    a = doc + [1] * 40
    node, d, r = eng.match(a)
    plan = pol.plan("a", len(a), 1, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    g = max(p for p in plan.probation if p < len(doc))  # a first-sight guess inside the document
    assert pol.admit("a", g, finished=False, free_slots=0)
    guess = eng.insert(a[:g])
    pol.end_checkpoint()
    assert pol.is_speculative(guess.id)
    eng.insert(a, finished=True)
    pol.finish("a", a, [1])
    q = doc + [2] * 40
    node, d, r = eng.match(q)
    assert (d, r) == (len(doc), g)
    plan = pol.plan("b", len(q), 1, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert len(doc) in plan.positions and len(doc) not in plan.probation, plan
    assert pol.stats.probation_hits == 1 and pol.stats.superseded == 1
    assert pol.is_speculative(guess.id) and next(pol.eviction_order()) == guess.id
    assert pol.admit("b", len(doc), finished=False, free_slots=0)
    exact = eng.insert(q[: len(doc)])
    pol.end_checkpoint()
    assert not pol.is_speculative(exact.id)
    # a request resuming from a normal state supersedes nothing
    s = doc + [3] * 40
    node, d, r = eng.match(s)
    assert r == len(doc)
    pol.plan("c", len(s), 1, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert pol.stats.superseded == 1 and not pol.is_speculative(exact.id)


def test_tail_prior_states_freed_unused_turn_its_positions_into_probation() -> None:
    """The engine path of the tail prior's feedback: a state admitted at a tail position is
    followed until a request resumes from it (a hit) or the engine frees it (a miss); once too few
    of them served anyone the plan keeps its tail positions on probation, and a resume from one
    promotes it and counts as a hit."""
    pol = _policy("sparse", tail_grid=1)
    eng = MiniEngine(pol)
    for _ in range(4):
        pol.cache.tail.observe_suffix(48)  # questions of 48 tokens after a document
    rng = random.Random(2)
    misses = 0
    for i in itertools.count():
        doc = [rng.randrange(100, 50_000) for _ in range(907)]
        req = doc + [rng.randrange(99) for _ in range(48)]
        node, d, r = eng.match(req)
        plan = pol.plan(f"r{i}", len(req), 1, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
        assert plan.tail == {907}
        assert pol.admit(f"r{i}", 907, finished=False, free_slots=0)
        state = eng.insert(doc)
        pol.end_checkpoint()
        assert state.id in pol.cache.tail_states
        if 907 in plan.probation:
            break
        assert not pol.is_speculative(state.id)
        eng.free_state(state)  # evicted before any request came back
        misses += 1
        assert state.id not in pol.cache.tail_states
    assert misses == 40 and pol.is_speculative(state.id)  # 1 pseudo-hit / 40 decayed misses < 2%
    before = pol.cache.tail.hit_rate
    assert not pol.cache.tail.trusted()
    q = doc + [rng.randrange(99) for _ in range(60)]
    node, d, r = eng.match(q)
    assert r == 907
    pol.plan("again", len(q), 1, kv_node_id=node.id, engine_kv=d, engine_prefix=r)
    assert not pol.is_speculative(state.id) and state.id not in pol.cache.tail_states
    assert pol.cache.tail.hit_rate > before

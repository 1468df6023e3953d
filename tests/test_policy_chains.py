"""Online sessions from structure alone (:mod:`sglang_sparse.policy.choose`): which requests
continue a chain, its arrival statistics, which sequence ends join it, splits, garbage collection,
the prior gap, and what eviction does with them (superseded states go before the newest turn)."""

from __future__ import annotations

import pickle

from sglang_sparse.policy import HybridCache, PolicySpec
from sglang_sparse.policy.evict import CKPT, LEAF
from sglang_sparse.policy.registry import POLICIES
from sglang_sparse.sim import cost_model

COST = cost_model("qwen3-next-80b-a3b")
GRID = 4


def _cache(budget: int = 10**9, **kw) -> HybridCache:
    spec = PolicySpec("t", "sparse", POLICIES["sparse"].eviction, flop_aware=True)
    return HybridCache(
        spec, budget_bytes=budget, cost=COST, kv_bytes_per_token=1, state_bytes=4, grid=GRID, **kw
    )


def _turn(c: HybridCache, seq: list[int]) -> None:
    """One request: match, observe, insert the whole sequence with a state at its end."""
    m = c.match(seq)
    c.observe(m)
    c.insert(seq, None, {len(seq): f"s{len(seq)}-{c.tree.clock}"})


def test_continuations_form_one_chain_per_session_with_its_gaps() -> None:
    c = _cache()
    a, b = [1] * 8, [2] * 8
    _turn(c, a)  # clock 1 (observe), 2 (insert)
    _turn(c, b)  # 3, 4
    a2 = a + [5] * 6
    _turn(c, a2)  # continues a's leaf at observe tick 5: first gap from its last access (2)
    ch = c.chains
    assert ch.arrivals == 1 and ch.joins == 1 and len(ch.chains) == 1
    ((cid, st),) = ch.chains.items()
    assert (st.last, st.gap_sum, st.gaps) == (5, 3, 1) and st.due == 8.0
    leaf_a = c.match(a2).node
    assert leaf_a.chain == cid and leaf_a.parent.chain == cid  # the new turn joined a's chain
    assert c.match(b).node.chain == -1  # b was never continued
    _turn(c, a2 + [6] * 5)  # observe tick 7: gap 2
    assert (st.last, st.gap_sum, st.gaps, st.mean_gap) == (7, 5, 2, 2.5)
    assert c.chains.prior_gap() == 2.5 and c.chains.continuation_share == 1.0


def test_what_is_not_a_continuation() -> None:
    c = _cache()
    _turn(c, [1] * 8)
    _turn(c, [1] * 5 + [3] * 5)  # diverges inside the leaf: a branch, not a session's next turn
    _turn(c, [1, 1, 9, 9, 9])  # below one grid step: a shared header is not evidence either
    assert c.chains.arrivals == 0 and not c.chains.chains
    assert c.chains.continuation_share == 0.0  # the branch counted, the header match did not
    assert c.chains.prior_gap() is None


def test_a_fork_from_a_continued_turn_does_not_join() -> None:
    c = _cache()
    base = [1] * 8
    _turn(c, base)
    _turn(c, base + [2] * 4)  # the session's next turn: joins
    _turn(c, base + [3] * 4)  # the match ends at base's end, no longer a leaf: a fork
    ends = {tuple(n.key.tolist()): n.chain for n in c.tree.nodes()}
    assert ends[(2, 2, 2, 2)] == 0 and ends[(3, 3, 3, 3)] == -1 and c.chains.joins == 1


def test_split_keeps_the_chain_and_a_cut_back_tip_still_continues() -> None:
    c = _cache()
    s = [1] * 8
    _turn(c, s)
    s2 = s + [2] * 8
    _turn(c, s2)
    tip = c.match(s2).node
    up = c.tree.split_at(tip, 12)  # e.g. an engine split, or the cut-back of a dead tail
    assert up.chain == tip.chain == 0 and not up.seq_end
    freed, up2 = c.tree.truncate(tip, 14)  # a tip cut back to depth 14: not a sequence end
    assert up2.chain == 0 and not up2.children
    _turn(c, s2[:14] + [7] * 3)  # reaches the cut-back tip's end: the session continues
    assert c.chains.arrivals == 2 and c.chains.joins == 2


def test_superseded_states_go_before_the_newest_turn() -> None:
    """With alpha 0, two turns of one session: the older turn's state (superseded) is evicted
    before the newest one although it was used more recently than an unrelated leaf's state."""
    c = _cache()
    s = [1] * 8
    _turn(c, s)
    _turn(c, s + [2] * 8)
    rows = {(sc.kind, sc.node.end, sc.pos): sc.score for sc in c.evictor.scores()}
    older = rows[(CKPT, 8, 8)]
    newest = rows[(CKPT, 16, 16)]
    assert older < newest and rows[(LEAF, 16, -1)] == newest
    # The newest turn ranks by the session's due tick (last arrival 3 + mean gap 1 = 4 = now:
    # w = 2, recency 2); the older one by its own last use (resumed at tick 3), set back 2 tau
    # (40 ticks); scores in units of tau (20 ticks).
    demote = POLICIES["sparse"].eviction.superseded_demotion
    assert newest - older == (2 - (3 - demote)) / 20.0


def test_a_late_session_outranks_live_sessions_old_superseded_states() -> None:
    """A superseded state ranks by its own last use, not by its session's due tick (issue 22: agent
    with a host tier, the logical cache 1.5x the KV footprint). Session A takes three quick turns
    and goes quiet; session B, whose first six turns came before A's, keeps taking turns, each
    leaving its previous turn's state superseded; states weigh 40 KV tokens each. When A comes back
    22 of B's turns later (11 requests' worth of its mean gap overdue), A's newest state must still
    be there: B's states from turns A has outlived are older than it. Ranking every superseded
    state at its session's due tick minus 2 tau (the old code) made all of live B's old turns
    newer than late A's tip, which went first (A resumed at 0, not 20)."""
    spec = PolicySpec("t", "sparse", POLICIES["sparse"].eviction, flop_aware=True)
    c = HybridCache(spec, budget_bytes=460, cost=COST, kv_bytes_per_token=1, state_bytes=40, grid=GRID)

    def turn(seq: list[int]) -> int:
        m = c.match(seq)
        c.observe(m)
        c.insert(seq, None, {len(seq): f"s{len(seq)}-{c.tree.clock}"})
        c.evict_to_budget()
        return m.resume_depth

    b = [2] * 8
    for k in range(6):
        b = b + [100 + k] * 4
        turn(b)
    a = [1] * 8
    for k in range(3):
        a = a + [200 + k] * 4
        assert turn(a) == len(a) - 4 or k == 0
    for k in range(22):
        b = b + [300 + k] * 4
        assert turn(b) == len(b) - 4  # B's newest state always stays
    held_b = sorted(p for _, p, _ in c.tree.iter_checkpoints() if p > 20)  # deeper than A: B's
    assert held_b[-1] == len(b) and held_b == list(range(len(b) - 4 * (len(held_b) - 1), len(b) + 1, 4))
    assert turn(a + [9] * 4) == len(a) == 20


def test_collect_drops_chains_without_nodes_and_copies_keep_everything() -> None:
    c = _cache()
    for k in range(3):
        s = [10 + k] * 8
        _turn(c, s)
        _turn(c, s + [2] * 4)
    assert len(c.chains.chains) == 3
    leaf = c.match([10] * 8 + [2] * 4).node
    c.tree.drop_leaf(leaf)
    c.tree.drop_leaf(c.match([10] * 8).node)
    assert c.chains.collect(c.tree.nodes(), force=True) == 1 and sorted(c.chains.chains) == [1, 2]
    cp = pickle.loads(pickle.dumps(c.snapshot()))
    d = HybridCache.from_snapshot(cp)
    assert d.chains.chains == c.chains.chains and d.evictor.chains is d.chains
    assert [n.chain for n in d.tree.nodes()] == [n.chain for n in c.tree.nodes()]
    _turn(d, [11] * 8 + [2] * 4 + [3] * 3)  # the copy continues the session it knows
    assert d.chains.chains[1].gaps == 2 and d.chains.next_id == 3

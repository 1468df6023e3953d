"""Online sessions (:mod:`sglang_sparse.policy.choose`) on the engine mirror: the
:class:`~sglang_sparse.sglang_adapter.tree_policy.TreePolicy` sees only structural events (no tokens,
no session ids) and must identify the same sessions, with the same arrival statistics, as the
simulator's token tree; its eviction order must stay the simulator evictor's, chains included."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import numpy as np
from sparse_testing.mini_engine import MiniEngine

from sglang_sparse.policy import HybridCache
from sglang_sparse.policy.evict import CKPT
from sglang_sparse.sglang_adapter.config import SparseConfig
from sglang_sparse.sglang_adapter.tree_policy import TreePolicy
from sglang_sparse.sim import cost_model

KV_B, STATE_B = 10, 500
COST = cost_model("qwen3-next-80b-a3b")


def _policy(**kw) -> TreePolicy:
    cfg = SparseConfig(policy="sparse", **kw)
    return TreePolicy(cfg, budget_bytes=50_000, cost=COST, kv_bytes_per_token=KV_B, state_bytes=STATE_B)


def _sessions(rng: random.Random, n: int, turns: int) -> list[tuple[int, list[int], list[int]]]:
    """Interleaved multi-turn sessions: ``(session, input, output)``; each turn's input is the
    previous turn's input + output + new tokens (the agent trace's shape)."""
    hist: dict[int, list[int]] = {}
    left = {k: turns for k in range(n)}
    out = []
    while left:
        k = rng.choice(sorted(left))
        left[k] -= 1
        if not left[k]:
            del left[k]
        head = hist.get(k, [7, 7, 1000 + k])  # a shared header, then the session's own tokens
        inp = head + [rng.randrange(50) for _ in range(rng.randrange(70, 160))]
        outp = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        hist[k] = inp + outp
        out.append((k, inp, outp))
    return out


def _both() -> tuple[TreePolicy, MiniEngine, HybridCache, Callable[[int, list[int], list[int]], None]]:
    """A mirror policy on a :class:`MiniEngine` and a simulator cache without evictions, and a
    function feeding request ``i`` (input, output) to both, each the way its engine does."""
    pol = _policy(grid=64)
    eng = MiniEngine(pol)
    sim = HybridCache("sparse", budget_bytes=10**12, cost=COST, kv_bytes_per_token=KV_B, state_bytes=STATE_B)
    ids = itertools.count(1)

    def feed(i: int, inp: list[int], outp: list[int]) -> None:
        node, d, resume = eng.match(inp)
        pol.plan(f"r{i}", len(inp), len(outp), kv_node_id=node.id, engine_kv=d, engine_prefix=resume)
        eng.insert(inp + outp, finished=True)
        pol.finish(f"r{i}", inp, outp)
        m = sim.match(inp)
        sim.observe(m)
        plan = sim.plan(m, len(inp), len(inp) + len(outp))
        sim.insert(inp + outp, None, {p: next(ids) for p in plan.positions}, probation=plan.probation)

    return pol, eng, sim, feed


def _chain_stats(cache: HybridCache) -> tuple:
    ch = cache.chains
    return (
        sorted((c.last, c.gap_sum, c.gaps) for c in ch.chains.values()),
        ch.arrivals,
        ch.joins,
        ch.gap_sum,
        ch.gaps,
    )


def test_mirror_identifies_the_simulators_sessions() -> None:
    """Without evictions both see every later turn continue its session's leaf: one chain per
    session, the same arrival ticks and gaps (both tick twice per request: observe + insert)."""
    reqs = _sessions(random.Random(3), 5, 8)
    pol, eng, sim, feed = _both()
    for i, (_, inp, outp) in enumerate(reqs):
        feed(i, inp, outp)
    assert pol.stats.mirror_errors == 0
    assert _chain_stats(pol.cache) == _chain_stats(sim)
    assert len(sim.chains.chains) == 5 and sim.chains.arrivals == sim.chains.joins == 35
    # every session's nodes below the shared header are on its chain, in both trees
    for tree in (pol.mirror, sim.tree):
        leaves = [n for n in tree.nodes() if not n.children]
        assert len(leaves) == 5 and all(n.chain >= 0 for n in leaves)
        assert len({n.chain for n in leaves}) == 5


def test_session_eviction_order_equals_simulator_evictor() -> None:
    """With engine evictions between turns (leaves removed, states freed), the mirror's eviction
    order is the one a simulator cache built from the engine's tree computes (the engine snapshot
    carries sequence ends, chain ids and the sessions' statistics), chain rows included."""
    rng = random.Random(5)
    pol = _policy(alpha=1.0, grid=64)
    eng = MiniEngine(pol)
    for i, (_, inp, outp) in enumerate(_sessions(rng, 6, 10)):
        node, d, resume = eng.match(inp)
        pol.plan(f"r{i}", len(inp), len(outp), kv_node_id=node.id, engine_kv=d, engine_prefix=resume)
        eng.insert(inp + outp, finished=True)
        pol.finish(f"r{i}", inp, outp)
        if rng.random() < 0.3:  # the engine evicts in the policy's order (states, then dead leaves)
            for h in itertools.islice(pol.eviction_order(), 2):
                n = eng.by_id(h)
                if n is not None and n.state:
                    eng.free_state(n)
            for n in [n for n in eng.nodes() if not n.children and not n.state]:
                eng.remove_leaf(n)
        pol.check(eng.export())
    assert pol.stats.mirror_errors == 0 and pol.cache.chains.arrivals > 20
    snap = pol.engine_snapshot(eng.export())
    assert (snap.tree.chain >= 0).any() and snap.tree.seq_end.any() and snap.chains is not None
    sim = HybridCache.from_snapshot(snap)
    sim.tree.check()
    idx = pol.cache.evictor.index
    idx.sync()
    assert idx.chn[: idx.n].any() and idx.sup[: idx.n].any()  # sessions and superseded states
    want: list[int] = []
    best: dict[int, float] = {}
    for c in sim.evictor.scores():
        for h in c.node.checkpoints.values() if c.kind != CKPT else [c.node.checkpoints[c.pos]]:
            best[h] = min(best.get(h, math.inf), -math.inf if c.unservable else c.score)
            if h not in want:
                want.append(h)
    assert want
    assert list(pol.eviction_order()) == want
    key = pol.state_key_fn()
    assert {h: key(h) for h in want} == best
    assert np.all(np.diff([best[h] for h in want]) >= 0)


def test_mirror_learns_the_simulators_tail_prior() -> None:
    """Documents with many questions: a request's KV match ends inside the leaf of an earlier
    question, which the engine splits there (as SGLang's ``match_prefix`` does), so the mirror sees
    the match end one node above that leaf. It must still learn the suffix distances (leaf end -
    divergence) the simulator's token tree learns, and count the same continuation share."""
    rng = random.Random(11)
    docs = {
        k: [2, 2, 500 + k] + [rng.randrange(50) for _ in range(rng.randrange(250, 400))] for k in range(4)
    }
    pol, eng, sim, feed = _both()
    for i in range(40):
        inp = docs[rng.randrange(4)] + [60 + rng.randrange(50) for _ in range(rng.randrange(20, 40))]
        outp = [rng.randrange(50) for _ in range(5)]
        feed(i, inp, outp)
    assert pol.stats.mirror_errors == 0
    mine, theirs = pol.cache.tail.hist.items(), sim.tail.hist.items()
    assert sim.tail.observations >= 4  # at least the second question on each document
    assert pol.cache.tail.observations == sim.tail.observations
    assert np.array_equal(mine[0], theirs[0]) and np.allclose(mine[1], theirs[1])
    assert pol.cache.chains.continuation_share == sim.chains.continuation_share == 0.0


def test_suffix_is_measured_from_where_the_sequence_ended() -> None:
    """An engine that keeps a sequence's KV only up to its last kept state (SGLang) reports the
    sequence's whole key length: the tail prior measures a later divergence from there, not from
    the shorter leaf, so the positions it places back from a new request's key end are not too deep."""
    pol = _policy(grid=64)
    eng = MiniEngine(pol)
    first = list(range(300))  # a 300-token key; the engine keeps KV and a state up to 256 only
    node = eng.insert(first[:256])
    pol.on_insert(node.id, finished=True, seq_len=len(first))
    later = first[:256] + [999] * 40  # diverges at or past 256: the engine's match ends at 256
    n, d, resume = eng.match(later)
    pol.plan("r1", len(later), 1, kv_node_id=n.id, engine_kv=d, engine_prefix=resume)
    assert (d, pol.mirror.get(node.id).seq_tail) == (256, 44)
    s, w = pol.cache.tail.hist.items()
    assert pol.cache.tail.observations == 1 and list(s) == [44]

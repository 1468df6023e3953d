"""Online sessions (:mod:`sglang_sparse.policy.chains`) on the engine mirror: the
:class:`~sglang_sparse.sglang_adapter.tree_policy.TreePolicy` sees only structural events (no tokens,
no session ids) and must identify the same sessions, with the same arrival statistics, as the
simulator's token tree; its eviction order must stay the simulator evictor's, chains included."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np

from sglang_sparse.policy import HybridCache
from sglang_sparse.policy.eviction import CKPT
from sglang_sparse.sglang_adapter.config import SparseConfig
from sglang_sparse.sglang_adapter.tree_policy import TreePolicy
from sglang_sparse.sim import cost_model
from sglang_sparse.testing.mini_engine import MiniEngine

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
    pol = _policy(grid=64)
    eng = MiniEngine(pol)
    sim = HybridCache("sparse", budget_bytes=10**12, cost=COST, kv_bytes_per_token=KV_B, state_bytes=STATE_B)
    ids = itertools.count(1)
    for i, (_, inp, outp) in enumerate(reqs):
        node, d, resume = eng.match(inp)
        pol.plan(f"r{i}", len(inp), len(outp), kv_node_id=node.id, engine_kv=d, engine_prefix=resume)
        eng.insert(inp + outp, finished=True)
        pol.finish(f"r{i}", inp, outp)
        m = sim.match(inp)
        sim.observe(m)
        plan = sim.plan(m, len(inp), len(inp) + len(outp))
        sim.insert(inp + outp, None, {p: next(ids) for p in plan.positions}, probation=plan.probation)
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

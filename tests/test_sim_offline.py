"""The ``offline`` reference policy: states exactly at the future resume depths, Belady eviction
(the optimum on a unit-size instance), the byte budget after every request, below the headroom
bound, at least LRU / SGLang's policy on synthetic traces, simulator-only."""

from __future__ import annotations

import pytest

from sglang_sparse.policy import POLICY_NAMES, get_policy
from sglang_sparse.sim import (
    OFFLINE_POLICIES,
    FutureIndex,
    OfflineCache,
    cost_model,
    headroom_bound,
    reuse_profile,
    simulate,
    simulate_offline,
    synthetic_trace,
)
from sglang_sparse.sim.common import prepare_requests
from sglang_sparse.sim.future import after, first_bit
from sglang_sparse.sim.offline import BRANCH, FINISH, FIT
from sglang_sparse.sim.trace import SimRequest

CM = cost_model("qwen3-next-80b-a3b")
KVB, SB = CM.kv_bytes_per_token, CM.state_bytes


def _text(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def _serve_all(cache: OfflineCache, reqs: list[SimRequest]) -> list[int]:
    return [cache.serve(inp, full).resume_depth for inp, full in prepare_requests(reqs)]


# ---------------------------------------------------------------------- future index


def test_future_index_masks_and_demands() -> None:
    p, q = _text(1000, 300), _text(5000, 20)
    reqs = [
        SimRequest("a", 0, p + q, (1, 2, 3)),  # 0
        SimRequest("b", 0, p + q[:7] + (9, 9), ()),  # 1: leaves request 0 at 307
        SimRequest("a", 1, p + q + (1, 2, 3) + (8,), ()),  # 2: continues request 0's sequence
        SimRequest("c", 0, p + (7,), ()),  # 3: leaves at 300
        SimRequest("d", 0, (4, 4), ()),  # 4: shares nothing
    ]
    fut = FutureIndex(reqs)
    full0 = p + q + (1, 2, 3)
    assert fut.prefix_mask(full0, 300) == 0b01111
    assert fut.prefix_mask(full0, 307) == 0b00111
    assert fut.prefix_mask(full0, 320) == 0b00101
    assert fut.prefix_mask(full0, 323) == 0b00100
    assert fut.prefix_mask((4, 4, 4), 3) == 0
    dem = fut.demands(full0, since=0)
    assert [(d.depth, d.mask, d.leaving) for d in dem] == [
        (300, 0b01111, 0b01000),
        (307, 0b00111, 0b00010),
        (323, 0b00100, 0b00100),  # request 0's own input end (320) is no later request's depth
    ]
    assert [d.depth for d in fut.demands(full0, since=2)] == [300]
    assert first_bit(0b01100 & after(2)) == 3 and first_bit(0b00100 & after(2)) is None


# ---------------------------------------------------------------------- admission


def test_states_exactly_where_later_requests_resume() -> None:
    p, q = _text(1000, 300), _text(5000, 20)
    reqs = [
        SimRequest("a", 0, p + q, (1, 2, 3)),
        SimRequest("b", 0, p + q[:7] + (9, 9), ()),
        SimRequest("a", 1, p + q + (1, 2, 3) + (8,), ()),
        SimRequest("c", 0, p + (7,), ()),
    ]
    big = 10**15
    cache = OfflineCache(FutureIndex(reqs), big, KVB, SB)
    inp, full = prepare_requests(reqs)[0]
    plan = cache.capture_positions(0, full, len(inp), 0)
    assert {k: v.kind for k, v in plan.items()} == {300: BRANCH, 307: BRANCH, 323: FINISH}
    assert _serve_all(cache, reqs) == [0, 307, 323, 300]
    # on the 64-token grid every depth but the last token is floored
    grid = OfflineCache(FutureIndex(reqs), big, KVB, SB, grid=64)
    assert sorted(grid.capture_positions(0, full, len(inp), 0)) == [256, 323]
    assert _serve_all(grid, reqs) == [0, 256, 323, 256]
    # a resume point already past a demand: only deeper ones are captured
    assert sorted(cache.capture_positions(0, full, len(inp), 300)) == [307, 323]


def test_demand_inside_the_output_moves_to_the_prompt_end() -> None:
    """Decode keeps only the finish state: a later request leaving inside request 0's output
    resumes at request 0's prompt end instead."""
    a = _text(1000, 100)
    reqs = [SimRequest("a", 0, a, _text(7000, 50)), SimRequest("b", 0, a + _text(7000, 20) + (5,), ())]
    cache = OfflineCache(FutureIndex(reqs), 10**15, KVB, SB)
    assert _serve_all(cache, reqs) == [0, 100]


def test_fit_state_when_the_prefix_does_not_fit() -> None:
    """A 2,000-token document in a cache of one state plus 1,000 tokens of KV: every question
    resumes at the deepest depth that fits (the fit state), on the grid in grid mode."""
    doc = _text(10_000, 2000)
    reqs = [SimRequest(f"q{i}", 0, doc + (i,), (7,)) for i in range(4)]
    size = SB + 1000 * KVB
    r = simulate_offline(reqs, size, CM, check=True)
    assert [x.resume_depth for x in r.records] == [0, 1000, 1000, 1000]
    g = simulate_offline(reqs, size, CM, grid=64, check=True)
    assert [x.resume_depth for x in g.records] == [0, 960, 960, 960]
    cache = OfflineCache(FutureIndex(reqs), size, KVB, SB)
    inp, full = prepare_requests(reqs)[0]
    assert {k: v.kind for k, v in cache.capture_positions(0, full, len(inp), 0).items()} == {1000: FIT}


# ---------------------------------------------------------------------- eviction


def test_belady_on_a_cyclic_pattern() -> None:
    """A B C A B C A B C with room for two documents: LRU-like policies never hit; Belady keeps
    the two documents used next and misses only C after the first round, the optimum (4 hits)."""
    docs = {k: _text(10_000 * (i + 1), 640) for i, k in enumerate("ABC")}
    reqs = [
        SimRequest(f"{k}{i}", 0, docs[k] + (i + 1,) * 5, (50_000 + i, 60_000 + i))
        for i, k in enumerate("ABC" * 3)
    ]
    size = 2 * (640 * KVB + SB) + 100 * KVB
    r = simulate(reqs, "offline", size, CM, check=True)
    assert [x.resume_depth for x in r.records] == [0, 0, 0, 640, 640, 0, 640, 640, 0]
    assert r.max_bytes_used <= size
    for pol in ("lru", "sglang_native", "sparse"):
        assert simulate(reqs, pol, size, CM, keep_records=False).hit_tokens < r.hit_tokens


def test_a_document_nobody_asks_about_again_is_not_captured() -> None:
    """Two documents, room for one: the one asked about again is kept, whatever its recency."""
    a, b = _text(10_000, 1000), _text(20_000, 1000)
    reqs = [
        SimRequest("a0", 0, a + (1,), (2,)),
        SimRequest("b0", 0, b + (1,), (2,)),  # b is never used again: no demand, nothing captured
        SimRequest("a1", 0, a + (3,), (4,)),
    ]
    size = SB + 1100 * KVB
    r = simulate_offline(reqs, size, CM, check=True)
    assert [x.resume_depth for x in r.records] == [0, 0, 1000]
    assert [x.captured for x in r.records] == [1, 0, 0]
    assert simulate(reqs, "lru", size, CM, keep_records=False).hit_tokens == 0


def test_a_state_without_next_use_goes_before_useful_ones() -> None:
    """A session's previous-turn state is shadowed by its new one (the next turn resumes deeper):
    with room for two of three states it is the one evicted; evicting either useful state would
    cost the next question or the next turn its full hit."""
    x, y = _text(10_000, 1000), _text(20_000, 490)
    d = _text(30_000, 500)
    full0 = x + _text(40_000, 10)
    full1 = full0 + y + _text(50_000, 10)
    reqs = [
        SimRequest("s", 0, x, full0[1000:]),
        SimRequest("d0", 0, d + (1,), (2,)),
        SimRequest("s", 1, full0 + y, full1[1500:]),
        SimRequest("d1", 0, d + (3,), ()),
        SimRequest("s", 2, full1 + (5,), ()),
    ]
    size = 2 * SB + 2100 * KVB
    cache = OfflineCache(FutureIndex(reqs), size, KVB, SB)
    assert _serve_all(cache, reqs) == [0, 0, 1010, 500, 1510]
    assert cache.evicted_useful == 0 and sum(cache.evicted.values()) >= 1


# ---------------------------------------------------------------------- whole traces


@pytest.mark.parametrize("shape", ["doc_qa", "system_prompts", "agent"])
def test_budget_bound_and_baselines_on_synthetic_traces(shape: str) -> None:
    """Within the byte budget after every request (tree invariants checked), never above the
    headroom bound, never below LRU or SGLang's own policy, deterministic."""
    for seed in (1, 3):
        reqs = synthetic_trace(shape, 60, seed=seed)
        profile = reuse_profile(reqs)
        future = FutureIndex(reqs)
        footprint = sum(len(r.input_tokens) + len(r.output_tokens) for r in reqs) * KVB
        for frac in (0.02, 0.05, 0.2, 0.5):
            size = int(footprint * frac)
            r = simulate(reqs, "offline", size, CM, check=True, future=future)
            assert r.max_bytes_used <= size and all(x.bytes_used <= size for x in r.records)
            b = headroom_bound(reqs, size, CM, profile)
            assert r.hit_tokens <= b.hit_tokens and r.flops_saved <= b.flops_saved * (1 + 1e-12)
            for pol in ("lru", "sglang_native"):
                other = simulate(reqs, pol, size, CM, keep_records=False)
                assert r.hit_tokens >= other.hit_tokens, (shape, seed, frac, pol)
            assert r.summary() == simulate_offline(reqs, size, CM, keep_records=False).summary()


def test_simulator_only() -> None:
    """``offline`` is no cache policy of the registry, so the serving adapter's option parser
    rejects it (as an unknown policy), while the simulator runs it."""
    assert OFFLINE_POLICIES == ("offline",) and "offline" not in POLICY_NAMES
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("offline")
    config = pytest.importorskip("sglang_sparse.sglang_adapter.config")
    with pytest.raises(config.SparseConfigError, match="unknown policy"):
        config.SparseConfig.from_env({"SGLANG_SPARSE_POLICY": "offline"})
    reqs = synthetic_trace("doc_qa", 10, seed=0)
    assert simulate(reqs, "offline", 10**12, CM).policy == "offline"
    with pytest.raises(ValueError, match="smaller than one"):
        simulate(reqs, "offline", SB - 1, CM)


# ---------------------------------------------------------------------- gap analysis


def test_gap_ledger_accounts_for_every_state_and_token() -> None:
    """The ledger's view agrees with the simulator's: every resume comes from a recorded state at
    that depth, the states held match the bytes, and lost minus gained tokens is the hit gap."""
    from sglang_sparse.sim.gap import StateCatalog, StateLedger, compare

    reqs = synthetic_trace("agent", 60, seed=2)
    cat = StateCatalog(reqs)
    size = int(cat.inf.kv_tokens * KVB * 0.3)  # every sequence fits: offline needs no fit state
    runs = []
    for pol in ("offline", "sparse"):
        led = StateLedger(cat)
        r = simulate(reqs, pol, size, CM, observer=led)
        for j, rec in enumerate(r.records):
            st = led.resume_state(j)
            assert (st.pos if st else 0) == rec.resume_depth
            assert st is None or st.captured < j and (st.evicted is None or st.evicted >= j)
            states = sum(led.held[j].values())
            kv = rec.bytes_used - states * SB
            assert kv >= 0 and kv % KVB == 0  # the held states explain the bytes exactly
        runs.append((r, led))
    g = compare(reqs, runs[0], runs[1])
    lost = sum(sum(v.values()) for v in g["lost"].values())
    assert lost - sum(g["gained"].values()) == runs[0][0].hit_tokens - runs[1][0].hit_tokens
    assert lost > 0 and not any("held" in v for v in g["lost"].values())
    assert sum(s["ref"] for s in g["sessions"].values()) == runs[0][0].hit_tokens
    # offline resumes only where a request leaves a sequence or continues it (no fit state here)
    ref_kinds = g["hit_by_kind"]["ref"]
    assert set(ref_kinds) == {"finish", "branch"} and sum(ref_kinds.values()) == runs[0][0].hit_tokens


def test_gap_state_kinds() -> None:
    from sglang_sparse.sim.gap import StateCatalog

    p, q = _text(1000, 300), _text(5000, 20)
    reqs = [
        SimRequest("a", 0, p + q, (1, 2, 3)),
        SimRequest("b", 0, p + q[:7] + (9, 9), ()),
        SimRequest("c", 0, p + (7,), ()),
    ]
    cat = StateCatalog(reqs, grid=64)
    assert [cat.kind(0, d) for d in (323, 307, 300, 256, 230, 200)] == [
        "finish",
        "branch",
        "branch",
        "branch",
        "mid",
        "mid",
    ]
    assert cat.key(0, 300) == cat.key(2, 300) != cat.key(0, 307)
    # b diverges from a at 307 (first there), c from a/b at 300: first at 300, but within one grid
    # step of 300 only b's 307 was seen before it
    assert list(cat.divergence_depths()) == [0, 307, 300]
    assert not cat.seen_before(1, cat.key(1, 300)) and cat.seen_before(2, cat.key(2, 256))
    assert cat.seen_before(2, cat.key(2, 300)) and not cat.seen_before(2, cat.key(2, 240))


def test_gap_first_divergence_is_what_no_online_policy_saw() -> None:
    """Two requests on a new document: the second's hit at the document end is a first divergence
    (nothing before it diverged there); a third request diverging at the same depth is not."""
    from sglang_sparse.sim.gap import StateCatalog, StateLedger, compare

    doc = _text(1000, 640)
    reqs = [SimRequest(f"q{i}", 0, doc + _text(20_000 + 100 * i, 30), (7,)) for i in range(3)]
    cat = StateCatalog(reqs)
    size = cat.inf.kv_tokens * KVB + 10 * SB  # everything fits
    runs = []
    for pol in ("offline", "lru"):
        led = StateLedger(cat)
        runs.append((simulate(reqs, pol, size, CM, observer=led), led))
    g = compare(reqs, runs[0], runs[1], catalog=cat)
    assert runs[0][0].records[1].resume_depth == 640  # offline: a state at the document end
    lost = g["lost"]["branch"]
    assert lost.get("first divergence", 0) >= 640 - runs[1][0].records[1].resume_depth > 0, g["lost"]
    assert [cat.seen_before(j, cat.key(j, 640)) for j in (1, 2)] == [False, True]


# ---------------------------------------------------------------------- knowledge ablations


def test_knowledge_ablations() -> None:
    """``exact`` is offline itself; hiding *when* states are reused turns Belady into LRU on the
    cyclic pattern; the online ``predicted`` variant needs session ids."""
    from sglang_sparse.sim.ablation import KnowledgeAblation, knowledge_table

    docs = {k: _text(10_000 * (i + 1), 640) for i, k in enumerate("ABC")}
    reqs = [
        SimRequest(f"{k}{i}", 0, docs[k] + (i + 1,) * 5, (50_000 + i, 60_000 + i))
        for i, k in enumerate("ABC" * 3)
    ]
    size = 2 * (640 * KVB + SB) + 100 * KVB
    got = knowledge_table(reqs, [size], CM, [("future", "exact"), ("future", "reuse"), ("finish", "recency")])
    assert got["future/exact"] == [simulate_offline(reqs, size, CM).token_hit_rate]
    assert got["future/exact"][0] == pytest.approx(4 * 640 / sum(len(r.input_tokens) for r in reqs))
    # LRU order: every document is evicted just before its turn, until the last round, where
    # knowing that nothing follows frees the room (2 hits); with no knowledge at all, none
    assert got["future/reuse"][0] == pytest.approx(2 * 640 / sum(len(r.input_tokens) for r in reqs))
    assert got["finish/recency"] == [0.0]
    with pytest.raises(ValueError, match="session ids"):
        KnowledgeAblation(FutureIndex(reqs), size, KVB, SB, knowledge="predicted")
    with pytest.raises(ValueError, match="knowledge must be"):
        KnowledgeAblation(FutureIndex(reqs), size, KVB, SB, knowledge="psychic")


def test_predicted_session_return_keeps_the_frequent_session() -> None:
    """Two sessions, room for one context: ``a`` returns every other request, ``b`` rarely. Recency
    keeps whichever ran last; predicting each session's return from its own past gaps keeps ``a``
    once both have shown their pace."""
    from sglang_sparse.sim.ablation import knowledge_table

    order = "abaaaaaaabaaaaaaab"
    ctx = {"a": _text(10_000, 300), "b": _text(20_000, 300)}
    reqs = []
    for i, s in enumerate(order):
        inp = ctx[s] + (100_000 + i,)
        reqs.append(SimRequest(s, sum(1 for x in order[:i] if x == s), inp, (200_000 + i,)))
        ctx[s] = inp + (200_000 + i,)
    size = SB + 700 * KVB  # one session's context (they grow to ~330 tokens) and one state
    got = knowledge_table(reqs, [size], CM, [("finish", "recency"), ("finish", "predicted")])
    assert got["finish/predicted"][0] > got["finish/recency"][0]

"""The online planner (sglang_sparse.placement.online): targets on the grid within budget, the
no-information fallback, point masses, prior transfer, capture/admission, and the acceptance
(online DP >= block, balanced, log, sqrt at every M) on small synthetic short-prompt sets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.placement import (
    ACCEPT_BASELINES,
    BUDGETS,
    lcp,
    replay_last_k,
    short_prompt_variant,
)
from sglang_sparse.placement import (
    DEFAULT_GRID,
    DepthHistogram,
    DepthLaw,
    DepthPrior,
    OnlinePlanner,
    admit,
    balanced_fill,
    balanced_placement,
    grid_candidates,
    passed_positions,
)

G = DEFAULT_GRID


def _trained_prior(depth_of_length, lengths, grid: int = G) -> DepthPrior:
    prior = DepthPrior(0.99, grid)
    for n in lengths:
        prior.observe(depth_of_length(n), n)
    return prior


@settings(max_examples=150, deadline=None)
@given(
    length=st.integers(0, 3000),
    budget=st.integers(0, 70),
    obs=st.lists(st.tuples(st.integers(0, 3200), st.floats(0.01, 5.0)), max_size=12),
    prior_obs=st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 4000)), max_size=8),
)
def test_targets_are_grid_positions_within_budget(
    length: int, budget: int, obs: list[tuple[int, float]], prior_obs: list[tuple[int, int]]
) -> None:
    prior = DepthPrior(0.99, G)
    for d, n in prior_obs:
        prior.observe(d, n)
    depths = [d for d, _ in obs]
    weights = [w for _, w in obs]
    law, targets = OnlinePlanner(G).plan(depths, weights, length, (budget, 1, 64), prior)
    for m, t in targets.items():
        assert t.dtype == np.int64
        assert np.all(np.diff(t) > 0)
        assert np.all(t % G == 0) and np.all((t > 0) & (t <= length))
        assert t.size == min(m, length // G) <= m
        law.indices_of(t)  # every target is a candidate of the planning law


@pytest.mark.parametrize("length", [0, 63, 64, 65, 200, 333, 1000, 4097])
@pytest.mark.parametrize("budget", [0, 1, 2, 3, 5, 16, 64])
def test_no_information_is_balanced_spacing(length: int, budget: int) -> None:
    planner = OnlinePlanner(G)
    expect = list(balanced_placement(length, budget, G))
    assert planner.target([], [], length, budget).tolist() == expect
    assert planner.target([], [], length, budget, DepthPrior(0.99, G)).tolist() == expect
    # own observations no checkpoint can serve (depth < grid), prior likewise: still no information
    unservable = _trained_prior(lambda n: 10, [20_000, 30_000])  # both models map below the grid
    assert planner.target([0, 5, 63], [3.0, 1.0, 2.0], length, budget, unservable).tolist() == expect


@pytest.mark.parametrize("depth", [1000, 1024, 64, 3999])
@pytest.mark.parametrize("budget", [1, 2, 4, 8])
def test_point_mass_gets_a_checkpoint_at_its_depth(depth: int, budget: int) -> None:
    length = 4000
    noisy_prior = _trained_prior(lambda n: n // 3, [700, 1500, 2900, 3300])
    for prior in (None, noisy_prior):
        t = OnlinePlanner(G).target([depth, 0], [5.0, 2.0], length, budget, prior)
        assert G * (depth // G) in t.tolist()


def test_histogram_items_feed_the_planner() -> None:
    h = DepthHistogram(0.9, refresh=2)
    for d in (0, 700, 700, 12):
        h.observe(d)
    assert 640 in OnlinePlanner(G).target(*h.items(), 2000, 1).tolist()


def test_fresh_entry_follows_the_suffix_model_when_stops_sit_before_the_end() -> None:
    lengths = [1000 + 37 * i for i in range(200)]
    prior = _trained_prior(lambda n: n - 100, lengths)
    assert prior.suffix_share > 0.9
    # no own observations: the prior (and the hedge) decide; a checkpoint goes just below length - 100
    for m in (2, 4):
        assert G * ((5000 - 100) // G) in OnlinePlanner(G).target([], [], 5000, m, prior).tolist()


def test_fresh_entry_follows_the_relative_model_when_stops_scale_with_length() -> None:
    lengths = [1000 + 37 * i for i in range(200)]
    prior = _trained_prior(lambda n: n // 2, lengths)
    assert prior.suffix_share < 0.1
    for m in (2, 4):
        assert G * (2500 // G) in OnlinePlanner(G).target([], [], 5000, m, prior).tolist()


def test_prior_keeps_only_servable_depths() -> None:
    prior = _trained_prior(lambda n: n - 100, [1000, 1200, 1500])
    d, w = prior.on_entry(150)  # length - 100 = 50 < grid: nothing a checkpoint could serve...
    assert np.all(d >= G) and np.all(d <= 150)
    assert w.size == 0 or math.isclose(float(w.sum()), 1.0)
    d, w = prior.on_entry(3000)
    assert d.size and math.isclose(float(w.sum()), 1.0) and np.all((d >= G) & (d <= 3000))


def test_prior_validates_input() -> None:
    prior = DepthPrior()
    with pytest.raises(ValueError):
        prior.observe(-1, 10)
    with pytest.raises(ValueError):
        prior.observe(1, 0)
    with pytest.raises(ValueError):
        DepthPrior(grid=0)
    with pytest.raises(ValueError):
        OnlinePlanner(grid=0)
    with pytest.raises(ValueError):
        OnlinePlanner(prior_weight=-1.0)
    with pytest.raises(ValueError):
        OnlinePlanner().plan([1, 2], [1.0], 100, (1,))
    with pytest.raises(ValueError):
        OnlinePlanner(grid=32).plan([], [], 100, (1,), DepthPrior(grid=64))
    prior.observe(500, 100)  # a depth past the end is clipped to the length
    assert prior.observations == 1


def test_passed_positions() -> None:
    assert passed_positions({64, 128, 256, 512}, 128, 300) == {128, 256}
    assert passed_positions({64}, 0, 63) == set()
    assert passed_positions([], 0, 10_000) == set()


def test_balanced_fill_is_a_superset_of_the_plan() -> None:
    for length in (0, 100, 640, 3000):
        n = length // G
        for budget in range(0, 12):
            for plan in ([], [G] if n and budget else [], list(grid_candidates(length, G)[: min(budget, n)])):
                out = balanced_fill(plan, length, budget, G)
                assert set(plan) <= set(out.tolist())
                assert out.size == min(budget, n)
                assert np.all(out % G == 0) and np.all(np.diff(out) > 0)


def test_admit_keeps_planned_positions() -> None:
    law = DepthLaw.on_grid([70, 130, 200, 260, 300], None, 320, G)
    # within budget: nothing is dropped
    assert admit([64], {256}, {256}, 3, law).tolist() == [64, 256]
    # over budget: an unplanned held position goes, every planned one stays
    out = admit([64, 128, 192], {256}, {128, 256}, 3, law).tolist()
    assert len(out) == 3 and {128, 256} <= set(out)
    # the unplanned one dropped is the one whose loss under the law is least
    law2 = DepthLaw.on_grid([70] * 10 + [200], None, 320, G)
    assert admit([64, 192], {256}, {256}, 2, law2).tolist() == [64, 256]
    # everything planned and over budget: drop the planned position of least value
    out = admit([64, 128], {192}, {64, 128, 192}, 2, law2).tolist()
    assert len(out) == 2 and 64 in out
    assert admit([64, 128], set(), set(), 0, law).tolist() == []


# --- acceptance on small synthetic short-prompt sets -------------------------------------------


def short_chat_stream(seed: int, n: int = 240) -> list[tuple[np.ndarray, np.ndarray]]:
    """Chat with short system prompts (median input ~200-280 tokens): 16 prompts with Zipf
    popularity, 4 families sharing a 20-120-token preamble, + a 10-60-token question; answers of
    16-128 tokens."""
    rng = np.random.default_rng(seed)

    def tok(k: int) -> np.ndarray:
        return rng.integers(10, 30_000, int(k))

    families = [tok(rng.integers(20, 120)) for _ in range(4)]
    prompts = [
        np.concatenate([families[int(rng.integers(4))], tok(rng.integers(20, 300))]) for _ in range(16)
    ]
    pop = 1.0 / np.arange(1, 17)
    pop /= pop.sum()
    out = []
    for _ in range(n):
        inp = np.concatenate([prompts[int(rng.choice(16, p=pop))], tok(rng.integers(10, 60))])
        out.append((inp, np.concatenate([inp, tok(rng.integers(16, 128))])))
    return out


def doc_qa_stream(seed: int, docs: int = 4, questions: int = 30) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(10, 30_000, int(rng.integers(1_500, 6_000))) for _ in range(docs)]
    out = []
    for _ in range(docs * questions):
        inp = np.concatenate(
            [bodies[int(rng.integers(docs))], rng.integers(10, 30_000, int(rng.integers(10, 60)))]
        )
        out.append((inp, np.concatenate([inp, rng.integers(10, 30_000, 20)])))
    return out


def _assert_acceptance(seqs: list[tuple[np.ndarray, np.ndarray]], k_entries: int = 8) -> None:
    res = replay_last_k(seqs, k_entries=k_entries)
    assert res.overlap_tokens > 0
    for m in BUDGETS:
        dp = res.reduction(f"dp/{m}")
        for b in ACCEPT_BASELINES:
            assert dp >= res.reduction(f"{b}/{m}") * (1 - 1e-9), (m, b, dp, res.reduction(f"{b}/{m}"))


def test_short_prompt_variant_keeps_prefix_sharing() -> None:
    seqs = doc_qa_stream(0)
    short, k = short_prompt_variant(seqs, 250)
    assert k == round(float(np.median([inp.size for inp, _ in seqs])) / 250) > 1
    assert 200 <= np.median([inp.size for inp, _ in short]) <= 300
    for (inp, full), (s_inp, s_full) in zip(seqs, short, strict=True):
        assert np.array_equal(s_inp, inp[::k])
        assert np.array_equal(s_full[s_inp.size :], full[inp.size :])  # the answer is kept whole
    for i in range(0, 40, 3):
        for j in range(i + 1, 40, 5):
            d = lcp(seqs[i][0], seqs[j][1])
            assert lcp(short[i][0], short[j][1]) >= -(-d // k)
    assert short_prompt_variant([], 250) == ([], 1)
    with pytest.raises(ValueError):
        short_prompt_variant(seqs, 0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_acceptance_on_short_chat_stream(seed: int) -> None:
    seqs = short_chat_stream(seed)
    assert 150 <= np.median([inp.size for inp, _ in seqs]) <= 300
    _assert_acceptance(seqs)


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_acceptance_on_short_doc_qa_variant(seed: int) -> None:
    _assert_acceptance(short_prompt_variant(doc_qa_stream(seed), 250)[0])

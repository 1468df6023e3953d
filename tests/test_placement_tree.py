"""The ``tree`` method of benchmarks/placement.py: the product's radix tree in the last-K replay."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.placement import TreePlanner, lcp, replay_last_k

GRID = 64


def prefix_stream(
    prefixes: tuple[int, ...] = (640,), n: int = 30, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` requests, each one of the shared ``prefixes`` (tokens) + a fresh question + an answer."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(10, 30_000, k) for k in prefixes]
    out = []
    for i in range(n):
        q = rng.integers(10, 30_000, int(rng.integers(100, 300)))
        inp = np.concatenate([heads[i % len(heads)], q])
        out.append((inp, np.concatenate([inp, rng.integers(10, 30_000, int(rng.integers(16, 64)))])))
    return out


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, dict[int, np.ndarray]]]:
    """Record every ``TreePlanner.enforce``: (budget, live entries, distinct states, positions)."""
    seen: list[tuple[int, int, int, dict[int, np.ndarray]]] = []
    enforce = TreePlanner.enforce

    def spy(self: TreePlanner, live: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        held = enforce(self, live)
        seen.append((self.budget, len(live), self.states, held))
        return held

    monkeypatch.setattr(TreePlanner, "enforce", spy)
    return seen


@pytest.mark.parametrize("rule", ["pooled", "entry"])
def test_tree_positions_within_budget(monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    """Every step: positions on the 64-token grid or at an edge end (the 700-token prefix, a
    sequence end), at most M distinct states per live entry (pooled) or M per entry path (entry)."""
    seqs = prefix_stream((640, 700), n=40)
    m = 2
    seen = _record(monkeypatch)
    res = replay_last_k(seqs, budgets=(m,), block_sizes=(), k_entries=8, tree_budget=rule)
    # the product's candidates: the 64-token grid and edge ends (divergence depths, sequence ends)
    ends = {full.size for _, full in seqs}
    ends |= {lcp(a, b) for i, (_, a) in enumerate(seqs) for _, b in seqs[:i]}
    assert 700 in ends
    n_pos = 0
    for budget, live, states, held in seen:
        assert budget == m and len(held) == live
        if rule == "pooled":
            assert states <= m * live
        for pos in held.values():
            assert rule == "pooled" or pos.size <= m
            assert np.all(np.diff(pos) > 0)
            assert all(p % GRID == 0 or p in ends for p in pos.tolist()), pos
            n_pos += pos.size
    assert n_pos > 0
    assert 0 < res.checkpoints[f"tree/{m}"] <= m
    assert 0 < res.states[f"tree/{m}"] <= res.path_checkpoints[f"tree/{m}"]
    assert res.reduction(f"tree/{m}") > 1.0


def test_tree_shared_prefix_reduction_at_one_checkpoint() -> None:
    seqs = prefix_stream((640,), n=30)
    res = replay_last_k(seqs, budgets=(1,), block_sizes=(), k_entries=8)
    assert res.overlap_tokens >= 640 * (len(seqs) - 1)
    assert res.checkpoints["tree/1"] > 0
    # the branch point at 640 is captured on the first divergence and then serves every request
    assert res.reduction("tree/1") > 1.0
    assert res.recompute["tree/1"] < 0.2 * res.overlap_tokens
    # a budget of one checkpoint per entry: the baselines cannot place it at the shared prefix
    assert res.reduction("tree/1") > res.reduction("block/1")


def test_tree_planner_rejects_unknown_rule() -> None:
    with pytest.raises(ValueError, match="budget rule"):
        TreePlanner(1, rule="global")

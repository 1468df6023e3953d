"""``PlanTable.skip_fresh_replans``: skipping the re-plan of an edge that only observed its end since
its last re-plan (while its plan holds the end) never changes a plan. Differential: the same random
multi-turn / branching workload on two trees, one re-solving every due re-plan."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_sparse.policy.choose import PlanTable
from sglang_sparse.tree import RadixTree


class _NoSkip(PlanTable):
    skip_fresh_replans = False


def _plans(tree: RadixTree, table: PlanTable) -> list[tuple[int, tuple[int, ...]]]:
    return sorted((n.uid, table.plan(n)) for n in tree.nodes())


@pytest.mark.parametrize("seed", range(4))
def test_skipping_fresh_replans_keeps_every_plan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    fast, ref = RadixTree(1, 4), RadixTree(1, 4)
    fast.listener = fast_plans = PlanTable(grid=8, refresh=3, plan_budget=2)
    ref.listener = ref_plans = _NoSkip(grid=8, refresh=3, plan_budget=2)
    sessions = [rng.integers(0, 5, size=int(rng.integers(4, 40))).tolist() for _ in range(5)]
    skipped = 0
    for step in range(400):
        s = int(rng.integers(len(sessions)))
        if rng.random() < 0.7:  # next turn of a session (a chain)
            sessions[s] = sessions[s] + rng.integers(0, 5, size=int(rng.integers(1, 12))).tolist()
            seq = sessions[s]
        else:  # a branch off a random prefix
            seq = sessions[s][: int(rng.integers(1, len(sessions[s]) + 1))] + [int(rng.integers(5, 9))]
        for t, table in ((fast, fast_plans), (ref, ref_plans)):
            m = t.match(seq)
            table.observe(t, m)
            t.insert(seq, None, {len(seq): step})
        skipped += sum(1 for n in fast.nodes() if fast_plans.fresh(n))
        assert _plans(fast, fast_plans) == _plans(ref, ref_plans), step
    fast.check()
    assert skipped > 0, "the workload should exercise the skip"

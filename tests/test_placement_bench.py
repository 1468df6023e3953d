"""The last-K placement replay used by benchmarks/placement.py, on a synthetic doc-QA stream."""

from __future__ import annotations

import numpy as np

from benchmarks.placement import BUDGETS, acceptance, lcp, replay_last_k


def doc_qa_stream(seed: int = 0, docs: int = 4, questions: int = 30) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(10, 30_000, int(rng.integers(1_500, 6_000))) for _ in range(docs)]
    out = []
    for _ in range(docs * questions):
        doc = bodies[int(rng.integers(docs))]
        q = rng.integers(10, 30_000, int(rng.integers(10, 60)))
        inp = np.concatenate([doc, q])
        out.append((inp, np.concatenate([inp, rng.integers(10, 30_000, 20)])))
    return out


def test_lcp() -> None:
    a = np.array([1, 2, 3, 4])
    assert lcp(a, np.array([1, 2, 9])) == 2
    assert lcp(a, a[:3]) == 3
    assert lcp(a, np.array([], dtype=int)) == 0


def test_online_dp_dominates_baselines_on_doc_qa_stream() -> None:
    res = replay_last_k(doc_qa_stream(), k_entries=8)
    assert res.overlap_tokens > 0
    for m in BUDGETS:
        dp = res.reduction(f"dp/{m}")
        assert dp >= 1.0
        for b in ("block", "balanced", "log", "sqrt"):
            assert dp >= res.reduction(f"{b}/{m}") * (1 - 1e-9), (m, b)
    # one well-placed checkpoint per document already beats dense fixed blocks of 512 tokens
    assert res.reduction("dp/1") > res.reduction("block@512")
    results = {
        "synthetic": {
            "requests": 120,
            "methods": {
                key.partition("/")[0]: [
                    {
                        "budget": int(k.partition("/")[2]) if k.partition("/")[2] else None,
                        "reduction": res.reduction(k),
                        "checkpoints_per_entry": res.checkpoints[k],
                    }
                    for k in res.recompute
                    if k.partition("/")[0] == key.partition("/")[0]
                ]
                for key in res.recompute
            },
        }
    }
    acc = acceptance(results)["synthetic"]
    assert acc["dp_loses_to"] == []
    assert any(x["ratio"] is not None and x["ratio"] <= 0.5 for x in acc["dp_vs_block"])

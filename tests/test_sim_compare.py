"""``benchmarks/sim_compare.py`` bookkeeping on a tiny trace file: the headroom bound per size,
each policy's share of it and of ``offline``, and the acceptance block (sparse vs every other
policy, soft-cap policies reported apart, the offline reference never a loss)."""

from __future__ import annotations

import json

import pytest

from benchmarks import sim_compare


def _trace(tmp_path):
    rows = [
        {
            "session_id": f"s{i % 3}",
            "turn_id": i // 3,
            "ts": float(i),
            "num_input_tokens": 200,
            "num_output_tokens": 4,
            "input_tokens": list(range(150)) + list(range(1000 + 50 * i, 1050 + 50 * i)),
            "output_tokens": [7, 8, 9, i],
        }
        for i in range(12)
    ]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_headroom_bounds_every_in_budget_policy(tmp_path) -> None:
    trace = _trace(tmp_path)
    out = tmp_path / "out"
    pols = ["lru", "sparse", "sglang_native", "vllm_plus_published", "offline"]
    argv = ["--trace", str(trace), "--policies", *pols, "--fracs", "8", "40", "--out", str(out)]
    assert sim_compare.main(argv) == 0
    res = json.loads((out / "sim_compare.json").read_text())
    tr = res["traces"]["tiny"]
    head = {h["frac"]: h for h in tr["headroom"]}
    assert set(head) == {8.0, 40.0}
    # a bigger cache never lowers the bound, and the bound is below the unbounded reuse
    assert head[8.0]["hit_tokens"] <= head[40.0]["hit_tokens"]
    assert 0 < head[40.0]["token_hit_rate"] <= 1
    seen_hit = False
    for r in tr["rows"]:
        h = head[r["frac"]]
        assert r["headroom_share_hit"] == pytest.approx(r["hit_tokens"] / h["hit_tokens"])
        assert r["headroom_share_flops"] == pytest.approx(r["flops_saved"] / h["flops_saved"])
        if not r["over_budget"]:
            # the bound is sound for every policy that stayed within the byte budget
            assert r["hit_tokens"] <= h["hit_tokens"]
            assert r["flops_saved"] <= h["flops_saved"] * (1 + 1e-9)
        else:
            assert r["max_bytes_used"] > r["cache_bytes"]
            assert r["over_budget"] == pytest.approx(r["max_bytes_used"] / r["cache_bytes"])
        seen_hit |= r["hit_tokens"] > 0
    assert seen_hit
    acc = {a["frac"]: a for a in res["acceptance"]["tiny"]}
    for frac, a in acc.items():
        assert a["compared"] == sorted(p for p in pols if p not in ("sparse", "offline"))
        rows = {r["policy"]: r for r in tr["rows"] if r["frac"] == frac}
        sp = rows["sparse"]
        want = sorted(
            p
            for p, r in rows.items()
            if p not in ("sparse", "offline")
            and not r["over_budget"]
            and (r["token_hit_rate"] > sp["token_hit_rate"] or r["flops_saved_frac"] > sp["flops_saved_frac"])
        )
        assert sorted(x["policy"] for x in a["losses"]) == want
        assert a["sparse_ge_all_in_budget"] == (not want)
        assert all(x["over_budget"] for x in a["losses_over_budget"])
        for x in a["losses_over_budget"]:
            # the fair comparison: sparse replayed with the memory the soft-cap policy really used
            eq = x["sparse_at_equal_memory"]
            assert eq["cache_bytes"] == int(rows[x["policy"]]["max_bytes_used"])
            assert x["sparse_ge_at_equal_memory"] == (
                eq["token_hit_rate"] >= x["hit"] and eq["flops_saved_frac"] >= x["flops"]
            )
        assert a["headroom_hit"] == pytest.approx(head[frac]["token_hit_rate"])
        # offline: a reference (never a loss), in budget, below the bound; every row's share of it
        off = rows["offline"]
        assert not off["over_budget"] and off["hit_tokens"] <= head[frac]["hit_tokens"]
        assert off["hit_tokens"] >= max(rows[p]["hit_tokens"] for p in ("lru", "sglang_native"))
        assert a["offline_hit"] == off["token_hit_rate"]
        assert a["sparse_share_of_offline_hit"] == pytest.approx(sp["hit_tokens"] / off["hit_tokens"])
        for r in rows.values():
            assert r["offline_share_hit"] == pytest.approx(r["hit_tokens"] / off["hit_tokens"])
            assert r["offline_share_flops"] == pytest.approx(r["flops_saved"] / off["flops_saved"])
    # vllm_plus_published overshoots its budget at the small size and beats sparse there
    small = {x["policy"]: x for x in acc[8.0]["losses_over_budget"]}
    assert "vllm_plus_published" in small
    assert small["vllm_plus_published"]["sparse_ge_at_equal_memory"]
    assert (out / "sim_compare_tiny.png").exists()

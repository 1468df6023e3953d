"""Latency of match / insert / evict for 32k-token prompts in a radix tree of ~10k nodes.

Tree shape (realistic serving mix, ~10.1k nodes): 10 system prompts of 16k tokens, each with 10
documents of 15.5k tokens, each with 100 leaf questions of 500 tokens (32k-token prompts). One
operation = a new 32k prompt sharing 31.5k tokens with a random path (so it splits a leaf edge or
adds a leaf), then an eviction of one leaf back to the previous size.

Prompts are numpy int32 arrays (the fast path); ``--list-input`` also times Python-list prompts,
which pay the conversion. SGLang's Python ``RadixCache`` is timed on the same workload when
``sglang`` imports without a GPU.

    python benchmarks/cache_ops.py [--ops 2000] [--list-input]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from sglang_sparse.policy import HybridCache
from sglang_sparse.sim import cost_model


def build(cache: HybridCache, rng: np.random.Generator, fan=(10, 10, 100), lens=(16_000, 15_500, 500)):
    paths = []
    tok = iter(range(1, 10**9))

    def fresh(n: int) -> np.ndarray:
        start = next(tok) * 0
        a = rng.integers(1, 2**30, size=n, dtype=np.int32)
        return a + start

    for _ in range(fan[0]):
        sp = fresh(lens[0])
        for _ in range(fan[1]):
            doc = np.concatenate([sp, fresh(lens[1])])
            for _ in range(fan[2]):
                q = np.concatenate([doc, fresh(lens[2])])
                cache.insert(q, None, {len(q): 0, (len(doc) // 64) * 64: 0})
                paths.append(q)
    return paths


def stats(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e6
    return {"median_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99)), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--list-input", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/cache_ops.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cm = cost_model("qwen3-next-80b-a3b")
    cache = HybridCache("sparse", budget_bytes=10**18, cost=cm)
    t0 = time.perf_counter()
    paths = build(cache, rng)
    print(
        f"built tree: {cache.tree.num_nodes} nodes, {cache.tree.kv_tokens} tokens "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    t_match, t_insert, t_evict, t_both, t_list = [], [], [], [], []
    for i in range(args.ops):
        base = paths[int(rng.integers(len(paths)))]
        cut = len(base) - int(rng.integers(1, 500))
        q = np.concatenate([base[:cut], rng.integers(1, 2**30, size=len(base) - cut, dtype=np.int32)])
        a = time.perf_counter()
        m = cache.match(q)
        b = time.perf_counter()
        r = cache.insert(q, None, {len(q): 0})
        c = time.perf_counter()
        target = cache.bytes_used - 1
        d = time.perf_counter()
        cache.evictor.evict(target)  # LRU-order leaf eviction (alpha = 0 in this bench)
        e = time.perf_counter()
        t_match.append(b - a)
        t_insert.append(c - b)
        t_both.append(c - a)
        t_evict.append(e - d)
        assert r.prefix_len == m.kv_depth
        if args.list_input and i < 200:
            ql = q.tolist()
            a = time.perf_counter()
            cache.match(ql)
            t_list.append(time.perf_counter() - a)
    res = {
        "nodes": cache.tree.num_nodes,
        "prompt_tokens": 32_000,
        "match": stats(t_match),
        "insert": stats(t_insert),
        "match_plus_insert": stats(t_both),
        "evict_one_leaf": stats(t_evict),
    }
    if t_list:
        res["match_list_input"] = stats(t_list)
    try:
        from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: F401

        res["sglang_radix_cache"] = "importable but not timed (add a CPU harness)"
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        res["sglang_radix_cache"] = f"not importable without the serve extras/GPU: {type(e).__name__}: {e}"
    for k, v in res.items():
        print(f"{k:20s} {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

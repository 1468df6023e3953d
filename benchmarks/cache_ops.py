"""Latency of match / insert / evict for 32k-token prompts in a radix tree of ~10k nodes.

Tree shape (realistic serving mix, ~10.1k nodes): 10 system prompts of 16k tokens, each with 10
documents of 15.5k tokens, each with 100 leaf questions of 500 tokens (32k-token prompts). One
operation = a new 32k prompt sharing 31.5k-32k tokens with a random cached path (so it splits a leaf
edge and adds a leaf), then the eviction of one leaf (LRU) back to the previous size.

Every structure below sees the *same* prompts in the same run, in rotating blocks of ``--block`` ops
(each structure runs a block, then the next one runs the same prompts; so ratios are measured under
the same machine noise while each structure keeps its own working set warm for a block, like a
server doing only cache work); times are per call, in microseconds:

* ``sparse``: this repo's :class:`RadixTree` (int32 numpy prompts). ``insert`` alternates between
  ``insert(..., hint=match)`` (the match of the same op; what an adapter does) and a plain insert
  that re-walks the path. Eviction pops the LRU leaf from the tree's incremental index
  (``lru_leaf`` + ``drop_leaf``, then merges a checkpoint-free single-child parent like the policy
  evictor does).
* ``baseline`` (``--baseline-tree DIR``): another copy of ``sglang_sparse/tree`` (e.g. the code before
  an optimisation) under a private name, driven like ``sparse`` (plain ``match`` + ``insert`` when its
  ``insert`` takes no ``hint``): the ``baseline/sparse`` ratios compare the same operation. It evicts
  the leaf ``sparse`` evicted (found by its path, not timed), so both trees stay identical.
* ``sglang``: SGLang's Python ``RadixCache`` (page size 1, a dummy allocator, KV only, on
  ``array('q')`` keys as its scheduler passes them): ``match_prefix`` + ``insert`` + ``evict(1
  token)``. Only when ``sglang`` imports in this interpreter; otherwise the JSON says why.

Separate phases: the policy :class:`~sglang_sparse.policy.evict.Evictor` evicting one leaf at
alpha 0 and alpha 2 (incremental candidate index; its first call, which builds the index, is
reported apart; at alpha 2 alternating with Marconi's min-max score, whose rounds skip the
decayed score's logarithm), then with a fifth of the leaves made online sessions' tips
(:mod:`sglang_sparse.policy.choose`): a round's scoring alone alternating chain recency on and
off (the same rows: what the sessions' due ticks add to a round), and ``match`` on Python-list
prompts (list -> int32 conversion).

    python benchmarks/cache_ops.py [--quick] [--ops 2000] [--baseline-tree DIR] [--[no-]sglang]

Writes ``benchmarks/results/cache_ops.json``. Full run < 3 min, ``--quick`` < 30 s (2 shared cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import time
import warnings
from array import array
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks._common import table, write_json  # noqa: E402
from benchmarks.stats import latency_us as stats  # noqa: E402
from sglang_sparse.policy import HybridCache  # noqa: E402
from sglang_sparse.sim import cost_model  # noqa: E402
from sglang_sparse.tree import RadixTree  # noqa: E402
from sglang_sparse.tree import lcp as tree_lcp  # noqa: E402

FAN = (10, 10, 100)  # system prompts, documents per prompt, questions per document
LENS = (16_000, 15_500, 500)  # tokens of each level (a full path is 32k tokens)


def build_paths(rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    """``(prompt, doc_end)`` of every leaf, in insertion order (int32 token ids in [1, 2^30))."""
    out = []
    for _ in range(FAN[0]):
        sp = rng.integers(1, 2**30, size=LENS[0], dtype=np.int32)
        for _ in range(FAN[1]):
            doc = np.concatenate([sp, rng.integers(1, 2**30, size=LENS[1], dtype=np.int32)])
            for _ in range(FAN[2]):
                out.append(
                    (np.concatenate([doc, rng.integers(1, 2**30, size=LENS[2], dtype=np.int32)]), len(doc))
                )
    return out


def ckpts_for(q: np.ndarray, doc_end: int) -> dict[int, int]:
    """Checkpoints of a build insert: the last token and the last 64-token page of the document."""
    return {len(q): 0, (doc_end // 64) * 64: 0}


def merge_if_chain(tree: Any, parent: Any) -> None:
    """What the policy evictor does after dropping a leaf: merge a checkpoint-free single-child
    unlocked parent into its child (keeps the tree shape stable over thousands of ops)."""
    if (
        parent.parent is not None
        and parent.lock_ref == 0
        and len(parent.children) == 1
        and not parent.checkpoints
    ):
        tree.merge_with_child(parent)


# ---------------------------------------------------------------------- structures under test


class Sparse:
    """This repo's tree (via HybridCache, so the policy evictor phase can run on it)."""

    name = "sparse"

    def __init__(self, paths: list[tuple[np.ndarray, int]]) -> None:
        self.cache = HybridCache("sparse", budget_bytes=10**18, cost=cost_model("qwen3-next-80b-a3b"))
        self.tree: RadixTree = self.cache.tree
        for q, doc_end in paths:
            self.tree.insert(q, None, ckpts_for(q, doc_end))
        keys = ("match", "insert_hint", "insert", "match+insert_hint", "match+insert", "evict_lru_leaf")
        self.t: dict[str, list[float]] = {k: [] for k in keys}

    def op(self, i: int, q: np.ndarray, ctx: dict[str, Any]) -> int:
        tree, perf = self.tree, time.perf_counter
        use_hint = i % 2 == 0
        a = perf()
        m = tree.match(q)
        b = perf()
        r = tree.insert(q, None, {len(q): 0}, hint=m) if use_hint else tree.insert(q, None, {len(q): 0})
        c = perf()
        leaf = tree.lru_leaf()
        c2 = perf()
        if ctx.get("want_victim"):  # for the baseline (not timed)
            ctx["victim"] = tree.path_tokens(leaf)
        c3 = perf()
        parent = leaf.parent
        tree.drop_leaf(leaf)
        merge_if_chain(tree, parent)
        d = perf()
        assert r.prefix_len == m.kv_depth
        self.t["match"].append(b - a)
        self.t["insert_hint" if use_hint else "insert"].append(c - b)
        self.t["match+insert_hint" if use_hint else "match+insert"].append(c - a)
        self.t["evict_lru_leaf"].append((c2 - c) + (d - c3))
        return m.kv_depth


def load_tree_package(path: Path) -> ModuleType:
    """Import a directory holding a copy of ``sglang_sparse/tree`` (or a checkout holding one) as the
    package ``_baseline_tree``."""
    if (path / "sglang_sparse" / "tree" / "__init__.py").is_file():
        path = path / "sglang_sparse" / "tree"
    if not (path / "__init__.py").is_file():
        raise SystemExit(f"--baseline-tree {path}: no __init__.py (give a copy of sglang_sparse/tree)")
    spec = importlib.util.spec_from_file_location(
        "_baseline_tree", path / "__init__.py", submodule_search_locations=[str(path)]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_baseline_tree"] = mod
    spec.loader.exec_module(mod)
    return mod


class Baseline:
    """Another copy of the tree code: the same op mix as :class:`Sparse` (alternating hinted and plain
    inserts) when its ``insert`` takes a ``hint``, else plain match + insert; evicts ``sparse``'s victim.
    """

    name = "baseline"

    def __init__(self, pkg: ModuleType, paths: list[tuple[np.ndarray, int]], like: RadixTree) -> None:
        self.tree = pkg.RadixTree(like.kv_bytes_per_token, like.state_bytes)
        self.hint = "hint" in inspect.signature(self.tree.insert).parameters
        for q, doc_end in paths:
            self.tree.insert(q, None, ckpts_for(q, doc_end))
        self.t: dict[str, list[float]] = {"match": [], "insert": [], "match+insert": []}
        if self.hint:
            self.t.update({"insert_hint": [], "match+insert_hint": []})

    def op(self, i: int, q: np.ndarray, ctx: dict[str, Any]) -> int:
        tree, perf = self.tree, time.perf_counter
        use_hint = self.hint and i % 2 == 0
        a = perf()
        m = tree.match(q)
        b = perf()
        r = tree.insert(q, None, {len(q): 0}, hint=m) if use_hint else tree.insert(q, None, {len(q): 0})
        c = perf()
        assert r.prefix_len == m.kv_depth
        victim = ctx["victim"]
        vm = tree.match(victim)
        leaf = vm.node
        assert vm.kv_depth == len(victim) == leaf.end and not leaf.children, "trees diverged"
        parent = leaf.parent
        tree.drop_leaf(leaf)
        merge_if_chain(tree, parent)
        self.t["match"].append(b - a)
        self.t["insert_hint" if use_hint else "insert"].append(c - b)
        self.t["match+insert_hint" if use_hint else "match+insert"].append(c - a)
        return m.kv_depth


def sglang_structure(paths: list[tuple[np.ndarray, int]]) -> tuple[Any, str]:
    """``(SGLang harness or None, status)``: why it is unavailable, or what was built."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
            from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, (
            f"not importable in {sys.executable}: {type(e).__name__}: {e} "
            "(run with /work/main/.venv/bin/python, which has sglang + CPU torch)"
        )

    class DummyAllocator:
        """The only allocator surface ``RadixCache`` touches: ``device`` and ``free_segment``."""

        device = "cpu"

        def __init__(self) -> None:
            self.freed_tokens = 0

        def free_segment(self, free_index: torch.Tensor, *, start_pos: int = 0) -> None:
            self.freed_tokens += len(free_index)

    class SGLang:
        name = "sglang"

        def __init__(self) -> None:
            self.alloc = DummyAllocator()
            self.cache = RadixCache.create_simulated(mock_allocator=self.alloc)
            self.values = torch.arange(max(len(q) for q, _ in paths), dtype=torch.int64)  # KV slot ids
            for q, _ in paths:
                self.cache.insert(InsertParams(key=self.key(q), value=self.values[: len(q)]))
            keys = ("match", "insert", "match+insert", "evict_one_leaf")
            self.t: dict[str, list[float]] = {k: [] for k in keys}

        @staticmethod
        def key(q: np.ndarray) -> RadixKey:
            return RadixKey(token_ids=array("q", q.astype(np.int64).tobytes()))

        def op(self, i: int, q: np.ndarray, ctx: dict[str, Any]) -> int:
            cache, perf = self.cache, time.perf_counter
            key, key2 = self.key(q), self.key(q)  # built outside the timers (the scheduler has them)
            value = self.values[: len(q)]
            a = perf()
            m = cache.match_prefix(MatchPrefixParams(key=key))
            b = perf()
            r = cache.insert(InsertParams(key=key2, value=value))
            c = perf()
            cache.evict(EvictParams(num_tokens=1))
            d = perf()
            assert r.prefix_len == m.device_prefix_len
            self.t["match"].append(b - a)
            self.t["insert"].append(c - b)
            self.t["match+insert"].append(c - a)
            self.t["evict_one_leaf"].append(d - c)
            return m.device_prefix_len

    return SGLang, "timed (RadixCache.create_simulated with a dummy allocator, page_size=1)"


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=None, help="operations (default 2000, --quick 300)")
    ap.add_argument("--quick", action="store_true", help="fewer operations and evictions (< 30 s)")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="dir with another sglang_sparse/tree")
    ap.add_argument("--block", type=int, default=100, help="ops per structure before rotating")
    ap.add_argument(
        "--sglang",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time SGLang's RadixCache (default: on, off with --quick since importing sglang+torch "
        "alone takes 10-25 s on this machine)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cache_ops.json")
    args = ap.parse_args(argv)
    ops = args.ops if args.ops is not None else (300 if args.quick else 2000)
    n_policy_evict = 5 if args.quick else 30
    n_list = 50 if args.quick else 200
    t_start = time.perf_counter()

    paths = build_paths(np.random.default_rng(0))
    structs: list[Any] = []
    t0 = time.perf_counter()
    sparse = Sparse(paths)
    structs.append(sparse)
    print(
        f"built sparse tree: {sparse.tree.num_nodes} nodes, {sparse.tree.kv_tokens} tokens "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    baseline = None
    if args.baseline_tree is not None:
        t0 = time.perf_counter()
        baseline = Baseline(load_tree_package(args.baseline_tree.resolve()), paths, sparse.tree)
        structs.append(baseline)
        print(f"built baseline tree ({args.baseline_tree}) in {time.perf_counter() - t0:.1f} s", flush=True)
    use_sglang = (not args.quick) if args.sglang is None else args.sglang
    sglang_status = "skipped (--no-sglang" + (", or --quick without --sglang)" if args.quick else ")")
    if use_sglang:
        t0 = time.perf_counter()
        cls, sglang_status = sglang_structure(paths)
        print(f"import sglang: {time.perf_counter() - t0:.1f} s", flush=True)
        if cls is not None:
            t0 = time.perf_counter()
            structs.append(cls())
            print(f"built SGLang RadixCache in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"sglang: {sglang_status}", flush=True)

    rng = np.random.default_rng(1)
    for b0 in range(0, ops, args.block):
        qs = []
        for _ in range(min(args.block, ops - b0)):
            base = paths[int(rng.integers(len(paths)))][0]
            cut = len(base) - int(rng.integers(1, 500))
            qs.append(
                np.concatenate([base[:cut], rng.integers(1, 2**30, size=len(base) - cut, dtype=np.int32)])
            )
        ctxs: list[dict[str, Any]] = [{"want_victim": baseline is not None} for _ in qs]
        depths = {s.name: [s.op(b0 + i, q, ctxs[i]) for i, q in enumerate(qs)] for s in structs}
        if baseline is not None:
            assert depths["baseline"] == depths["sparse"], "baseline and sparse trees disagree"

    # Python-list prompts (conversion to int32 included in match).
    t_list, t_conv, t_list_base = [], [], []
    from sglang_sparse.tree import as_tokens

    for _ in range(n_list):
        q = paths[int(rng.integers(len(paths)))][0]
        ql = q.tolist()
        a = time.perf_counter()
        as_tokens(ql)
        b = time.perf_counter()
        sparse.tree.match(ql)
        c = time.perf_counter()
        t_conv.append(b - a)
        t_list.append(c - b)
        if baseline is not None:
            a = time.perf_counter()
            baseline.tree.match(ql)
            t_list_base.append(time.perf_counter() - a)

    # The policy evictor (incremental candidate index): the first call builds the index (timed
    # apart), then single-leaf evictions back to back at alpha 0 (LRU) and alpha 2 (FLOP-aware),
    # the latter alternating between the policy's decayed-recency score and Marconi's min-max one
    # (same candidates; the score's cost only).
    ev = sparse.cache.evictor
    decayed_cfg = ev.config
    minmax_cfg = replace(decayed_cfg, recency_scale=None)
    a = time.perf_counter()
    ev.evict(sparse.cache.bytes_used - 1)
    t_pol_build = [time.perf_counter() - a]
    t_pol: dict[float, list[float]] = {0.0: [], 2.0: []}
    t_minmax: list[float] = []
    for alpha, ts in t_pol.items():
        sparse.cache.alpha = alpha
        ev.evict(sparse.cache.bytes_used - 1)  # untimed: the first round after an alpha change
        for _ in range(n_policy_evict):
            for cfg, out in (
                ((decayed_cfg, ts), (minmax_cfg, t_minmax)) if alpha > 0 else ((decayed_cfg, ts),)
            ):
                ev.config = cfg
                a = time.perf_counter()
                ev.evict(sparse.cache.bytes_used - 1)
                out.append(time.perf_counter() - a)
    ev.config = decayed_cfg
    # Online sessions (``chain_recency``, the product default): a fifth of the leaves become
    # sessions' tips (one arrival each: a due tick on their rows); a round's scoring alone
    # (``round_scores`` on unchanged rows) alternating chain recency on and off: what the sessions'
    # due ticks add to a round. (Whole evictions would not compare: the two rankings pick different
    # victims, e.g. an interior state whose 100 children then re-score their fallback.)
    tracker, tree = sparse.cache.chains, sparse.tree
    for k, leaf in enumerate(sorted(tree.evictable_leaves, key=lambda n: n.uid)):
        if k % 5 == 0:
            tree.clock += 1
            tracker.arrive(leaf, tree.clock, leaf.last_access - 1 - k % 7)
    ev.invalidate()  # node fields written outside the tree's methods (the chain ids)
    sparse.cache.alpha = 2.0
    ev.evict(sparse.cache.bytes_used - 1)  # untimed: rebuilds the index
    plain_cfg = replace(decayed_cfg, chain_recency=False)
    t_chain: list[float] = []
    t_nochain: list[float] = []
    ev.index.sync()
    for _ in range(10 * n_policy_evict):
        for cfg, out in ((decayed_cfg, t_chain), (plain_cfg, t_nochain)):
            ev.config = cfg
            a = time.perf_counter()
            ev.index.round_scores(2.0)
            out.append(time.perf_counter() - a)
    ev.config = decayed_cfg
    sparse.cache.alpha = 0.0
    sparse.tree.check()

    res: dict[str, Any] = {
        "sparse_tree_native": tree_lcp.HAVE_NATIVE_LCP,  # C LCP/descent built (else numpy fallback)
        "nodes": sparse.tree.num_nodes,
        "prompt_tokens": len(paths[0][0]),
        "ops": ops,
        "structures": {s.name: {k: stats(v) for k, v in s.t.items() if v} for s in structs},
        "sparse_policy_evictor_one_leaf": stats(t_pol[0.0]),
        "sparse_policy_evictor_one_leaf_alpha2": stats(t_pol[2.0]),
        "sparse_policy_evictor_one_leaf_alpha2_minmax": stats(t_minmax),
        "sparse_policy_evictor_first_call_builds_index": stats(t_pol_build),
        "sparse_policy_round_scores_alpha2_sessions": stats(t_chain),
        "sparse_policy_round_scores_alpha2_sessions_chain_recency_off": stats(t_nochain),
        "sparse_match_list_input": stats(t_list),
        "sparse_list_to_int32": stats(t_conv),
        "sglang_radix_cache": sglang_status,
        "target": {"match+insert_median_us": 50.0},
    }
    if t_list_base:
        res["baseline_match_list_input"] = stats(t_list_base)
    sp = res["structures"]["sparse"]
    res["target"]["met"] = sp["match+insert_hint"]["median_us"] <= 50.0

    def row(name: str, label: str, v: dict[str, Any]) -> list[Any]:
        return [name, label, round(v["median_us"], 1), round(v["p99_us"], 1), v["n"]]

    rows = [row(s.name, k, v) for s in structs for k, v in res["structures"][s.name].items()]
    for label, key in (
        ("policy Evictor, 1 leaf, alpha 0", "sparse_policy_evictor_one_leaf"),
        ("policy Evictor, 1 leaf, alpha 2", "sparse_policy_evictor_one_leaf_alpha2"),
        ("policy Evictor, 1 leaf, alpha 2, min-max score", "sparse_policy_evictor_one_leaf_alpha2_minmax"),
        ("policy Evictor, first call (index)", "sparse_policy_evictor_first_call_builds_index"),
        ("policy round scores, alpha 2, sessions", "sparse_policy_round_scores_alpha2_sessions"),
        (
            "policy round scores, alpha 2, sessions, chain recency off",
            "sparse_policy_round_scores_alpha2_sessions_chain_recency_off",
        ),
    ):
        rows.append(row("sparse", label, res[key]))
    for key in ("sparse_match_list_input", "sparse_list_to_int32", "baseline_match_list_input"):
        if key in res:
            rows.append(row(*key.split("_", 1), res[key]))
    print(table(rows, ["structure", "operation", "median us", "p99 us", "n"]))
    ratios: dict[str, float] = {}
    for other in ("baseline", "sglang"):
        if other in res["structures"]:
            o = res["structures"][other]
            if "match+insert_hint" in o:  # a baseline tree with hints: compare like with like
                ratios[f"{other}/sparse match+insert_hint"] = (
                    o["match+insert_hint"]["median_us"] / sp["match+insert_hint"]["median_us"]
                )
                ratios[f"{other}/sparse match+insert (plain)"] = (
                    o["match+insert"]["median_us"] / sp["match+insert"]["median_us"]
                )
            else:  # SGLang (or an old tree) has no hint: its match + insert vs ours with the hint
                ratios[f"{other}/sparse match+insert"] = (
                    o["match+insert"]["median_us"] / sp["match+insert_hint"]["median_us"]
                )
            ratios[f"{other}/sparse match"] = o["match"]["median_us"] / sp["match"]["median_us"]
    ratios["sessions: chain recency on/off, round scores alpha 2"] = (
        res["sparse_policy_round_scores_alpha2_sessions"]["median_us"]
        / res["sparse_policy_round_scores_alpha2_sessions_chain_recency_off"]["median_us"]
    )
    res["ratios_same_run"] = ratios
    for k, v in ratios.items():
        print(f"{k:38s} {v:6.2f}x")
    print(
        f"target match+insert median <= 50 us: {'met' if res['target']['met'] else 'NOT met'} "
        f"({sp['match+insert_hint']['median_us']:.1f} us); total {time.perf_counter() - t_start:.0f} s"
    )
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

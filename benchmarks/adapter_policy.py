"""The SGLang adapter's policy state: memory (one-tree mirror vs the old token-replayed shadow) and
the eviction walks' cost at 10k nodes.

Workload (the issue's figure): ``--docs`` distinct prompts of ``--prompt-tokens`` tokens (32k), each
followed by ``--questions`` different short suffixes, so the engine tree holds one interior node per
prompt and one leaf with a recurrent state per request: ``docs * questions`` states (2,000).

* ``mirror`` (today): :class:`~sglang_sparse.sglang_adapter.tree_policy.TreePolicy` fed SGLang's
  structural events (node added, state set, insert) and one ``plan`` per request from the engine's
  match (node id + depths). No token is stored.
* ``shadow`` (before): the ``PolicyShadow`` of commit ``c49c924`` (loaded from git history), fed the
  same requests as token sequences (``plan`` re-matches the prompt, ``on_state_inserted`` inserts it
  and keeps a copy of the state's whole prefix).

Memory is the deep size (bytes) of everything reachable from the policy object (numpy buffers
included; classes, functions and modules excluded), measured after the workload. Also reports the
time per request of the policy calls.

Eviction walks (``--walk-docs`` prompts x ``--walk-questions`` suffixes = 10,400 nodes, every node
holding a state): after each new request (plan + insert events), the time until the state-pool walk
(``eviction_order``) yields its first state, and the time to build the KV walk's key function and
key one leaf (``state_key_fn``): what SGLang's walks wait for. Per policy (sparse with alpha 1, lru).

Writes ``benchmarks/results/adapter_policy.json``.

    python -m benchmarks.adapter_policy [--quick]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

from sglang_sparse.sglang_adapter.config import SparseConfig
from sglang_sparse.sglang_adapter.tree_policy import TreePolicy
from sglang_sparse.sim import cost_model

from ._common import REPO, results_dir, write_json

OLD_COMMIT = "c49c924"
COST = cost_model("qwen3-next-80b-a3b")
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def deep_size(root: Any) -> int:
    """Bytes reachable from ``root`` (iterative; each object once; numpy arrays by their buffers)."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, np.ndarray):
            if o.base is None:
                total += o.nbytes
            else:
                stack.append(o.base)
            continue
        stack.extend(gc.get_referents(o))
    return total


def load_old_shadow() -> type | None:
    """``PolicyShadow`` as of :data:`OLD_COMMIT`, or ``None`` without git history."""
    try:
        src = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:sglang_sparse/sglang_adapter/shadow.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    src = src.replace(
        "from .config import SparseConfig", "from sglang_sparse.sglang_adapter.config import SparseConfig"
    )
    path = Path(tempfile.mkdtemp()) / "_old_shadow.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("_old_shadow", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_old_shadow"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod.PolicyShadow


def workload(docs: int, questions: int, prompt: int, suffix: int, seed: int = 0):
    """``(doc index, question index, token array)`` per request, in arrival order."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(10, 150_000, size=prompt, dtype=np.int32) for _ in range(docs)]
    for d, h in enumerate(heads):  # distinct first tokens: each prompt is its own root edge
        h[0] = 1 + d
    for q in range(questions):
        for d in range(docs):
            tail = rng.integers(10, 150_000, size=suffix, dtype=np.int32)
            yield d, q, np.concatenate([heads[d], tail])


def run_mirror(cfg: SparseConfig, args) -> tuple[TreePolicy, float]:
    pol = TreePolicy(cfg, budget_bytes=10**15, cost=COST)
    pol.reset(0)
    ids = iter(range(1, 10**9))
    doc_node: dict[int, int] = {}
    t0 = time.perf_counter()
    for i, (d, _, toks) in enumerate(workload(args.docs, args.questions, args.prompt_tokens, args.suffix)):
        head = doc_node.get(d)
        # SGLang's match: the KV match ends on the prompt's node (depth = prompt) once it exists.
        pol.plan(
            f"r{i}",
            len(toks),
            0,
            kv_node_id=head,
            engine_kv=args.prompt_tokens if head is not None else 0,
            engine_prefix=0,
        )
        if head is None:
            head = doc_node[d] = next(ids)
            pol.on_node_added(head, 0, args.prompt_tokens, int(toks[0]))
        leaf = next(ids)
        pol.on_node_added(leaf, head, args.suffix, int(toks[args.prompt_tokens]))
        pol.on_state_set(leaf)
        pol.on_insert(leaf)
        pol.finish(f"r{i}", (), ())
    return pol, time.perf_counter() - t0


def run_shadow(shadow_cls: type, cfg: SparseConfig, args) -> tuple[Any, float]:
    sh = shadow_cls(cfg, budget_bytes=10**15, cost=COST)
    t0 = time.perf_counter()
    for i, (_, _, toks) in enumerate(workload(args.docs, args.questions, args.prompt_tokens, args.suffix)):
        sh.plan(f"r{i}", toks, 0)
        sh.on_state_inserted(toks, 10_000 + i)
        sh._plans.pop(f"r{i}", None)  # noqa: SLF001 - what finish() did, minus its tuning window
    return sh, time.perf_counter() - t0


def eviction_walks(policy: str, docs: int, questions: int, reps: int = 50) -> dict[str, float]:
    """Median/p90 (ms) of the two walks' start-up cost at ``docs * (questions + 1)`` nodes."""
    alpha = 1.0 if policy in ("sparse", "marconi") else None
    pol = TreePolicy(SparseConfig(policy=policy, alpha=alpha), budget_bytes=10**15, cost=COST)
    pol.reset(0)
    nid = 1
    heads = []
    for d in range(docs):
        pol.on_node_added(nid, 0, 32_768, d)
        pol.on_state_set(nid)
        heads.append(nid)
        nid += 1
    for q in range(questions):
        for h in heads:
            pol.plan(f"r{nid}", 32_768 + 64, 2, kv_node_id=h, engine_kv=32_768, engine_prefix=32_768)
            pol.on_node_added(nid, h, 64, q)
            pol.on_state_set(nid)
            pol.on_insert(nid)
            pol.finish(f"r{nid}", (), ())
            nid += 1
    walk, keyfn = [], []
    for rep in range(reps):
        h = heads[rep % docs]
        pol.plan(f"w{rep}", 32_768 + 64, 2, kv_node_id=h, engine_kv=32_768, engine_prefix=32_768)
        pol.on_node_added(nid, h, 64, questions + rep)
        pol.on_state_set(nid)
        pol.on_insert(nid)
        nid += 1
        t0 = time.perf_counter()
        victim = next(pol.eviction_order())
        walk.append(time.perf_counter() - t0)
        pol.on_state_freed(victim)
        t0 = time.perf_counter()
        pol.state_key_fn()(h)
        keyfn.append(time.perf_counter() - t0)
    ms = lambda xs, q: float(1e3 * np.percentile(xs, q))  # noqa: E731
    return {
        "nodes": pol.mirror.num_nodes,
        "candidates": int(pol.cache.evictor.index.n),
        "state_walk_first_ms_median": ms(walk, 50),
        "state_walk_first_ms_p90": ms(walk, 90),
        "kv_walk_key_ms_median": ms(keyfn, 50),
        "kv_walk_key_ms_p90": ms(keyfn, 90),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--walk-docs", type=int, default=400)
    ap.add_argument("--walk-questions", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="20 docs x 5 questions of 4k tokens; 1k-node walks")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.questions, args.prompt_tokens = 20, 5, 4096
        args.walk_docs, args.walk_questions = 100, 9
    cfg = SparseConfig(policy="sparse", alpha=0.0)
    n_req = args.docs * args.questions
    print(
        f"{n_req} requests: {args.docs} prompts x {args.questions} suffixes, "
        f"{args.prompt_tokens}-token prompts"
    )
    pol, t_new = run_mirror(cfg, args)
    new_bytes = deep_size(pol)
    out: dict[str, Any] = {
        "workload": {
            "docs": args.docs,
            "questions": args.questions,
            "prompt_tokens": args.prompt_tokens,
            "suffix_tokens": args.suffix,
            "states": pol.mirror.num_states,
            "nodes": pol.mirror.num_nodes,
        },
        "mirror": {"bytes": new_bytes, "us_per_request": 1e6 * t_new / n_req},
    }
    print(
        f"mirror: {pol.mirror.num_states} states, {pol.mirror.num_nodes} nodes, {new_bytes / 2**20:.2f} MiB, "
        f"{out['mirror']['us_per_request']:.0f} us/request"
    )
    old_cls = load_old_shadow()
    if old_cls is None:
        print(f"shadow: skipped (no git history for {OLD_COMMIT})")
    else:
        sh, t_old = run_shadow(old_cls, cfg, args)
        old_bytes = deep_size(sh)
        copies = sum(a.nbytes for a in sh._state_tokens.values())  # noqa: SLF001
        out["shadow"] = {
            "commit": OLD_COMMIT,
            "bytes": old_bytes,
            "state_token_copies_bytes": copies,
            "us_per_request": 1e6 * t_old / n_req,
        }
        out["ratio_shadow_over_mirror"] = old_bytes / new_bytes
        out["ratio_copies_over_mirror"] = copies / new_bytes
        print(
            f"shadow ({OLD_COMMIT}): {old_bytes / 2**20:.1f} MiB (of which per-state prefix copies "
            f"{copies / 2**20:.1f} MiB), {out['shadow']['us_per_request']:.0f} us/request"
        )
        print(
            f"shadow / mirror: {old_bytes / new_bytes:.0f}x total, {copies / new_bytes:.0f}x the copies alone"
        )
    out["eviction_walks"] = {}
    for name in ("sparse", "lru"):
        w = eviction_walks(name, args.walk_docs, args.walk_questions)
        out["eviction_walks"][name] = w
        print(
            f"eviction walks, {name}, {w['nodes']} nodes / {w['candidates']} candidates: first state "
            f"{w['state_walk_first_ms_median']:.2f} ms (p90 {w['state_walk_first_ms_p90']:.2f}); KV-walk "
            f"key {w['kv_walk_key_ms_median']:.2f} ms (p90 {w['kv_walk_key_ms_p90']:.2f})"
        )
    path = write_json("adapter_policy", out, results_dir(args.quick))
    print(f"wrote {path}")
    if pol.stats.mirror_errors:
        print(f"ERROR: {pol.stats.mirror_errors} engine events did not fit the mirror")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

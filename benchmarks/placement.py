"""Placement benchmark: where to put checkpoints, with the cache contents held fixed.

Part 1 - Pareto front (recurrent-work reduction vs checkpoints per entry). As in the sparse prefix
caching paper, the cache keeps the last ``K`` requests (input + output tokens) as entries, so only
*placement* differs between methods. Request ``t`` overlaps entry ``e`` to depth
``LCP(input_t, e)``; it resumes from the deepest checkpoint ``c <= LCP`` over all live entries and
recomputes ``d - c`` recurrent tokens of the shared prefix, ``d`` = the deepest overlap. The
reduction factor is ``sum d / sum (d - c)`` over the trace (no-cache recompute / recompute).

Methods, each with a budget of ``M`` checkpoints per entry on the 64-token grid (``tree``: see there):
  * ``dp`` - the package's online planner (:class:`sglang_sparse.placement.online.OnlinePlanner`;
    the radix tree does **not** call it): per entry an EW histogram (gamma) of the overlap depths
    of requests with it (seeded with the ``K`` requests before it), re-planned every ``R``
    observations; newly planned positions are captured only when a later request's prefill passes
    them (``resume <= p <= LCP``), and ``admit`` makes room over budget.
  * ``tree`` - what the product's radix tree does (:class:`TreePlanner`): a ``sparse``
    :class:`~sglang_sparse.policy.HybridCache` (``plan_budget=M``) holding exactly the live entries
    serves every request through the product's own calls (``match``, ``observe``, ``capture_plan``,
    ``insert``), with no seeding from past requests. The product has no per-entry budget
    (``plan_budget`` bounds an edge's plan; the states held are bounded by the byte budget), so ``M``
    is applied as its memory pressure would, after each request, in its eviction order
    (``Evictor.scores()``, alpha 0, the bootstrap value; checkpoint drops only, the contents stay
    fixed): ``--tree-budget pooled`` (default) keeps at most ``M`` distinct states per live entry (a
    shared prefix's state counting once), ``entry`` at most ``M`` checkpoints on every entry's
    root-to-leaf path. The JSON rows give both counts (``states_per_entry``,
    ``path_checkpoints_per_entry``). An entry leaving the window loses the part of its path no live
    entry shares (``drop_leaf`` / ``truncate``, then the evictor's merge of a checkpoint-free
    single-child node).
  * ``block`` / ``balanced`` / ``log`` / ``sqrt`` - the budgeted baselines (placement.BASELINES).
  * ``oracle`` - the DP fed each entry's true lifetime overlap law (an upper bound for per-entry
    grid placement; ``tree`` can exceed it: it also checkpoints off-grid edge ends).
  * ``block@B`` - block caching with a fixed block size B (its checkpoint count varies by length).

Short-prompt sets (``<name>_short``): the same replay on a variant of each Pareto trace with a
median input of ~250 tokens and the prefix sharing kept (:func:`short_prompt_variant`).
Acceptance: ``dp`` >= block, balanced, log and sqrt at every ``M`` on every set, long and short.
Also reported (never fails the run): whether ``tree`` >= those baselines at every ``M`` on every set.

Part 2 - DP solve time (ms) vs N (64-token blocks) and M: native hull, Python hull and the O(N²M)
reference.

Run: ``python -m benchmarks.placement [--traces traces/build] [--quick]``. Writes
``benchmarks/results/placement.json``, ``placement_pareto.png``, ``placement_dp_time.json`` and
``placement_dp_time.png`` (``--quick``: under ``benchmarks/results/quick/``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sglang_sparse.placement import (
    BASELINES,
    DEFAULT_GRID,
    DepthHistogram,
    DepthLaw,
    DepthPrior,
    OnlinePlanner,
    admit,
    block_placement,
    grid_candidates,
    passed_positions,
    solve_dp,
    solve_dp_python,
    solve_dp_reference,
)
from sglang_sparse.policy import HybridCache, ModelCostModel
from sglang_sparse.policy.evict import CKPT
from sglang_sparse.sim.models import cost_model
from sglang_sparse.tree import Node, as_tokens
from sglang_sparse.tree.lcp import lcp_numpy

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import REPO, progress, pyplot, results_dir, save, table, write_json  # noqa: E402

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
PARETO_TRACES = ("system_prompts", "doc_qa", "rag")
SHORT_MEDIAN = 250
"""Target median input (tokens) of the short-prompt sets (:func:`short_prompt_variant`)."""
SHORT_SUFFIX = "_short"
ACCEPT_BASELINES = ("block", "balanced", "log", "sqrt")
"""The budgeted baselines the online DP must match or beat at every M (``tree``: reported only)."""
TREE_BUDGET_RULES = ("pooled", "entry")
"""How the ``tree`` method applies the budget ``M`` (:class:`TreePlanner`): ``pooled`` (default) as
the product's global memory budget would, ``entry`` strictly per entry path."""
TREE_MODEL = "qwen3-next-80b-a3b"
"""Cost model the ``tree`` method's :class:`HybridCache` is built with (the sparse policy is
FLOP-aware; with alpha = 0 its eviction ranking does not read it)."""


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (any integer dtype)."""
    return lcp_numpy(a, b, 0)


@dataclass
class Entry:
    """A cached sequence and, per method key, its checkpoint positions (sorted int64)."""

    tokens: np.ndarray
    born: int
    sets: dict[str, np.ndarray] = field(default_factory=dict)
    hist: DepthHistogram | None = None
    pending: dict[str, set[int]] = field(default_factory=dict)
    target: dict[str, set[int]] = field(default_factory=dict)
    law: DepthLaw | None = None
    lifetime_depths: list[int] = field(default_factory=list)


def _resume(positions: np.ndarray, depth: int) -> int:
    k = int(np.searchsorted(positions, depth, side="right"))
    return int(positions[k - 1]) if k else 0


class TreePlanner:
    """The product's placement for one budget ``M``: a :class:`HybridCache` (``sparse`` policy,
    ``plan_budget=M``) holding exactly the live entries, driven by the product's own calls.

    * :meth:`serve` - one request as the simulator serves it (``match``, ``observe``,
      ``capture_plan``, ``insert`` of input + output), without the byte-budget eviction.
    * :meth:`forget` - an entry leaves the last-K window: the part of its path that no live entry
      shares is dropped with the tree's eviction primitives (``drop_leaf`` / ``truncate``), then a
      checkpoint-free single-child node is merged into its child as the product's evictor does
      after a leaf eviction.
    * :meth:`enforce` - the budget of ``M`` checkpoints per entry, which the product does not have
      (see the module docstring), applied in the product's eviction order (``Evictor.scores()``,
      lowest first, checkpoint candidates only: the contents stay fixed). ``rule="pooled"`` (the
      product under memory pressure): drop checkpoints until the tree holds at most ``M`` distinct
      states per live entry. ``rule="entry"``: drop, among checkpoints on the path of an entry that
      holds more than ``M`` on its root-to-leaf path, the lowest-ranked, until none does.
    """

    def __init__(
        self,
        budget: int,
        gamma: float = 0.99,
        refresh: int = 10,
        grid: int = DEFAULT_GRID,
        rule: str = "pooled",
    ) -> None:
        if rule not in TREE_BUDGET_RULES:
            raise ValueError(f"unknown tree budget rule {rule!r}; valid: {', '.join(TREE_BUDGET_RULES)}")
        self.budget = int(budget)
        self.rule = rule
        self.cache = HybridCache(
            "sparse",
            budget_bytes=10**18,  # never binding: enforce() applies the budget
            cost=_tree_cost_model(),
            gamma=gamma,
            refresh=refresh,
            plan_budget=self.budget,
            grid=grid,
        )

    @property
    def states(self) -> int:
        """Distinct checkpoints the tree holds (a shared prefix's state counts once)."""
        return self.cache.tree.num_states

    def serve(self, inp: np.ndarray, full: np.ndarray, kv_depth: int, resume: int) -> None:
        """Serve one request (int32 ``inp`` / ``full`` = input + output tokens). ``kv_depth`` and
        ``resume`` are the replay's deepest overlap and resume depth from the per-entry positions;
        the tree's own match must agree (checked)."""
        cache = self.cache
        m = cache.match(inp)
        if (m.kv_depth, m.resume_depth) != (kv_depth, resume):
            raise AssertionError(
                f"tree/{self.budget}: tree match (kv {m.kv_depth}, resume {m.resume_depth}) != "
                f"replay (kv {kv_depth}, resume {resume})"
            )
        cache.observe(m)
        plan = cache.capture_plan(m, inp.size, full.size)
        cache.insert(full, None, {p: p for p in plan})

    def forget(self, tokens: np.ndarray, shared: int) -> None:
        """Drop the part of entry ``tokens`` deeper than ``shared`` = its longest common prefix with
        any live entry (nothing when another live entry holds all of it)."""
        tree = self.cache.tree
        if shared >= tokens.size:
            return
        m = tree.match(tokens)
        node = m.node
        if m.kv_depth != tokens.size or node.end != tokens.size:
            raise AssertionError(f"tree/{self.budget}: entry of {tokens.size} tokens is not a path end")
        while node.parent is not None and node.end > shared and not node.children:
            if node.start >= shared:
                parent = node.parent
                tree.drop_leaf(node)
                node = parent
            else:
                node = tree.truncate(node, shared)[1]
        # as Evictor._after_change after a leaf eviction
        if node.parent is not None and len(node.children) == 1 and not node.checkpoints:
            tree.merge_with_child(node)

    def _paths(self, live: dict[int, np.ndarray]) -> dict[int, list[tuple[Node, int]]]:
        """Per live entry (id -> int32 tokens): the checkpoints ``(node, position)`` on its path."""
        tree = self.cache.tree
        out = {}
        for e, tokens in live.items():
            n = tokens.size
            out[e] = [(node, p) for node in tree.match(tokens).path for p in node.checkpoints if p <= n]
        return out

    def enforce(self, live: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Apply the budget to the live entries (id -> int32 tokens); returns the positions on each
        entry's path (sorted int64; a shared prefix's checkpoint appears on every entry through it)."""
        tree = self.cache.tree
        if self.rule == "pooled":
            excess = tree.num_states - self.budget * len(live)
            if excess > 0:
                for cand in self.cache.evictor.scores():  # lowest rank first
                    if cand.kind == CKPT:
                        tree.drop_checkpoint(cand.node, cand.pos)
                        excess -= 1
                        if excess <= 0:
                            break
            held = self._paths(live)
        else:
            held = self._paths(live)
            over = {e for e, h in held.items() if len(h) > self.budget}
            if over:
                count = {e: len(h) for e, h in held.items()}
                holders: dict[tuple[Node, int], list[int]] = {}
                for e, h in held.items():
                    for x in h:
                        holders.setdefault(x, []).append(e)
                for cand in self.cache.evictor.scores():  # lowest rank first
                    es = holders.get((cand.node, cand.pos), ()) if cand.kind == CKPT else ()
                    if not any(e in over for e in es):
                        continue
                    tree.drop_checkpoint(cand.node, cand.pos)
                    for e in es:
                        count[e] -= 1
                        if count[e] <= self.budget:
                            over.discard(e)
                    if not over:
                        break
        return {
            e: np.array(sorted(p for node, p in h if p in node.checkpoints), dtype=np.int64)
            for e, h in held.items()
        }


@functools.cache
def _tree_cost_model() -> ModelCostModel:
    return cost_model(TREE_MODEL)


@dataclass
class ReplayResult:
    """Per method key: sum of shared-prefix depths, of recomputed tokens, worst case, and the mean
    checkpoints held per live entry (averaged over every request step; ``tree``: what its budget
    rule bounds, distinct states for ``pooled``, path checkpoints for ``entry``). For ``tree`` keys
    also the mean distinct states per live entry (``states``: a shared prefix's state counts once)
    and the mean checkpoints on each live entry's root-to-leaf path (``path_checkpoints``: a shared
    prefix's state counts for every entry through it)."""

    overlap_tokens: float
    recompute: dict[str, float]
    worst: dict[str, int]
    checkpoints: dict[str, float]
    states: dict[str, float] = field(default_factory=dict)
    path_checkpoints: dict[str, float] = field(default_factory=dict)

    def reduction(self, key: str) -> float:
        r = self.recompute[key]
        return self.overlap_tokens / r if r > 0 else float("inf")


def replay_last_k(
    sequences: Sequence[tuple[np.ndarray, np.ndarray]],
    budgets: Sequence[int] = BUDGETS,
    block_sizes: Sequence[int] = BLOCK_SIZES,
    k_entries: int = 32,
    gamma: float = 0.99,
    refresh: int = 10,
    grid: int = DEFAULT_GRID,
    desc: str = "",
    tree_budget: str = "pooled",
) -> ReplayResult:
    """Replay ``(input_tokens, full_sequence)`` pairs through a last-K cache for every method
    (``tree_budget``: the ``tree`` method's budget rule, :data:`TREE_BUDGET_RULES`)."""
    keys = [f"dp/{m}" for m in budgets] + [f"tree/{m}" for m in budgets] + [f"oracle/{m}" for m in budgets]
    keys += [f"{b}/{m}" for b in BASELINES if b != "last" for m in budgets] + [
        f"block@{b}" for b in block_sizes
    ]
    recompute = dict.fromkeys(keys, 0.0)
    worst = dict.fromkeys(keys, 0)
    ck_sum = dict.fromkeys(keys, 0.0)
    n_entries = 0
    overlap = 0.0
    # pass 1: overlaps of every request with every live entry (placement-independent)
    live: list[int] = []
    overlaps: list[list[tuple[int, int]]] = []
    lifetime: list[list[int]] = [[] for _ in sequences]
    for t, (inp, _full) in enumerate(sequences):
        row = []
        for e in live:
            d = lcp(inp, sequences[e][1])
            lifetime[e].append(d)
            if d > 0:
                row.append((e, d))
        overlaps.append(row)
        live.append(t)
        if len(live) > k_entries:
            live.pop(0)
    # pass 2: placements
    entries: dict[int, Entry] = {}
    prior = DepthPrior(gamma, grid)
    planner = OnlinePlanner(grid)
    trees = {m: TreePlanner(m, gamma, refresh, grid, tree_budget) for m in budgets}
    tokens32: dict[int, np.ndarray] = {}  # live entries' full sequences as the tree's int32 tokens
    states = dict.fromkeys((f"tree/{m}" for m in budgets), 0.0)
    for t, (inp, full) in progress(enumerate(sequences), total=len(sequences), desc=desc):
        row = overlaps[t]
        d_max = max((d for _, d in row), default=0)
        overlap += d_max
        resumes: dict[str, int] = {}
        for key in keys:
            c = resumes[key] = max((_resume(entries[e].sets[key], d) for e, d in row), default=0)
            recompute[key] += d_max - c
            worst[key] = max(worst[key], d_max - c)
        # tree: the product serves the request (its captures land on the live entries' paths)
        tokens32[t] = as_tokens(full)
        inp32 = as_tokens(inp)
        for m, tree in trees.items():
            tree.serve(inp32, tokens32[t], d_max, resumes[f"tree/{m}"])
        if row:
            e_best, d_best = max(row, key=lambda x: (x[1], x[0]))
            prior.observe(d_best, entries[e_best].tokens.size)
        # online DP: observe, re-plan every `refresh` observations, capture passed positions
        for e, entry in entries.items():
            d = next((dd for ee, dd in row if ee == e), 0)
            assert entry.hist is not None
            entry.hist.observe(d)
            for m in budgets:
                key = f"dp/{m}"
                resume = max((_resume(entries[ee].sets[key], dd) for ee, dd in row), default=0)
                passed = passed_positions(entry.pending[key], resume, d)
                if passed:
                    assert entry.law is not None
                    entry.pending[key] -= passed
                    entry.sets[key] = admit(entry.sets[key], passed, entry.target[key], m, entry.law)
            if entry.hist.due:
                entry.hist.mark_refreshed()
                _plan_dp(entry, budgets, planner, prior, initial=False)
        # insert the new entry
        entry = Entry(tokens=full, born=t, hist=DepthHistogram(gamma, refresh))
        for s in range(max(0, t - k_entries), t):
            entry.hist.observe(lcp(sequences[s][0], full))
        entry.hist.mark_refreshed()
        n = full.size
        _plan_dp(entry, budgets, planner, prior, initial=True)
        cands = grid_candidates(n, grid)
        for m in budgets:
            law = DepthLaw.from_depths(lifetime[t], None, cands)
            entry.sets[f"oracle/{m}"] = np.array(solve_dp(law, m).positions, dtype=np.int64)
            for b, place in BASELINES.items():
                if b != "last":
                    entry.sets[f"{b}/{m}"] = np.array(place(n, m, grid, 0), dtype=np.int64)
        for b in block_sizes:
            entry.sets[f"block@{b}"] = np.array(block_placement(n, b, grid), dtype=np.int64)
        entries[t] = entry
        if len(entries) > k_entries:
            old = min(entries)
            del entries[old]
            gone = tokens32.pop(old)
            shared = max(lcp(gone, tok) for tok in tokens32.values())
            for tree in trees.values():
                tree.forget(gone, shared)
        for m, tree in trees.items():
            for e, pos in tree.enforce(tokens32).items():
                entries[e].sets[f"tree/{m}"] = pos
            states[f"tree/{m}"] += tree.states
        for key in keys:  # time average over live entries
            ck_sum[key] += sum(en.sets[key].size for en in entries.values())
        n_entries += len(entries)
    per_entry = {k: v / max(n_entries, 1) for k, v in ck_sum.items()}
    states = {k: v / max(n_entries, 1) for k, v in states.items()}
    path = {k: per_entry[k] for k in states}
    if tree_budget == "pooled":  # the budget bounds distinct states
        per_entry.update(states)
    return ReplayResult(overlap, recompute, worst, per_entry, states, path)


def _plan_dp(
    entry: Entry, budgets: Sequence[int], planner: OnlinePlanner, prior: DepthPrior, initial: bool
) -> None:
    """Re-plan the entry's targets for every budget (placement.OnlinePlanner); at insertion they are
    held at once, later new targets wait in ``pending`` until a prefill passes them."""
    assert entry.hist is not None
    entry.law, targets = planner.plan(*entry.hist.items(), entry.tokens.size, budgets, prior)
    for m, target in targets.items():
        key = f"dp/{m}"
        entry.target[key] = set(target.tolist())
        if initial:
            entry.sets[key] = target
            entry.pending[key] = set()
        else:  # captured positions stay until a planned one arrives and needs the room
            entry.pending[key] = entry.target[key] - set(entry.sets[key].tolist())


def load_sequences(path: Path, limit: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input tokens, input + output tokens) per request of a JSONL trace."""
    from sglang_sparse.traces import read_trace

    out = []
    for r in read_trace(path)[:limit]:
        inp = np.asarray(r.input_tokens, dtype=np.int64)
        out.append((inp, np.concatenate([inp, np.asarray(r.output_tokens, dtype=np.int64)])))
    return out


def short_prompt_variant(
    sequences: Sequence[tuple[np.ndarray, np.ndarray]], target_median: int = SHORT_MEDIAN
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """A short-prompt set (median input ~``target_median`` tokens) built from a single-turn trace.

    Construction (deterministic): with stride ``k = max(1, round(median input / target_median))``
    every request keeps every ``k``-th token of its input (``input[::k]``) and its whole output
    (``input[::k] + output``). Decimation keeps prefix sharing: when two inputs agree on their first
    ``d`` tokens, their decimated inputs agree on their first ``ceil(d / k)``, so every sharing
    relation of the source (instruction prefix, popular system prompt, retrieved-chunk boundaries,
    document end) survives with its depth scaled by ``1/k`` and its proportions kept (the decimated
    LCP exceeds ``ceil(d / k)`` only where kept tokens after the divergence happen to agree; the
    replay recomputes every LCP exactly on the new sequences). The 64-token grid is not scaled,
    so an entry now spans a few grid blocks only, and the answer (16-128 tokens, kept whole as
    real chat answers are; no request of a single-turn trace extends another's output) is a large
    share of it. Returns the new ``(input, input + output)`` pairs and ``k``.
    """
    if target_median <= 0:
        raise ValueError(f"target_median must be > 0 tokens, got {target_median}")
    if not sequences:
        return [], 1
    k = max(1, round(float(np.median([inp.size for inp, _ in sequences])) / target_median))
    out = []
    for inp, full in sequences:
        short = inp[::k]
        out.append((short, np.concatenate([short, full[inp.size :]])))
    return out, k


def _replay_summary(
    seqs: Sequence[tuple[np.ndarray, np.ndarray]], k_entries: int, desc: str, tree_budget: str = "pooled"
) -> dict:
    res = replay_last_k(seqs, k_entries=k_entries, desc=desc, tree_budget=tree_budget)
    methods: dict[str, list[dict]] = {}
    for key in res.recompute:
        method, _, m = key.partition("/")
        row = {
            "budget": int(m) if m else None,
            "checkpoints_per_entry": res.checkpoints[key],
            "reduction": res.reduction(key),
            "recompute_tokens": res.recompute[key],
            "worst_recompute_tokens": res.worst[key],
        }
        if key in res.states:
            row["states_per_entry"] = res.states[key]
            row["path_checkpoints_per_entry"] = res.path_checkpoints[key]
        methods.setdefault(method, []).append(row)
    inputs = [inp.size for inp, _ in seqs]
    return {
        "requests": len(seqs),
        "median_input_tokens": float(np.median(inputs)) if inputs else 0.0,
        "overlap_tokens": res.overlap_tokens,
        "methods": methods,
    }


def pareto(
    trace_dir: Path,
    traces: Sequence[str],
    limit: int | None,
    k_entries: int,
    short_traces: Sequence[str] = (),
    short_median: int = SHORT_MEDIAN,
    tree_budget: str = "pooled",
) -> dict:
    """Part 1 on every trace in ``traces`` and on the short-prompt variant (key ``<name>_short``,
    :func:`short_prompt_variant`) of every trace in ``short_traces``."""
    results: dict = {}
    loaded: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for name in list(traces) + [n for n in short_traces if n not in traces]:
        path = trace_dir / f"{name}.jsonl"
        if not path.exists():
            raise SystemExit(
                f"error: trace {path} not found; build it with `python -m sglang_sparse.traces build {name}`"
            )
        loaded[name] = load_sequences(path, limit)
    for name in progress(traces, desc="traces"):
        results[name] = _replay_summary(loaded[name], k_entries, name, tree_budget)
    for name in progress(short_traces, desc="short-prompt sets"):
        seqs, stride = short_prompt_variant(loaded[name], short_median)
        results[f"{name}{SHORT_SUFFIX}"] = {
            "source": name,
            "stride": stride,
            **_replay_summary(seqs, k_entries, f"{name}{SHORT_SUFFIX}", tree_budget),
        }
    return results


def _losses(meth: dict, method: str) -> tuple[list[dict], float]:
    """Where ``method`` loses to a budgeted baseline (block, balanced, log, sqrt) at the same M, and
    the smallest ``method / best baseline`` over M."""
    own = {x["budget"]: x["reduction"] for x in meth[method]}
    losses = []
    best: dict[int, float] = {}
    for b in ACCEPT_BASELINES:
        for x in meth[b]:
            best[x["budget"]] = max(best.get(x["budget"], 0.0), x["reduction"])
            if own[x["budget"]] < x["reduction"] * (1 - 1e-9):
                losses.append(
                    {"baseline": b, "budget": x["budget"], method: own[x["budget"]], "it": x["reduction"]}
                )
    margin = min((own[m] / v for m, v in best.items() if v > 0), default=float("nan"))
    return losses, margin


def acceptance(results: dict) -> dict:
    """Per set: where DP loses to a budgeted baseline (block, balanced, log, sqrt) at the same M
    (``dp_loses_to``; empty = the acceptance holds), the smallest ``dp / best baseline`` over M
    (``dp_min_margin``, >= 1 when it holds) and the checkpoints DP needs to match each block size.
    When the set has the ``tree`` method: the same for it (``tree_loses_to``, ``tree_min_margin``;
    reported, not part of the acceptance)."""
    out: dict = {}
    for name, r in results.items():
        meth = r["methods"]
        dp = {x["budget"]: x["reduction"] for x in meth["dp"]}
        dp_ck = {x["budget"]: x["checkpoints_per_entry"] for x in meth["dp"]}
        losses, margin = _losses(meth, "dp")
        matches = []
        for key, xs in meth.items():
            if not key.startswith("block@"):
                continue
            x = xs[0]
            if x["reduction"] <= 1.0 + 1e-9:
                continue  # this block size never helps: nothing to match
            need = next((m for m in sorted(dp) if dp[m] >= x["reduction"] * (1 - 1e-9)), None)
            matches.append(
                {
                    "block_size": int(key.split("@")[1]),
                    "block_checkpoints": x["checkpoints_per_entry"],
                    "block_reduction": x["reduction"],
                    "dp_budget_needed": need,
                    "dp_checkpoints": dp_ck[need] if need else None,
                    "ratio": (dp_ck[need] / x["checkpoints_per_entry"])
                    if need and x["checkpoints_per_entry"]
                    else None,
                }
            )
        out[name] = {"dp_loses_to": losses, "dp_min_margin": margin, "dp_vs_block": matches}
        if "tree" in meth:
            tree_losses, tree_margin = _losses(meth, "tree")
            out[name].update({"tree_loses_to": tree_losses, "tree_min_margin": tree_margin})
    return out


def time_dp(quick: bool) -> dict:
    """Solve time (seconds, best of a few) vs N blocks and M for the three implementations."""
    rng = np.random.default_rng(0)
    ns = (64, 128, 256, 512, 1024, 2048)
    ms = (1, 4, 16, 64)
    rows = []
    for n in progress(ns, desc="dp timing"):
        length = n * DEFAULT_GRID
        law = DepthLaw.on_grid(rng.integers(0, length + 1, 8 * n), rng.random(8 * n), length)
        for m in ms:
            row = {"n_blocks": n, "budget": m}
            for name, fn, reps in (
                ("native", solve_dp, 7),
                ("python", solve_dp_python, 1 if n >= 1024 else 3),
                ("reference", solve_dp_reference, 1),
            ):
                if quick and name == "reference" and n > 512:
                    continue
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn(law, m)
                    best = min(best, time.perf_counter() - t0)
                row[name] = best
            rows.append(row)
    growth = {}
    for name in ("native", "python", "reference"):
        pts = [
            (r["n_blocks"], r[name]) for r in rows if r["budget"] == 64 and name in r and r["n_blocks"] >= 256
        ]
        if len(pts) >= 2:
            x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
            growth[name] = float(np.polyfit(x, y, 1)[0])
    top = next(r for r in rows if r["n_blocks"] == 2048 and r["budget"] == 64)
    return {
        "rows": rows,
        "growth_exponent_in_N_at_M64": growth,
        "n2048_m64": {
            "native_ms": top["native"] * 1e3,
            "python_ms": top["python"] * 1e3,
            "reference_ms": top.get("reference", float("nan")) * 1e3,
            "reference_over_native": top.get("reference", float("nan")) / top["native"],
            "reference_over_python": top.get("reference", float("nan")) / top["python"],
        },
    }


def plot_pareto(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ncols = min(3, len(results))
    nrows = -(-len(results) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(results) :]:
        ax.set_visible(False)
    style = dict(dp="o-", tree="D-", oracle="k:", block="s--", balanced="^--", log="v--", sqrt="d--")
    for ax, (name, r) in zip(axes.flat, results.items(), strict=False):
        for method, mk in style.items():
            if method not in r["methods"]:
                continue
            xs = [x["checkpoints_per_entry"] for x in r["methods"][method]]
            ys = [x["reduction"] for x in r["methods"][method]]
            ax.plot(xs, ys, mk, label="tree (product)" if method == "tree" else method, ms=4)
        bx = [r["methods"][k][0]["checkpoints_per_entry"] for k in r["methods"] if k.startswith("block@")]
        by = [r["methods"][k][0]["reduction"] for k in r["methods"] if k.startswith("block@")]
        ax.plot(bx, by, "x-", color="gray", label="block@B (fixed size)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            if hi / lo < 20:  # a narrow range: label 2, 3, 5 x 10^k too
                axis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
                axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            else:
                axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("checkpoints per cache entry")
        ax.set_ylabel("recurrent-work reduction (x)")
        ax.set_title(f"{name} ({r['requests']} req., median input {r['median_input_tokens']:.0f} tok)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save(fig, path)


def plot_dp_time(timing: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, mk in (("native", "o-"), ("python", "s-"), ("reference", "^-")):
        pts = [(r["n_blocks"], r[name]) for r in timing["rows"] if r["budget"] == 64 and name in r]
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], mk, label=f"{name} (M=64)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (64-token blocks)")
    ax.set_ylabel("solve time (ms)")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=REPO / "traces" / "build", help="folder of built traces")
    ap.add_argument("--names", nargs="+", default=list(PARETO_TRACES), help="traces for the Pareto front")
    add = ap.add_argument
    add(
        "--short-names",
        nargs="*",
        default=list(PARETO_TRACES),
        help="traces whose short-prompt variant is also replayed (none: skip)",
    )
    add("--short-median", type=int, default=SHORT_MEDIAN, help="target median input of short sets (tokens)")
    add("--limit", type=int, default=None, help="use only the first N requests of each trace")
    add("--entries", type=int, default=32, help="K: the cache keeps the last K requests")
    add("--quick", action="store_true", help="small run (CI smoke): 300 requests, no big reference DP")
    add(
        "--tree-budget",
        choices=TREE_BUDGET_RULES,
        default="pooled",
        help="how the tree method applies the budget M (TreePlanner): pooled as the product's memory "
        "budget, or strictly per entry path",
    )
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args(argv)
    if args.quick and args.limit is None:
        args.limit = 300
    out = results_dir(args.quick)
    results = pareto(
        args.traces,
        args.names,
        args.limit,
        args.entries,
        args.short_names,
        args.short_median,
        args.tree_budget,
    )
    acc = acceptance(results)
    holds = all(not a["dp_loses_to"] for a in acc.values())
    tree_holds = all(not a["tree_loses_to"] for a in acc.values())
    write_json(
        "placement",
        {
            "k_entries": args.entries,
            "limit": args.limit,
            "budgets": list(BUDGETS),
            "short_median_target": args.short_median,
            "traces": results,
            "acceptance": acc,
            "acceptance_holds": holds,
            "tree_budget_rule": args.tree_budget,
            "tree_beats_baselines": tree_holds,
        },
        out,
    )
    plot_pareto(results, out / "placement_pareto.png")
    cols = ("dp", "tree", "oracle", "block", "balanced", "log", "sqrt")
    for name, r in results.items():
        meth = r["methods"]
        rows = [
            [m, *(meth[k][i]["reduction"] for k in cols), meth["tree"][i]["checkpoints_per_entry"]]
            for i, m in enumerate(BUDGETS)
        ]
        what = f"{r['requests']} requests, median input {r['median_input_tokens']:.0f} tokens"
        if "stride" in r:
            what += f", every {r['stride']}th input token of {r['source']}"
        print(
            f"\n== {name} ({what}): recurrent-work reduction (x) by checkpoint budget M, "
            f"last-{args.entries} entries"
        )
        print(table(rows, ["M", *cols, "tree ckpt/entry"]))
        print(f"   DP loses to a baseline at: {acc[name]['dp_loses_to'] or 'nowhere'}")
        tree_losses = [(x["baseline"], x["budget"]) for x in acc[name]["tree_loses_to"]]
        print(f"   tree (the product) loses to a baseline at: {tree_losses or 'nowhere'}")
        for x in acc[name]["dp_vs_block"]:
            print(
                f"   block@{x['block_size']}: {x['block_checkpoints']:.1f} ckpt/entry, reduction "
                f"{x['block_reduction']:.3g}x; DP matches with M={x['dp_budget_needed']} "
                f"(ratio {x['ratio'] if x['ratio'] is None else round(x['ratio'], 3)})"
            )
    print(
        "\n== acceptance (online DP >= block, balanced, log, sqrt at every M): "
        + ("holds on every set" if holds else "FAILS")
        + "; min dp / best baseline: "
        + ", ".join(f"{n} {a['dp_min_margin']:.4f}" for n, a in acc.items())
    )
    print(
        f"== tree (the product's radix tree, budget {args.tree_budget}) >= block, balanced, log, sqrt at "
        "every M: "
        + ("yes on every set" if tree_holds else "NO (reported only)")
        + "; min tree / best baseline: "
        + ", ".join(f"{n} {a['tree_min_margin']:.4f}" for n, a in acc.items())
    )
    if not args.skip_timing:
        timing = time_dp(args.quick)
        write_json("placement_dp_time", timing, out)
        plot_dp_time(timing, out / "placement_dp_time.png")
        t = timing["n2048_m64"]
        print(
            f"\n== DP solve time at N=2048 blocks, M=64: native {t['native_ms']:.2f} ms, python hull "
            f"{t['python_ms']:.1f} ms, O(N^2 M) reference {t['reference_ms']:.0f} ms; reference/native = "
            f"{t['reference_over_native']:.0f}x; growth exponents in N: "
            f"{timing['growth_exponent_in_N_at_M64']}"
        )
    print(f"\nresults in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

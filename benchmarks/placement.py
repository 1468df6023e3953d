"""Placement benchmark: where to put checkpoints, with the cache contents held fixed.

Part 1 - Pareto front (recurrent-work reduction vs checkpoints per entry). As in the sparse prefix
caching paper, the cache keeps the last ``K`` requests (input + output tokens) as entries, so only
*placement* differs between methods. Request ``t`` overlaps entry ``e`` to depth
``LCP(input_t, e)``; it resumes from the deepest checkpoint ``c <= LCP`` over all live entries and
recomputes ``d - c`` recurrent tokens of the shared prefix, ``d`` = the deepest overlap. The
reduction factor is ``sum d / sum (d - c)`` over the trace (no-cache recompute / recompute).

Methods, each with a budget of ``M`` checkpoints per entry on the 64-token grid:
  * ``dp`` - online DP: every entry keeps an EW histogram (gamma) of the overlap depths that
    requests had with it (seeded with the ``K`` requests before it, then every later request),
    re-solved every ``R`` observations; newly planned positions are captured only when a later
    request's prefill passes them (``resume < p <= LCP``); unused budget is filled by balanced spacing.
  * ``block`` / ``balanced`` / ``log`` / ``sqrt`` - the budgeted baselines (placement.BASELINES).
  * ``oracle`` - the DP fed each entry's true lifetime overlap law (an upper bound).
  * ``block@B`` - block caching with a fixed block size B (its checkpoint count varies by length).

Part 2 - DP solve time vs N (blocks) and M: native hull, Python hull and the O(N²M) reference.

Run: ``python -m benchmarks.placement [--traces traces/build] [--quick]``. Writes
``benchmarks/results/placement.json``, ``placement_pareto.png``, ``placement_dp_time.json`` and
``placement_dp_time.png`` (``--quick``: under ``benchmarks/results/quick/``).
"""

from __future__ import annotations

import argparse
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
    balanced_placement,
    block_placement,
    grid_candidates,
    solve_dp,
    solve_dp_python,
    solve_dp_reference,
)

from ._common import REPO, progress, table, write_json

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
PARETO_TRACES = ("system_prompts", "doc_qa", "rag")
PRIOR_WEIGHT = 0.05
"""Mass of the global relative-depth prior, as a fraction of the entry's own mass at depths >= one
grid step (the mass a checkpoint can serve); the prior alone decides when that mass is zero."""
REL_RESOLUTION = 4096
"""Relative depths ``d / len`` are kept in the global histogram as integers in [0, REL_RESOLUTION]."""


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if neq.size else n


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


def _fill(plan: Sequence[int], length: int, budget: int, grid: int) -> np.ndarray:
    """DP positions plus evenly spread positions (the last-resort prior) until ``budget`` is used."""
    chosen = set(plan)
    spare = budget - len(chosen)
    if spare > 0:
        for p in balanced_placement(length, spare, grid) + balanced_placement(length, budget, grid):
            if len(chosen) >= budget:
                break
            chosen.add(p)
    return np.array(sorted(chosen), dtype=np.int64)


@dataclass
class ReplayResult:
    """Per method key: sum of shared-prefix depths, of recomputed tokens, worst case, and the mean
    checkpoints held per live entry (averaged over every request step)."""

    overlap_tokens: float
    recompute: dict[str, float]
    worst: dict[str, int]
    checkpoints: dict[str, float]

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
) -> ReplayResult:
    """Replay ``(input_tokens, full_sequence)`` pairs through a last-K cache for every method."""
    keys = [f"dp/{m}" for m in budgets] + [f"oracle/{m}" for m in budgets]
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
    prior = DepthHistogram(gamma, refresh)
    for t, (_inp, full) in progress(enumerate(sequences), total=len(sequences), desc=desc):
        row = overlaps[t]
        d_max = max((d for _, d in row), default=0)
        overlap += d_max
        for key in keys:
            c = max((_resume(entries[e].sets[key], d) for e, d in row), default=0)
            recompute[key] += d_max - c
            worst[key] = max(worst[key], d_max - c)
        if row:
            e_best, d_best = max(row, key=lambda x: (x[1], x[0]))
            prior.observe(round(d_best / entries[e_best].tokens.size * REL_RESOLUTION))
        # online DP: observe, re-plan every `refresh` observations, capture passed positions
        for e, entry in entries.items():
            d = next((dd for ee, dd in row if ee == e), 0)
            assert entry.hist is not None
            entry.hist.observe(d)
            for m in budgets:
                key = f"dp/{m}"
                resume = max((_resume(entries[ee].sets[key], dd) for ee, dd in row), default=0)
                passed = {p for p in entry.pending[key] if resume <= p <= d}
                if passed:
                    entry.pending[key] -= passed
                    entry.sets[key] = _admit(entry, key, passed, m)
            if entry.hist.due:
                entry.hist.mark_refreshed()
                _plan_dp(entry, budgets, grid, prior, initial=False)
        # insert the new entry
        entry = Entry(tokens=full, born=t, hist=DepthHistogram(gamma, refresh))
        for s in range(max(0, t - k_entries), t):
            entry.hist.observe(lcp(sequences[s][0], full))
        entry.hist.mark_refreshed()
        n = full.size
        _plan_dp(entry, budgets, grid, prior, initial=True)
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
            del entries[min(entries)]
        for key in keys:  # time average over live entries
            ck_sum[key] += sum(en.sets[key].size for en in entries.values())
        n_entries += len(entries)
    checkpoints = {k: v / max(n_entries, 1) for k, v in ck_sum.items()}
    return ReplayResult(overlap, recompute, worst, checkpoints)


def _plan_dp(entry: Entry, budgets: Sequence[int], grid: int, prior: DepthHistogram, initial: bool) -> None:
    """Re-solve the entry's DP for every budget from its histogram plus the light global prior."""
    assert entry.hist is not None
    n = entry.tokens.size
    own_d, own_w = entry.hist.items()
    cands = grid_candidates(n, grid)
    informative = float(own_w[own_d >= grid].sum())  # mass a checkpoint could serve at all
    prior_mass = PRIOR_WEIGHT * informative if informative > 0 else 1.0
    rel, rel_w = prior.items()
    if rel_w.size:
        rel_w = rel_w * (0.5 * prior_mass / rel_w.sum())
    # uniform hedge: equal mass in the middle of every grid block (balanced spacing is its optimum)
    uni_d = np.minimum(cands + grid // 2, n).astype(np.float64)
    uni_w = np.full(uni_d.size, 0.5 * prior_mass / max(uni_d.size, 1))
    depths = np.concatenate([own_d.astype(np.float64), np.floor(rel / REL_RESOLUTION * n), uni_d])
    law = DepthLaw.from_depths(depths, np.concatenate([own_w, rel_w, uni_w]), cands)
    entry.law = law
    for m in budgets:
        key = f"dp/{m}"
        target = _fill(solve_dp(law, m).positions, n, m, grid)
        entry.target[key] = set(target.tolist())
        if initial:
            entry.sets[key] = target
            entry.pending[key] = set()
        else:  # captured positions stay until a planned one arrives and needs the room
            entry.pending[key] = entry.target[key] - set(entry.sets[key].tolist())


def _admit(entry: Entry, key: str, passed: set[int], budget: int) -> np.ndarray:
    """Add newly captured planned positions; over budget, drop unplanned positions of least value."""
    assert entry.law is not None
    held = set(entry.sets[key].tolist()) | passed
    while len(held) > budget:
        extra = sorted(held - entry.target[key]) or sorted(held)
        idx = entry.law.indices_of(sorted(held))
        base = entry.law.cost_of_indices(idx)
        loss = [entry.law.cost_of_indices(entry.law.indices_of(sorted(held - {p}))) - base for p in extra]
        held.discard(extra[int(np.argmin(loss))])
    return np.array(sorted(held), dtype=np.int64)


def load_sequences(path: Path, limit: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input tokens, input + output tokens) per request of a JSONL trace."""
    from sglang_sparse.traces import read_trace

    out = []
    for r in read_trace(path)[:limit]:
        inp = np.asarray(r.input_tokens, dtype=np.int64)
        out.append((inp, np.concatenate([inp, np.asarray(r.output_tokens, dtype=np.int64)])))
    return out


def pareto(trace_dir: Path, traces: Sequence[str], limit: int | None, k_entries: int) -> dict:
    results: dict = {}
    for name in progress(traces, desc="traces"):
        path = trace_dir / f"{name}.jsonl"
        if not path.exists():
            raise SystemExit(
                f"error: trace {path} not found; build it with `python -m sglang_sparse.traces build {name}`"
            )
        seqs = load_sequences(path, limit)
        res = replay_last_k(seqs, k_entries=k_entries, desc=name)
        methods: dict[str, list[dict]] = {}
        for key in res.recompute:
            method, _, m = key.partition("/")
            methods.setdefault(method, []).append(
                {
                    "budget": int(m) if m else None,
                    "checkpoints_per_entry": res.checkpoints[key],
                    "reduction": res.reduction(key),
                    "recompute_tokens": res.recompute[key],
                    "worst_recompute_tokens": res.worst[key],
                }
            )
        results[name] = {"requests": len(seqs), "overlap_tokens": res.overlap_tokens, "methods": methods}
    return results


def acceptance(results: dict) -> dict:
    """DP >= every budgeted baseline at every M; checkpoints DP needs to match each block size."""
    out: dict = {}
    for name, r in results.items():
        meth = r["methods"]
        dp = {x["budget"]: x["reduction"] for x in meth["dp"]}
        dp_ck = {x["budget"]: x["checkpoints_per_entry"] for x in meth["dp"]}
        losses = []
        for b in ("block", "balanced", "log", "sqrt"):
            for x in meth[b]:
                if dp[x["budget"]] < x["reduction"] * (1 - 1e-9):
                    losses.append(
                        {"baseline": b, "budget": x["budget"], "dp": dp[x["budget"]], "it": x["reduction"]}
                    )
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
        out[name] = {"dp_loses_to": losses, "dp_vs_block": matches}
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.2), squeeze=False)
    style = {"dp": "o-", "oracle": "k:", "block": "s--", "balanced": "^--", "log": "v--", "sqrt": "d--"}
    for ax, (name, r) in zip(axes[0], results.items(), strict=True):
        for method, mk in style.items():
            xs = [x["checkpoints_per_entry"] for x in r["methods"][method]]
            ys = [x["reduction"] for x in r["methods"][method]]
            ax.plot(xs, ys, mk, label=method, ms=4)
        bx = [r["methods"][k][0]["checkpoints_per_entry"] for k in r["methods"] if k.startswith("block@")]
        by = [r["methods"][k][0]["reduction"] for k in r["methods"] if k.startswith("block@")]
        ax.plot(bx, by, "x-", color="gray", label="block@B (fixed size)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("checkpoints per cache entry")
        ax.set_ylabel("recurrent-work reduction (x)")
        ax.set_title(f"{name} ({r['requests']} requests)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_dp_time(timing: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=REPO / "traces" / "build", help="folder of built traces")
    ap.add_argument("--names", nargs="+", default=list(PARETO_TRACES), help="traces for the Pareto front")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N requests of each trace")
    ap.add_argument("--entries", type=int, default=32, help="K: the cache keeps the last K requests")
    ap.add_argument(
        "--quick", action="store_true", help="small run (CI smoke): 300 requests, no big reference DP"
    )
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args(argv)
    if args.quick and args.limit is None:
        args.limit = 300
    from ._common import results_dir

    out = results_dir(args.quick)
    results = pareto(args.traces, args.names, args.limit, args.entries)
    acc = acceptance(results)
    write_json(
        "placement",
        {
            "k_entries": args.entries,
            "limit": args.limit,
            "budgets": list(BUDGETS),
            "traces": results,
            "acceptance": acc,
        },
        out,
    )
    plot_pareto(results, out / "placement_pareto.png")
    for name, r in results.items():
        rows = []
        for i, m in enumerate(BUDGETS):
            rows.append(
                [m]
                + [
                    r["methods"][k][i]["reduction"]
                    for k in ("dp", "oracle", "block", "balanced", "log", "sqrt")
                ]
            )
        print(
            f"\n== {name}: recurrent-work reduction (x) by checkpoint budget M, last-{args.entries} entries"
        )
        print(table(rows, ["M", "dp", "oracle", "block", "balanced", "log", "sqrt"]))
        print(f"   DP loses to a baseline at: {acc[name]['dp_loses_to'] or 'nowhere'}")
        for x in acc[name]["dp_vs_block"]:
            print(
                f"   block@{x['block_size']}: {x['block_checkpoints']:.1f} ckpt/entry, reduction "
                f"{x['block_reduction']:.3g}x; DP matches with M={x['dp_budget_needed']} "
                f"(ratio {x['ratio'] if x['ratio'] is None else round(x['ratio'], 3)})"
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

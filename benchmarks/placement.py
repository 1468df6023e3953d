"""Placement benchmark: where to put checkpoints, with the cache contents held fixed.

Part 1 - Pareto front (recurrent-work reduction vs checkpoints per entry). As in the sparse prefix
caching paper, the cache keeps the last ``K`` requests (input + output tokens) as entries, so only
*placement* differs between methods. Request ``t`` overlaps entry ``e`` to depth
``LCP(input_t, e)``; it resumes from the deepest checkpoint ``c <= LCP`` over all live entries and
recomputes ``d - c`` recurrent tokens of the shared prefix, ``d`` = the deepest overlap. The
reduction factor is ``sum d / sum (d - c)`` over the trace (no-cache recompute / recompute).

Methods, each with a budget of ``M`` checkpoints per entry on the 64-token grid:
  * ``dp`` - online DP, the product's planner (``sglang_sparse.placement.online``): every entry
    keeps an EW histogram (gamma) of the overlap depths that requests had with it (seeded with the
    ``K`` requests before it, then every later request), re-planned every ``R`` observations by
    ``OnlinePlanner`` (own law + global ``DepthPrior`` + uniform hedge, DP, balanced fill); newly
    planned positions are captured only when a later request's prefill passes them
    (``passed_positions``: ``resume <= p <= LCP``), and ``admit`` makes room over budget.
  * ``block`` / ``balanced`` / ``log`` / ``sqrt`` - the budgeted baselines (placement.BASELINES).
  * ``oracle`` - the DP fed each entry's true lifetime overlap law (an upper bound).
  * ``block@B`` - block caching with a fixed block size B (its checkpoint count varies by length).

Short-prompt sets (``<name>_short``): the same replay on a variant of each Pareto trace with a
median input of ~250 tokens and the prefix sharing kept (:func:`short_prompt_variant`).
Acceptance: ``dp`` >= block, balanced, log and sqrt at every ``M`` on every set, long and short.

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

from ._common import REPO, progress, table, write_json

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
PARETO_TRACES = ("system_prompts", "doc_qa", "rag")
SHORT_MEDIAN = 250
"""Target median input (tokens) of the short-prompt sets (:func:`short_prompt_variant`)."""
SHORT_SUFFIX = "_short"
ACCEPT_BASELINES = ("block", "balanced", "log", "sqrt")
"""The budgeted baselines the online DP must match or beat at every M."""


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
    prior = DepthPrior(gamma, grid)
    planner = OnlinePlanner(grid)
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
            del entries[min(entries)]
        for key in keys:  # time average over live entries
            ck_sum[key] += sum(en.sets[key].size for en in entries.values())
        n_entries += len(entries)
    checkpoints = {k: v / max(n_entries, 1) for k, v in ck_sum.items()}
    return ReplayResult(overlap, recompute, worst, checkpoints)


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


def _replay_summary(seqs: Sequence[tuple[np.ndarray, np.ndarray]], k_entries: int, desc: str) -> dict:
    res = replay_last_k(seqs, k_entries=k_entries, desc=desc)
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
        results[name] = _replay_summary(loaded[name], k_entries, name)
    for name in progress(short_traces, desc="short-prompt sets"):
        seqs, stride = short_prompt_variant(loaded[name], short_median)
        results[f"{name}{SHORT_SUFFIX}"] = {
            "source": name,
            "stride": stride,
            **_replay_summary(seqs, k_entries, f"{name}{SHORT_SUFFIX}"),
        }
    return results


def acceptance(results: dict) -> dict:
    """Per set: where DP loses to a budgeted baseline (block, balanced, log, sqrt) at the same M
    (``dp_loses_to``; empty = the acceptance holds), the smallest ``dp / best baseline`` over M
    (``dp_min_margin``, >= 1 when it holds) and the checkpoints DP needs to match each block size."""
    out: dict = {}
    for name, r in results.items():
        meth = r["methods"]
        dp = {x["budget"]: x["reduction"] for x in meth["dp"]}
        dp_ck = {x["budget"]: x["checkpoints_per_entry"] for x in meth["dp"]}
        losses = []
        best: dict[int, float] = {}
        for b in ACCEPT_BASELINES:
            for x in meth[b]:
                best[x["budget"]] = max(best.get(x["budget"], 0.0), x["reduction"])
                if dp[x["budget"]] < x["reduction"] * (1 - 1e-9):
                    losses.append(
                        {"baseline": b, "budget": x["budget"], "dp": dp[x["budget"]], "it": x["reduction"]}
                    )
        margin = min((dp[m] / v for m, v in best.items() if v > 0), default=float("nan"))
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
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ncols = min(3, len(results))
    nrows = -(-len(results) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(results) :]:
        ax.set_visible(False)
    style = {"dp": "o-", "oracle": "k:", "block": "s--", "balanced": "^--", "log": "v--", "sqrt": "d--"}
    for ax, (name, r) in zip(axes.flat, results.items(), strict=False):
        for method, mk in style.items():
            xs = [x["checkpoints_per_entry"] for x in r["methods"][method]]
            ys = [x["reduction"] for x in r["methods"][method]]
            ax.plot(xs, ys, mk, label=method, ms=4)
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
    ap.add_argument(
        "--short-names",
        nargs="*",
        default=list(PARETO_TRACES),
        help="traces whose short-prompt variant is also replayed (none: skip)",
    )
    ap.add_argument(
        "--short-median",
        type=int,
        default=SHORT_MEDIAN,
        help="target median input of the short sets (tokens)",
    )
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
    results = pareto(args.traces, args.names, args.limit, args.entries, args.short_names, args.short_median)
    acc = acceptance(results)
    write_json(
        "placement",
        {
            "k_entries": args.entries,
            "limit": args.limit,
            "budgets": list(BUDGETS),
            "short_median_target": args.short_median,
            "traces": results,
            "acceptance": acc,
            "acceptance_holds": all(not a["dp_loses_to"] for a in acc.values()),
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
        what = f"{r['requests']} requests, median input {r['median_input_tokens']:.0f} tokens"
        if "stride" in r:
            what += f", every {r['stride']}th input token of {r['source']}"
        print(
            f"\n== {name} ({what}): recurrent-work reduction (x) by checkpoint budget M, "
            f"last-{args.entries} entries"
        )
        print(table(rows, ["M", "dp", "oracle", "block", "balanced", "log", "sqrt"]))
        print(f"   DP loses to a baseline at: {acc[name]['dp_loses_to'] or 'nowhere'}")
        for x in acc[name]["dp_vs_block"]:
            print(
                f"   block@{x['block_size']}: {x['block_checkpoints']:.1f} ckpt/entry, reduction "
                f"{x['block_reduction']:.3g}x; DP matches with M={x['dp_budget_needed']} "
                f"(ratio {x['ratio'] if x['ratio'] is None else round(x['ratio'], 3)})"
            )
    holds = all(not a["dp_loses_to"] for a in acc.values())
    print(
        "\n== acceptance (online DP >= block, balanced, log, sqrt at every M): "
        + ("holds on every set" if holds else "FAILS")
        + "; min dp / best baseline: "
        + ", ".join(f"{n} {a['dp_min_margin']:.4f}" for n, a in acc.items())
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

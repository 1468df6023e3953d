"""Cache-size sweeps of every policy on the benchmark traces: hit rate, FLOPs saved, recompute.

Cache sizes are fractions of the trace's infinite-cache KV footprint (unique cached tokens x KV
bytes per token). Writes ``benchmarks/results/sim_compare.json`` and one PNG per trace (token hit
rate and FLOPs saved vs cache size per policy) and prints a table. Needs the built traces
(``python -m sglang_sparse.traces build all``); ``--synthetic`` uses small generated traces instead;
``--trace FILE`` (repeatable) replays any trace file (named by its file stem).

The policies are the registry's cache policies plus the published baselines of the Marconi paper
(``sglang_plus_published``, ``marconi_published``, ``vllm_plus_published``; see
``sglang_sparse.sim.published_caches``), which keep the reference simulator's soft cap: their
``max_bytes_used`` can exceed the cache size, and ``offline`` (``sglang_sparse.sim.offline``): a
reference that knows the future, within the budget. Every row carries its share of the headroom
bound (an upper bound) and of ``offline`` (a reachable schedule): ``sparse / offline`` says how much
of what a policy with future knowledge gets an online policy already gets.

    python benchmarks/sim_compare.py [--quick] [--traces doc_qa system_prompts agent] [--policies ...]
    python benchmarks/sim_compare.py --trace my_trace.jsonl [--trace other.jsonl] [--fracs 0.1 0.3]
    python benchmarks/sim_compare.py --host-ratio 2 --host-ratio 4   # device + host tier (HiCache)

``--host-ratio R`` (repeatable) runs the two-tier sweep instead (``benchmarks/sim_host.py``): host
bytes = R x device bytes, registry policies only, ``sglang_native`` = SGLang's own HiCache;
``--write-policy``, ``--load-bandwidth`` and ``--device-flops`` set the host tier's model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import REPO, bar, pyplot, results_dir, save, table  # noqa: E402
from benchmarks.sim_host import HOST_POLICIES, host_sweep  # noqa: E402
from sglang_sparse.policy import POLICY_NAMES, PUBLISHED_NAMES  # noqa: E402
from sglang_sparse.policy.host_tier import (  # noqa: E402
    DEFAULT_DEVICE_FLOPS,
    DEFAULT_LOAD_BANDWIDTH,
    WRITE_POLICIES,
)
from sglang_sparse.sim import (  # noqa: E402
    OFFLINE_POLICIES,
    SHAPES,
    FutureIndex,
    OracleLaw,
    cost_model,
    load_trace,
    simulate,
    synthetic_trace,
)
from sglang_sparse.sim.bound import headroom_bound, reuse_profile  # noqa: E402

FULL_FRACS = (0.05, 0.1, 0.2, 0.3, 0.5)
QUICK_FRACS = (0.1, 0.3)
DEFAULT_TRACES = ("doc_qa", "system_prompts", "agent", "rag")
DEFAULT_POLICIES = tuple(POLICY_NAMES) + PUBLISHED_NAMES + OFFLINE_POLICIES
#: the headroom bound's figures recorded per size
BOUND_KEYS = (
    "hit_tokens",
    "flops_saved",
    "token_hit_rate",
    "flops_saved_frac",
    "cap_tokens",
    "per_request_hit_rate",
)
#: reference policies with knowledge of the whole trace: never a loss of ``sparse``
REFERENCES = ("oracle", *OFFLINE_POLICIES)


def trace_sources(names: list[str] | None, files: list[str] | None) -> list[tuple[str, Path]]:
    """``(name, path)`` per trace: built traces by name (``traces/build/<name>.jsonl``) then files
    (named by their stem, ``-2``, ``-3``... on repeats). Without either, the default built traces."""
    if names is None and not files:
        names = list(DEFAULT_TRACES)
    out = [(n, REPO / "traces" / "build" / f"{n}.jsonl") for n in names or []]
    for f in files or []:
        p = Path(f)
        name, k = p.stem, 1
        while any(name == n for n, _ in out):
            k += 1
            name = f"{p.stem}-{k}"
        out.append((name, p))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two cache sizes only")
    ap.add_argument(
        "--traces", nargs="+", default=None, help=f"built trace names (default {' '.join(DEFAULT_TRACES)})"
    )
    ap.add_argument(
        "--trace", action="append", default=None, metavar="FILE", help="a trace file (JSONL), repeatable"
    )
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    ap.add_argument("--fracs", nargs="+", type=float, default=None)
    ap.add_argument("--model", default="qwen3-next-80b-a3b")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results[/quick])")
    ap.add_argument("--synthetic", action="store_true", help="small generated traces (no data needed)")
    ap.add_argument(
        "--host-ratio",
        action="append",
        type=float,
        default=None,
        metavar="R",
        help="two-tier sweep: a host tier of R x the device size (repeatable; writes sim_compare_host.json)",
    )
    ap.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_back",
        help="host tier: write_back (the device demotes what it evicts; default) or write_through (the "
        "host holds a copy of everything)",
    )
    ap.add_argument(
        "--load-bandwidth",
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help=f"host-to-device copy bandwidth (default {DEFAULT_LOAD_BANDWIDTH:.3g} B/s, PCIe Gen4 x16)",
    )
    ap.add_argument(
        "--device-flops",
        type=float,
        default=None,
        metavar="FLOP_PER_S",
        help=f"prefill throughput that converts a load into FLOPs (default {DEFAULT_DEVICE_FLOPS:.3g})",
    )
    args = ap.parse_args(argv)
    fracs = tuple(args.fracs) if args.fracs else (QUICK_FRACS if args.quick else FULL_FRACS)
    cm = cost_model(args.model)
    out = Path(args.out) if args.out else results_dir(args.quick)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"model": args.model, "fracs": fracs, "traces": {}}
    if args.synthetic and args.traces is None and not args.trace:
        args.traces = [t for t in DEFAULT_TRACES if t in SHAPES]  # the shapes that can be generated
    if args.synthetic:
        unknown = [t for t in args.traces or [] if t not in SHAPES]
        if unknown:
            raise SystemExit(
                f"error: no synthetic shape {', '.join(unknown)}; --synthetic takes {', '.join(SHAPES)}"
            )
    sources = trace_sources(args.traces, args.trace)
    if args.host_ratio:
        policies = [p for p in args.policies if p in HOST_POLICIES]
        if args.policies != list(DEFAULT_POLICIES):
            policies = args.policies  # named explicitly: host_sweep rejects those without a host model
        loaders = [(t, lambda t=t, p=p: _load(t, p, args, cm)) for t, p in sources]
        host_sweep(
            loaders,
            policies,
            fracs,
            args.host_ratio,
            cm,
            out,
            write_policy=args.write_policy,
            load_bandwidth=args.load_bandwidth,
            device_flops=args.device_flops,
        )
        return 0
    jobs = [(t, f, p) for t, _ in sources for f in fracs for p in args.policies]
    progress = bar(len(jobs), "sim_compare")
    for tname, path in sources:
        reqs, oracle, footprint = _load(tname, path, args, cm)
        profile = reuse_profile(reqs)
        future = FutureIndex(reqs) if any(p in OFFLINE_POLICIES for p in args.policies) else None
        rows = []
        bounds = []
        for frac in fracs:
            size = int(footprint * frac)
            if size < cm.state_bytes:
                raise SystemExit(
                    f"error: {tname}: cache size {frac} x footprint = {size} bytes is smaller than one "
                    f"recurrent state ({cm.state_bytes} bytes); pass larger --fracs"
                )
            hb = headroom_bound(reqs, size, cm, profile)
            bounds.append({"frac": frac, "cache_bytes": size, **{k: getattr(hb, k) for k in BOUND_KEYS}})
            for pol in args.policies:
                t0 = time.perf_counter()
                extra = {"future": future} if pol in OFFLINE_POLICIES else {}
                r = simulate(reqs, pol, size, cm, oracle=oracle, keep_records=False, **extra)
                s = r.summary()
                s.update(
                    frac=frac,
                    seconds=time.perf_counter() - t0,
                    source="synthetic" if args.synthetic else str(path),
                    over_budget=s["max_bytes_used"] / size if size and s["max_bytes_used"] > size else None,
                    headroom_share_hit=_share(s["hit_tokens"], hb.hit_tokens),
                    headroom_share_flops=_share(s["flops_saved"], hb.flops_saved),
                )
                rows.append(s)
                progress.update(1)
            _offline_shares([r for r in rows if r["frac"] == frac])
        _equal_memory(
            rows,
            lambda b, reqs=reqs, oracle=oracle: simulate(
                reqs, "sparse", b, cm, oracle=oracle, keep_records=False
            ),
        )
        results["traces"][tname] = {
            "footprint_bytes": footprint,
            "requests": len(reqs),
            "rows": rows,
            "headroom": bounds,
        }
        _plot(tname, rows, bounds, args.policies, out)
    progress.close()
    results["acceptance"] = _acceptance(results)
    (out / "sim_compare.json").write_text(json.dumps(results, indent=1))
    _table(results, args.policies)
    _headroom_table(results, args.policies)
    _offline_table(results)
    _print_acceptance(results["acceptance"])
    return 0


def _load(tname: str, path: Path, args: argparse.Namespace, cm) -> tuple[list, OracleLaw, int]:
    """``(requests, oracle law, KV footprint in bytes)`` of one trace; exits with a clear message when
    the trace is missing or empty."""
    if args.synthetic:
        reqs = synthetic_trace(tname, 300, seed=0)
    elif path.exists():
        reqs = load_trace(path)
    elif args.trace and str(path) in args.trace:
        raise SystemExit(f"error: trace file {path} not found")
    else:
        raise SystemExit(f"error: {path} not found; run `python -m sglang_sparse.traces build {tname}`")
    if not reqs:
        raise SystemExit(f"error: trace {path} holds no requests")
    oracle = OracleLaw(reqs)
    return reqs, oracle, oracle.inf.kv_tokens * cm.kv_bytes_per_token


def _equal_memory(rows: list[dict], run_sparse) -> None:
    """For each over-budget row (a soft-cap policy whose memory exceeded the cache size) that beats
    ``sparse`` at the same nominal size, replay ``sparse`` with the memory that policy really used
    (``max_bytes_used``) and store the result in the row as ``sparse_at_equal_memory``: the fair
    comparison. ``run_sparse(cache_bytes)`` returns a simulation result."""
    sparse = {r["frac"]: r for r in rows if r["policy"] == "sparse"}
    for r in rows:
        sp = sparse.get(r["frac"])
        if sp is None or not r.get("over_budget"):
            continue
        if r["token_hit_rate"] <= sp["token_hit_rate"] and r["flops_saved_frac"] <= sp["flops_saved_frac"]:
            continue
        res = run_sparse(int(r["max_bytes_used"])).summary()
        r["sparse_at_equal_memory"] = {
            "cache_bytes": res["cache_bytes"],
            "token_hit_rate": res["token_hit_rate"],
            "flops_saved_frac": res["flops_saved_frac"],
        }


def _offline_shares(rows: list[dict]) -> None:
    """Each row's share of ``offline`` at the same size (``offline_share_hit`` / ``_flops``: the
    row's hit tokens / FLOPs saved over offline's; ``None`` without an offline row or when offline
    got nothing)."""
    off = next((r for r in rows if r["policy"] == "offline"), None)
    for r in rows:
        r["offline_share_hit"] = _share(r["hit_tokens"], off["hit_tokens"]) if off else None
        r["offline_share_flops"] = _share(r["flops_saved"], off["flops_saved"]) if off else None


def _share(x: float, bound: float) -> float | None:
    """``x / bound`` (share of the headroom bound), ``None`` when the bound is 0."""
    return x / bound if bound else None


def _acceptance(results: dict) -> dict:
    """``sparse`` vs every other policy (the references ``oracle`` and ``offline`` aside) at every
    size: token hit rate and FLOPs saved. A policy whose ``max_bytes_used`` exceeded the cache size
    (the published soft caps) is compared too but flagged ``over_budget`` (its memory / the cache
    size): it did not run in the same memory, so a loss to it is reported apart
    (``losses_over_budget``), not as a loss at equal memory (``losses``). Also the better of
    marconi/lru (the paper's comparison), recomputed recurrent tokens vs the oracle, and sparse's
    share of ``offline``."""
    out = {}
    for tname, tr in results["traces"].items():
        by = {(r["frac"], r["policy"]): r for r in tr["rows"]}
        head = {h["frac"]: h for h in tr.get("headroom", [])}
        rows = []
        for frac in results["fracs"]:
            if (frac, "sparse") not in by:
                continue
            sp = by[(frac, "sparse")]
            others = [r for (f, p), r in by.items() if f == frac and p != "sparse" and p not in REFERENCES]
            losses, losses_over = [], []
            for o in others:
                better_hit = o["token_hit_rate"] > sp["token_hit_rate"]
                if better_hit or o["flops_saved_frac"] > sp["flops_saved_frac"]:
                    item = {
                        "policy": o["policy"],
                        "hit": o["token_hit_rate"],
                        "flops": o["flops_saved_frac"],
                        "over_budget": o.get("over_budget"),
                    }
                    eq = o.get("sparse_at_equal_memory")
                    if eq:
                        item["sparse_at_equal_memory"] = eq
                        item["sparse_ge_at_equal_memory"] = (
                            eq["token_hit_rate"] >= o["token_hit_rate"]
                            and eq["flops_saved_frac"] >= o["flops_saved_frac"]
                        )
                    (losses_over if o.get("over_budget") else losses).append(item)
            row = {
                "frac": frac,
                "sparse_hit": sp["token_hit_rate"],
                "sparse_flops": sp["flops_saved_frac"],
                "compared": sorted(o["policy"] for o in others),
                "losses": losses,
                "losses_over_budget": losses_over,
                "sparse_ge_all_in_budget": not losses,
            }
            if frac in head:
                row["headroom_hit"] = head[frac]["token_hit_rate"]
                row["headroom_flops"] = head[frac]["flops_saved_frac"]
                row["sparse_share_of_headroom_hit"] = sp.get("headroom_share_hit")
                row["sparse_share_of_headroom_flops"] = sp.get("headroom_share_flops")
            if (frac, "offline") in by:
                off = by[(frac, "offline")]
                row["offline_hit"] = off["token_hit_rate"]
                row["offline_flops"] = off["flops_saved_frac"]
                row["sparse_share_of_offline_hit"] = sp.get("offline_share_hit")
                row["sparse_share_of_offline_flops"] = sp.get("offline_share_flops")
                if frac in head:
                    row["offline_share_of_headroom_hit"] = off.get("headroom_share_hit")
            if (frac, "marconi") in by and (frac, "lru") in by:
                mc, lr = by[(frac, "marconi")], by[(frac, "lru")]
                best_hit = max(mc["token_hit_rate"], lr["token_hit_rate"])
                best_flops = max(mc["flops_saved_frac"], lr["flops_saved_frac"])
                row.update(
                    best_baseline_hit=best_hit,
                    hit_gain=sp["token_hit_rate"] / best_hit - 1 if best_hit else None,
                    best_baseline_flops=best_flops,
                    flops_gain=sp["flops_saved_frac"] / best_flops - 1 if best_flops else None,
                    sparse_ge_baselines=sp["token_hit_rate"] >= best_hit
                    and sp["flops_saved_frac"] >= best_flops,
                )
            if (frac, "oracle") in by:
                orc = by[(frac, "oracle")]
                row["recomputed_sparse"] = sp["recomputed_tokens"]
                row["recomputed_oracle"] = orc["recomputed_tokens"]
                row["recomputed_vs_oracle"] = (
                    sp["recomputed_tokens"] / orc["recomputed_tokens"] - 1
                    if orc["recomputed_tokens"]
                    else None
                )
            rows.append(row)
        out[tname] = rows
    return out


def _print_acceptance(acc: dict) -> None:
    print(
        "\n== sparse vs every other policy at every size (token hit rate, FLOPs saved); "
        "gain over the better of marconi/lru; share of the headroom bound and of offline"
    )
    for tname, rows in acc.items():
        for r in rows:
            ok = "ok " if r["sparse_ge_all_in_budget"] else "LOSS"
            g = "" if r.get("hit_gain") is None else f" vs marconi/lru {r['hit_gain']:+.0%}"
            h = r.get("sparse_share_of_headroom_hit")
            h = "" if h is None else f", {h:.0%} of headroom"
            so = r.get("sparse_share_of_offline_hit")
            h += "" if so is None else f", {so:.0%} of offline"
            o = r.get("recomputed_vs_oracle")
            o = "" if o is None else f", recomputed vs oracle {o:+.1%}"
            lost = ", ".join(f"{x['policy']} {x['hit']:.3f}" for x in r["losses"])
            over = ", ".join(
                f"{x['policy']} {x['hit']:.3f} using {x['over_budget']:.0f}x the cache"
                + (
                    f" (sparse with that memory: {x['sparse_at_equal_memory']['token_hit_rate']:.3f})"
                    if "sparse_at_equal_memory" in x
                    else ""
                )
                for x in r["losses_over_budget"]
            )
            print(
                f"  {ok} {tname:15} {r['frac']:4}: hit {r['sparse_hit']:.3f} flops "
                f"{r['sparse_flops']:.3f}{g}{h}{o}"
                + (f"; loses to {lost}" if lost else "")
                + (f"; below over-budget {over}" if over else "")
            )


def _plot(tname: str, rows: list[dict], bounds: list[dict], policies: list[str], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for pol in policies:
        rs = [r for r in rows if r["policy"] == pol]
        x = [r["cache_bytes"] / 2**30 for r in rs]
        style: dict = {"color": "k", "linestyle": ":", "marker": "s"} if pol in OFFLINE_POLICIES else {}
        name = f"{pol} (future knowledge)" if pol in OFFLINE_POLICIES else pol
        axes[0].plot(x, [r["token_hit_rate"] for r in rs], label=name, **{"marker": "o", **style})
        axes[1].plot(x, [r["flops_saved_frac"] for r in rs], label=name, **{"marker": "o", **style})
    if bounds:
        x = [b["cache_bytes"] / 2**30 for b in bounds]
        axes[0].plot(x, [b["token_hit_rate"] for b in bounds], "k--", label="headroom bound")
        axes[1].plot(x, [b["flops_saved_frac"] for b in bounds], "k--", label="headroom bound")
    for ax, yl in zip(axes, ("token hit rate (resumable)", "FLOPs saved (fraction of prefill)"), strict=True):
        ax.set_xlabel("cache size (GiB)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{tname}")
    save(fig, out / f"sim_compare_{tname}.png")


def _table(results: dict, policies: list[str]) -> None:
    for tname, tr in results["traces"].items():
        print(f"\n== {tname} ({tr['requests']} requests, footprint {tr['footprint_bytes'] / 2**30:.1f} GiB)")
        rows = []
        for frac in results["fracs"]:
            rs = {r["policy"]: r for r in tr["rows"] if r["frac"] == frac}
            size = next(iter(rs.values()))["cache_bytes"] / 2**30
            cells = [
                f"{rs[p]['token_hit_rate']:.3f}/{rs[p]['flops_saved_frac']:.3f}/"
                f"{rs[p]['recomputed_tokens'] / 1e3:.0f}k"
                for p in policies
            ]
            rows.append([f"{size:.1f}", *cells])
        print(table(rows, ["size GiB", *policies]))
    print("\ncells: token hit rate / FLOPs saved fraction / recomputed recurrent tokens")


def _headroom_table(results: dict, policies: list[str]) -> None:
    """Each policy's share of the headroom bound (hit tokens, FLOPs saved) per trace and size."""
    for tname, tr in results["traces"].items():
        head = {h["frac"]: h for h in tr.get("headroom", [])}
        if not head:
            continue
        print(f"\n== {tname}: share of the headroom bound (hit tokens / FLOPs saved)")
        rows = []
        for frac in results["fracs"]:
            rs = {r["policy"]: r for r in tr["rows"] if r["frac"] == frac}
            rows.append([str(frac), f"{head[frac]['token_hit_rate']:.3f}"])
            for p in policies:
                a, b = rs[p].get("headroom_share_hit"), rs[p].get("headroom_share_flops")
                star = "*" if rs[p].get("over_budget") else ""
                rows[-1].append("-" if a is None else f"{a:.0%}/{b:.0%}{star}")
        print(table(rows, ["frac", "bound hit", *policies]))
    print("* over budget: the policy's memory exceeded the cache size (published soft cap)")


def _offline_table(results: dict) -> None:
    """Per trace and size: the headroom bound, offline, sparse, sglang_native (token hit rates) and
    sparse's share of offline beside its share of the bound."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    for tname, tr in results["traces"].items():
        head = {h["frac"]: h for h in tr.get("headroom", [])}
        by = {(r["frac"], r["policy"]): r for r in tr["rows"]}
        if not any(p == "offline" for _, p in by):
            continue
        print(f"\n== {tname}: sparse vs offline (token hit rate; offline = future knowledge, same budget)")
        cols = "frac bound offline sparse sglang_native sparse/offline sparse/bound offline/bound".split()
        rows = []
        for frac in results["fracs"]:
            hit = {p: by.get((frac, p)) for p in ("offline", "sparse", "sglang_native")}
            sp, off = hit["sparse"] or {}, hit["offline"] or {}
            cells = [
                f"{head[frac]['token_hit_rate']:.3f}" if frac in head else "-",
                *("-" if r is None else f"{r['token_hit_rate']:.3f}" for r in hit.values()),
                pct(sp.get("offline_share_hit")),
                pct(sp.get("headroom_share_hit")),
                pct(off.get("headroom_share_hit")),
            ]
            rows.append([str(frac), *cells])
        print(table(rows, cols))


if __name__ == "__main__":
    raise SystemExit(main())

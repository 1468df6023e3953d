"""Two-tier sweeps (device + host, SGLang's HiCache): ``python benchmarks/sim_compare.py --host-ratio R``.

For every trace, device size (a fraction of the trace's KV footprint) and host ratio ``R`` (host
bytes = R x device bytes, SGLang's ``--hicache-ratio``), every registry policy replays with a host
tier (``sglang_sparse.sim.host_tier``: the policy runs on the logical two-tier cache, the device
holds its most recently used part, a request resumes no deeper than fits in the device and pays for
what it loads). ``sglang_native`` with a host tier is SGLang's own HiCache on a hybrid model (LRU
demotion to the host, LRU drop from the host). The published baselines and ``offline`` have no
host-tier model and are left out.

Writes ``sim_compare_host.json`` (rows, acceptance) and ``sim_compare_host_<trace>.png`` next to
``sim_compare.json``, and prints per trace: token hit rate / net FLOPs saved (FLOPs saved minus
the loads' device time) / GiB loaded, per policy, plus sparse's single-tier figure at the same
device size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks._common import bar, pyplot, save, table
from sglang_sparse.policy import POLICY_NAMES
from sglang_sparse.policy.host_tier import HostTierConfig
from sglang_sparse.sim import simulate

#: policies with a host-tier model (the registry's)
HOST_POLICIES = POLICY_NAMES
#: references that know the whole trace (``oracle``'s per-edge law): reported, never a loss
REFERENCES = ("oracle",)


def host_sweep(
    traces: Sequence[tuple[str, Callable[[], tuple[list, object, int]]]],
    policies: Sequence[str],
    fracs: Sequence[float],
    ratios: Sequence[float],
    cm,
    out: Path,
    *,
    write_policy: str = "write_back",
    load_bandwidth: float | None = None,
    device_flops: float | None = None,
) -> dict:
    """Run the sweep; ``traces`` yields ``(name, load)`` with ``load() -> (requests, oracle,
    footprint bytes)``. Returns (and writes) the results dict."""
    bad = [p for p in policies if p not in HOST_POLICIES]
    if bad:
        raise SystemExit(
            f"error: no host-tier model for {', '.join(bad)}; --host-ratio takes {', '.join(HOST_POLICIES)}"
        )
    if any(r <= 0 for r in ratios):
        raise SystemExit(f"error: --host-ratio must be > 0, got {list(ratios)}")
    given = {"load_bandwidth": load_bandwidth, "device_flops": device_flops}
    extra = {k: v for k, v in given.items() if v is not None}
    unit = HostTierConfig(1, write_policy=write_policy, **extra)
    results: dict = {
        "fracs": list(fracs),
        "host_ratios": list(ratios),
        "write_policy": write_policy,
        "load_bandwidth": unit.load_bandwidth,
        "device_flops": unit.device_flops,
        "traces": {},
    }
    progress = bar(len(traces) * len(fracs) * (len(ratios) * len(policies) + 1), "sim_compare --host-ratio")
    for tname, load in traces:
        reqs, oracle, footprint = load()
        rows = []
        for frac in fracs:
            size = int(footprint * frac)
            one = simulate(reqs, "sparse", size, cm, oracle=oracle, keep_records=False).summary()
            rows.append({**_row(one), "frac": frac, "host_ratio": 0.0, "policy": "sparse (no host)"})
            progress.update(1)
            for ratio in ratios:
                host = HostTierConfig(int(size * ratio), write_policy=write_policy, **extra)
                for pol in policies:
                    r = simulate(reqs, pol, size, cm, oracle=oracle, keep_records=False, host=host)
                    rows.append({**_row(r.summary()), "frac": frac, "host_ratio": ratio})
                    progress.update(1)
        results["traces"][tname] = {"footprint_bytes": footprint, "requests": len(reqs), "rows": rows}
        _plot(tname, rows, policies, ratios, out)
    progress.close()
    results["acceptance"] = acceptance(results)
    (out / "sim_compare_host.json").write_text(json.dumps(results, indent=1))
    print_tables(results, policies)
    return results


def _row(s: dict) -> dict:
    keep = (
        "policy",
        "cache_bytes",
        "host_bytes",
        "token_hit_rate",
        "flops_saved_frac",
        "net_flops_saved_frac",
        "load_bytes",
        "host_hit_tokens",
        "hit_tokens",
        "input_tokens",
        "alphas",
    )
    row = {k: s[k] for k in keep if k in s}
    row.setdefault("net_flops_saved_frac", s["flops_saved_frac"])
    return row


def acceptance(results: dict) -> dict:
    """Per trace, device size and host ratio: sparse against every other policy (``oracle`` aside) on
    token hit rate and net FLOPs saved; ``sparse_ge_all`` when no policy beats it on either, and
    whether the host tier helps sparse at all (``beats_no_host``: more hit tokens than sparse
    without a host)."""
    out = {}
    for tname, tr in results["traces"].items():
        by = {(r["frac"], r["host_ratio"], r["policy"]): r for r in tr["rows"]}
        rows = []
        for frac in results["fracs"]:
            base = by.get((frac, 0.0, "sparse (no host)"))
            for ratio in results["host_ratios"]:
                sp = by.get((frac, ratio, "sparse"))
                if sp is None:
                    continue
                losses = [
                    {"policy": p, "hit": r["token_hit_rate"], "net_flops": r["net_flops_saved_frac"]}
                    for (f, q, p), r in by.items()
                    if f == frac
                    and q == ratio
                    and p != "sparse"
                    and p not in REFERENCES
                    and (
                        r["token_hit_rate"] > sp["token_hit_rate"]
                        or r["net_flops_saved_frac"] > sp["net_flops_saved_frac"]
                    )
                ]
                native = by.get((frac, ratio, "sglang_native"))
                rows.append(
                    {
                        "frac": frac,
                        "host_ratio": ratio,
                        "sparse_hit": sp["token_hit_rate"],
                        "sparse_net_flops": sp["net_flops_saved_frac"],
                        "native_hicache_hit": native["token_hit_rate"] if native else None,
                        "sparse_no_host_hit": base["token_hit_rate"] if base else None,
                        "beats_no_host": bool(base) and sp["hit_tokens"] > base["hit_tokens"],
                        "losses": losses,
                        "sparse_ge_all": not losses,
                    }
                )
        out[tname] = rows
    return out


def print_tables(results: dict, policies: Sequence[str]) -> None:
    for tname, tr in results["traces"].items():
        print(
            f"\n== {tname} with a host tier ({results['write_policy']}; cells: token hit rate / net FLOPs "
            "saved / GiB loaded)"
        )
        by = {(r["frac"], r["host_ratio"], r["policy"]): r for r in tr["rows"]}
        rows = []
        for frac in results["fracs"]:
            base = by[(frac, 0.0, "sparse (no host)")]
            for ratio in results["host_ratios"]:
                rows.append([str(frac), f"{ratio:g}", f"{base['token_hit_rate']:.3f}"])
                for p in policies:
                    r = by[(frac, ratio, p)]
                    gib = r["load_bytes"] / 2**30
                    rows[-1].append(f"{r['token_hit_rate']:.3f}/{r['net_flops_saved_frac']:.3f}/{gib:.0f}")
        print(table(rows, ["frac", "R", "sparse no host", *policies]))
    print("\n== sparse vs every policy with a host tier (token hit rate and net FLOPs saved)")
    for tname, rows in results["acceptance"].items():
        for r in rows:
            ok = "ok " if r["sparse_ge_all"] else "LOSS"
            lost = ", ".join(f"{x['policy']} {x['hit']:.3f}/{x['net_flops']:.3f}" for x in r["losses"])
            native = r["native_hicache_hit"]
            print(
                f"  {ok} {tname:15} {r['frac']:4} R={r['host_ratio']:g}: sparse {r['sparse_hit']:.3f}/"
                f"{r['sparse_net_flops']:.3f}"
                + ("" if native is None else f", native HiCache {native:.3f}")
                + f", sparse without host {r['sparse_no_host_hit']:.3f}"
                + (f"; loses to {lost}" if lost else "")
            )


def _plot(tname: str, rows: list[dict], policies: Sequence[str], ratios: Sequence[float], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(ratios), 2, figsize=(11, 3.6 * len(ratios)), squeeze=False)
    base = [r for r in rows if r["policy"] == "sparse (no host)"]
    for i, ratio in enumerate(ratios):
        for pol in policies:
            rs = [r for r in rows if r["policy"] == pol and r["host_ratio"] == ratio]
            x = [r["cache_bytes"] / 2**30 for r in rs]
            axes[i][0].plot(x, [r["token_hit_rate"] for r in rs], marker="o", label=pol)
            axes[i][1].plot(x, [r["net_flops_saved_frac"] for r in rs], marker="o", label=pol)
        x = [r["cache_bytes"] / 2**30 for r in base]
        axes[i][0].plot(x, [r["token_hit_rate"] for r in base], "k:", label="sparse, no host")
        axes[i][1].plot(x, [r["net_flops_saved_frac"] for r in base], "k:", label="sparse, no host")
        axes[i][0].set_ylabel(f"host = {ratio:g} x device\ntoken hit rate")
        axes[i][1].set_ylabel("net FLOPs saved (minus loads)")
        for ax in axes[i]:
            ax.set_xlabel("device cache size (GiB)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{tname}: device + host tier")
    save(fig, out / f"sim_compare_host_{tname}.png")

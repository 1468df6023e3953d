"""Benchmark: chunked torch GDN forward with / without boundary-state capture, vs the naive recurrence.

For each sequence length T it times (min and median of ``--repeats`` interleaved runs, CPU, float32):

* ``chunk``          -- :func:`chunk_gdn_fwd_capture` with ``capture_chunks=None``;
* ``chunk+sparse``   -- capturing every ``--sparse-every``-th chunk boundary (the prefix-cache use case);
* ``chunk+all``      -- capturing every chunk boundary (worst case);
* ``naive``          -- :func:`naive_recurrent_gdn` (one run; skipped above ``--naive-max-t`` or when its
  run time, projected from the previous T, would push the total past ``--budget-s``),

and records max abs errors of the chunked path against the naive one (output, final state, states at the
sparse boundaries).  Prints a table and writes ``benchmarks/results/gdn_capture.json``.

Default head config is a quarter of a Qwen3-Next GatedDeltaNet layer: ``H=4`` qk heads, ``HV=8`` value
heads, ``K=V=128``, batch 1.  Runs single-threaded by default (``--threads``), which is
both faster and far more stable than 2 threads on a shared 2-core machine.  Runtime with defaults is
well under a minute when the machine is idle.

Usage: ``python benchmarks/gdn_capture.py [--ts 1024 4096 16384] [--repeats 5] [--naive-max-t 16384]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sglang_sparse_kernels.gdn_capture import chunk_gdn_fwd_capture, naive_recurrent_gdn  # noqa: E402

CHUNK = 64


def make_inputs(T: int, H: int, HV: int, K: int, V: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs in the regime of a trained GDN layer: unit-norm k, g = logsigmoid(.), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen) + 3.0)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = 0.1 * torch.randn(1, HV, K, V, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


def timed_interleaved(
    fns: dict[str, object], repeats: int
) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Wall times (seconds) of each callable over ``repeats`` rounds, after one warm-up round.

    Calls are interleaved round-robin so that load from other processes on a shared machine hits every
    variant alike; report ``min`` (closest to the intrinsic cost) and ``median``.
    """
    last = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            last[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return times, last


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--heads", type=int, nargs=4, default=[4, 8, 128, 128], metavar=("H", "HV", "K", "V"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sparse-every", type=int, default=8, help="capture every N-th chunk boundary")
    ap.add_argument("--naive-max-t", type=int, default=16384, help="skip the naive reference above this T")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core box, 2 spinning OpenMP threads made "
        "the small per-token ops of the naive loop up to 100x slower under load)",
    )
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip naive runs projected past this")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gdn_capture.json")
    args = ap.parse_args(argv)
    H, HV, K, V = args.heads
    torch.set_num_threads(args.threads)
    rows = []
    naive_rate: float | None = None  # seconds per token of the last naive run, for the budget guard
    t_start = time.perf_counter()
    for T in args.ts:
        x = make_inputs(T, H, HV, K, V, seed=T)
        n_bound = T // CHUNK
        sparse = list(range(0, n_bound + 1, args.sparse_every))
        every = list(range(n_bound + 1))
        times, last = timed_interleaved(
            {
                "plain": lambda x=x: chunk_gdn_fwd_capture(**x),
                "sparse": lambda x=x, s=sparse: chunk_gdn_fwd_capture(**x, capture_chunks=s),
                "all": lambda x=x, e=every: chunk_gdn_fwd_capture(**x, capture_chunks=e),
            },
            args.repeats,
        )
        t_plain, t_sparse, t_all = (min(times[n]) for n in ("plain", "sparse", "all"))
        res_sparse = last["sparse"]
        row = {
            "T": T,
            "chunk_s": t_plain,
            "chunk_sparse_s": t_sparse,
            "chunk_all_s": t_all,
            "chunk_median_s": statistics.median(times["plain"]),
            "chunk_sparse_median_s": statistics.median(times["sparse"]),
            "chunk_all_median_s": statistics.median(times["all"]),
            "n_sparse": len(sparse),
            "n_all": len(every),
            "overhead_sparse_pct": 100.0 * (t_sparse / t_plain - 1.0),
            "overhead_all_pct": 100.0 * (t_all / t_plain - 1.0),
            "naive_s": None,
            "naive_note": None,
            "speedup_vs_naive": None,
            "err_o": None,
            "err_final": None,
            "err_states": None,
            "ref_o_absmax": None,
        }
        elapsed = time.perf_counter() - t_start
        projected = None if naive_rate is None else naive_rate * T
        if T > args.naive_max_t:
            row["naive_note"] = f"skipped: T > --naive-max-t {args.naive_max_t}"
        elif projected is not None and elapsed + projected > args.budget_s:
            row["naive_note"] = (
                f"skipped: projected {projected:.0f} s would exceed --budget-s {args.budget_s:.0f} "
                f"(machine busy?); rerun with a larger budget"
            )
        else:
            t0 = time.perf_counter()
            o_ref, s_ref, c_ref = naive_recurrent_gdn(**x, capture_positions=[c * CHUNK for c in sparse])
            row["naive_s"] = time.perf_counter() - t0
            naive_rate = row["naive_s"] / T
            o, s, c = res_sparse
            row.update(
                speedup_vs_naive=row["naive_s"] / t_plain,
                err_o=max_err(o, o_ref),
                err_final=max_err(s, s_ref),
                err_states=max_err(c, c_ref),
                ref_o_absmax=float(o_ref.abs().max()),
            )
        rows.append(row)

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    hdr = (
        f"{'T':>6} {'chunk s':>8} {'+sparse s':>9} {'ovh %':>6} {'+all s':>7} {'ovh %':>6} "
        f"{'naive s':>8} {'speedup':>7} {'err o':>9} {'err S_T':>9} {'err caps':>9}"
    )
    print(
        f"GDN chunk forward with state capture  (B=1, H={H}, HV={HV}, K={K}, V={V}, fp32, chunk {CHUNK}, "
        f"sparse = every {args.sparse_every} chunks, torch threads {torch.get_num_threads()})"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['T']:>6} {r['chunk_s']:>8.3f} {r['chunk_sparse_s']:>9.3f} {r['overhead_sparse_pct']:>6.1f} "
            f"{r['chunk_all_s']:>7.3f} {r['overhead_all_pct']:>6.1f} {f(r['naive_s'], '8.2f'):>8} "
            f"{f(r['speedup_vs_naive'], '7.1f'):>7} {f(r['err_o'], '9.2e'):>9} "
            f"{f(r['err_final'], '9.2e'):>9} {f(r['err_states'], '9.2e'):>9}"
        )
        if r["naive_note"]:
            print(f"       naive {r['naive_note']}")
    print("times: min over interleaved repeats; ovh % = capture overhead vs chunk without capture")
    result = {
        "benchmark": "gdn_capture",
        "config": {
            "B": 1,
            "H": H,
            "HV": HV,
            "K": K,
            "V": V,
            "dtype": "float32",
            "chunk_size": CHUNK,
            "sparse_every": args.sparse_every,
            "repeats": args.repeats,
            "timing": "min wall seconds over interleaved repeats (medians in *_median_s)",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "rows": rows,
        "total_runtime_s": time.perf_counter() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}  (total {result['total_runtime_s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()

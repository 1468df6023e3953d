"""CPU prefill time of real SGLang 0.5.23 vs prompt length, on the bench-size tiny Qwen3-Next.

Starts one SGLang server (CPU, our ``sgl_kernel`` shim) on a random-weight Qwen3-Next of the "bench"
size (hidden 768, 12 layers = 9 GDN + 3 attention, vocab 32k), sends prompts of unique random token
ids (so the prefix cache never hits) with ``max_new_tokens=1``, and times each request end to end.
Fits ``time = a + b * tokens`` by least squares and reports R^2.

Outputs ``benchmarks/results/prefill_cpu.json`` and ``benchmarks/results/prefill_cpu.png``.

    .venv/bin/python -m benchmarks.prefill_cpu               # ~3-5 min on 2 cores
    .venv/bin/python -m benchmarks.prefill_cpu --tokens 256 1024 --reps 1   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scipy.stats import linregress

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_TOKENS = (256, 512, 1024, 2048, 3072, 4096)


def linear_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least-squares ``y = a + b x`` (``scipy.stats.linregress``); returns a, b and R^2 (a single
    x value: the flat line through the mean, R^2 1)."""
    if len(set(xs)) < 2:
        return {"a_s": sum(ys) / len(ys), "b_s_per_token": 0.0, "r2": 1.0}
    fit = linregress(xs, ys)
    return {"a_s": float(fit.intercept), "b_s_per_token": float(fit.slope), "r2": float(fit.rvalue**2)}


def analyze(result: dict[str, Any]) -> None:
    """Add per-length median/min and two fits to ``result`` (in place).

    ``fit``: least squares over every request. ``fit_min``: over the per-length minimum, which is
    robust to slow-downs caused by other processes (the minimum is the least-contended run).
    """
    ms = result["measurements"]
    lengths = sorted({m["tokens"] for m in ms})
    med: dict[str, float] = {}
    mins: dict[str, float] = {}
    for n in lengths:
        vals = [m["seconds"] for m in ms if m["tokens"] == n]
        med[str(n)], mins[str(n)] = statistics.median(vals), min(vals)
    result["median_by_tokens"] = med
    result["min_by_tokens"] = mins
    result["fit"] = linear_fit([float(m["tokens"]) for m in ms], [m["seconds"] for m in ms])
    result["fit_min"] = linear_fit([float(n) for n in lengths], [mins[str(n)] for n in lengths])


def report(result: dict[str, Any], out_dir: Path) -> None:
    """Write JSON + PNG and print the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prefill_cpu.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "prefill_cpu.png")
    fit, fit_min = result["fit"], result["fit_min"]
    print(
        f"\nSGLang {result['sglang']} CPU prefill, {result['model']['desc']}; "
        f"server start {result['server_startup_s']:.1f} s"
    )
    print(f"{'tokens':>8} {'median s':>10} {'min s':>8} {'ms/token':>10} {'fit s':>8}")
    for n, s in result["median_by_tokens"].items():
        pred = fit["a_s"] + fit["b_s_per_token"] * int(n)
        mn = result["min_by_tokens"][n]
        print(f"{int(n):>8} {s:>10.3f} {mn:>8.3f} {1e3 * s / int(n):>10.3f} {pred:>8.3f}")
    for name, f in (("all requests", fit), ("per-length min", fit_min)):
        print(
            f"fit ({name}): time = {f['a_s']:.4f} s + {f['b_s_per_token'] * 1e3:.4f} ms * tokens, "
            f"R^2 = {f['r2']:.5f}"
        )
    la = result["machine"].get("loadavg_after", [0.0])[0]
    cores = result["machine"].get("cpu_count") or 1
    if la > cores:
        print(f"warning: machine load average {la:.1f} > {cores} cores; timings are contended")
    print(f"wrote {out_dir / 'prefill_cpu.json'} and {out_dir / 'prefill_cpu.png'}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Scatter of every measurement, the per-length median, and the fitted line."""
    from benchmarks._common import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    pts = result["measurements"]
    fit = result["fit"]
    xs = [p["tokens"] for p in pts]
    ys = [p["seconds"] for p in pts]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.scatter(xs, ys, s=18, alpha=0.6, label="requests")
    med = result["median_by_tokens"]
    ax.plot([int(k) for k in med], list(med.values()), "o", ms=7, mfc="none", label="median")
    lo, hi = 0, max(xs) * 1.05
    ax.plot(
        [lo, hi],
        [fit["a_s"] + fit["b_s_per_token"] * lo, fit["a_s"] + fit["b_s_per_token"] * hi],
        "-",
        label=f"fit: {fit['a_s']:.3f} s + {fit['b_s_per_token'] * 1e3:.3f} ms/token (R²={fit['r2']:.4f})",
    )
    fm = result.get("fit_min")
    if fm:
        ax.plot(
            [lo, hi],
            [fm["a_s"] + fm["b_s_per_token"] * lo, fm["a_s"] + fm["b_s_per_token"] * hi],
            "--",
            label=f"fit of per-length min: {fm['b_s_per_token'] * 1e3:.3f} ms/token (R²={fm['r2']:.4f})",
        )
    ax.set_xlabel("prompt tokens (prefill, cache miss)")
    ax.set_ylabel("request time [s] (max_new_tokens=1)")
    load = result["machine"].get("loadavg_after", [float("nan")])[0]
    ax.set_title(
        f"SGLang {result['sglang']} CPU prefill, {result['model']['desc']}\n"
        f"{result['machine']['cpu_count']} cores, load avg {load:.1f}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    ap.add_argument("--reps", type=int, default=2, help="timed requests per length (after one warm-up)")
    ap.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "sglang_sparse_bench_qwen3_next"
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra-arg", action="append", default=[], help="extra server flag (repeatable)")
    ap.add_argument("--reanalyze", type=Path, help="only refit/replot the measurements in this JSON")
    args = ap.parse_args(argv)
    if args.reanalyze is not None:
        result = json.loads(args.reanalyze.read_text())
        analyze(result)
        report(result, args.out_dir)
        return result

    import sglang
    import torch
    from tqdm import tqdm

    from sglang_sparse.models.tiny import SIZES, make_tiny_model
    from sglang_sparse.progress import bar_options
    from sglang_sparse.testing.server import SGLangServer

    spec = SIZES["bench"]
    t0 = time.monotonic()
    model_dir = make_tiny_model(args.model_dir, arch="qwen3_next", size="bench", seed=0)
    make_s = time.monotonic() - t0
    max_tokens = max(args.tokens)
    rng = random.Random(args.seed)
    # Unique random prompts: the first token differs per request, so no prefix is ever shared.
    plan = [(n, rep) for rep in range(args.reps) for n in args.tokens]
    rng.shuffle(plan)

    server = SGLangServer(
        model_dir,
        # The bench model's weights need more than the default 5% static-memory fraction on the CPU.
        extra_args=["--mem-fraction-static", "0.3", *args.extra_arg],
        max_total_tokens=max_tokens + 512,
        context_length=max_tokens + 64,
        max_mamba_cache_size=8,
    )
    load_before = os.getloadavg()
    server.start(timeout=400)
    measurements: list[dict[str, Any]] = []
    try:
        first_ids = iter(rng.sample(range(4, spec.vocab_size), len(plan) + 1))

        def prompt(n: int) -> list[int]:
            return [next(first_ids)] + [rng.randrange(4, spec.vocab_size) for _ in range(n - 1)]

        server.generate(prompt(min(args.tokens)), max_new_tokens=1)  # warm-up
        for n, rep in tqdm(plan, desc="prefill", unit="req", **bar_options()):
            ids = prompt(n)
            t = time.perf_counter()
            out = server.generate(ids, max_new_tokens=1)
            dt = time.perf_counter() - t
            if out.cached_tokens:
                raise RuntimeError(f"unexpected prefix-cache hit ({out.cached_tokens} tokens)")
            measurements.append(
                {"tokens": n, "rep": rep, "seconds": dt, "server_e2e_s": out.meta.get("e2e_latency")}
            )
    finally:
        startup = server.startup_seconds
        server.stop()

    result: dict[str, Any] = {
        "benchmark": "prefill_cpu",
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            # 1/5/15-min load averages: other processes on a shared 2-core box inflate and scatter
            # the timings (R^2 drops); compare runs only at similar load.
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "model": {
            "arch": "qwen3_next",
            "size": "bench",
            "spec": spec.__dict__,
            "desc": f"hidden {spec.hidden_size}, {spec.num_layers} layers "
            f"(attn every {spec.full_attention_interval}), vocab {spec.vocab_size}",
        },
        "server_startup_s": startup,
        "model_create_s": make_s,
        "reps": args.reps,
        "measurements": measurements,
    }
    analyze(result)
    report(result, args.out_dir)
    return result


if __name__ == "__main__":
    main()

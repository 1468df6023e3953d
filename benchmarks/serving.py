"""Replay JSONL traces against a real SGLang CPU server with each cache policy; measure TTFT.

For every trace (default ``doc_qa`` and ``system_prompts``) and every configuration -- the
``sparse`` backend with ``SGLANG_SPARSE_POLICY`` = ``sparse`` / ``marconi`` / ``lru``, SGLang's
native cache and ``--disable-radix-cache`` (reference) -- the script starts a fresh server (the
bench-size tiny hybrid model from :mod:`sglang_sparse.models.tiny`, random weights, where prefill
dominates), replays a prefix of the trace **sequentially** and records per request:

* TTFT: client-side latency of a ``max_new_tokens=1`` greedy request (prefill + one sample);
* prefilled tokens (``prompt_tokens - cached_tokens``) and cached tokens (SGLang ``meta_info``);
* the generated token, compared with the no-cache run (token equality).

Trace shrinking (deterministic, keeps prefix structure): real traces are 10k-30k tokens, far too
long for a CPU. Each input ``x`` becomes ``x[:n-T][::k] + x[n-T:]`` (every ``k``-th token of the
head, the last ``T`` tokens verbatim) and is truncated to the context; requests sharing a head
prefix still share the (shorter) prefix, and their distinct tails (questions, user turns) stay
distinct. Ids are remapped into the model vocabulary by a fixed multiplicative hash. Multi-turn
traces lose part of their turn-extends-turn structure under this map (documented limit).

Outputs: ``benchmarks/results/serving.json`` and ``benchmarks/results/serving.png``.

    python benchmarks/serving.py --quick            # < 5 min: sparse vs native vs no-cache, 8 requests
    python benchmarks/serving.py                    # + marconi, lru; 60 requests per trace

Prefilled tokens are deterministic (the acceptance figures: never more than native on any prefix
of a slice, share of the perfect-cache saving); TTFT here is sequential and noisy, the comparison
under load is ``benchmarks/serving_load.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: `python benchmarks/serving.py`
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
TRACES = ROOT / "traces" / "build"

CHUNK = 512
KV_TOKENS = 24000
STATE_SLOTS = 48


def shrink(tokens: list[int], *, stride: int, tail: int, max_len: int, vocab: int) -> list[int]:
    """Deterministic, prefix-structure-preserving shrink + vocab remap (see module docstring)."""
    n = len(tokens)
    t = min(tail, n)
    head = tokens[: n - t][::stride] if stride > 1 else tokens[: n - t]
    out = [4 + (int(x) * 2654435761 + 97) % (vocab - 4) for x in head + tokens[n - t :]]
    return out[:max_len]


def load_requests(name: str, n: int, *, target: int, tail: int, max_len: int, vocab: int) -> list[list[int]]:
    from sglang_sparse.sim.trace import load_trace

    path = TRACES / f"{name}.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} missing; run `python -m sglang_sparse.traces build all`")
    reqs = load_trace(path)[:n]
    lens = sorted(len(r.input_tokens) for r in reqs)
    stride = max(1, -(-lens[len(lens) // 2] // target))
    return [
        shrink(list(r.input_tokens), stride=stride, tail=tail, max_len=max_len, vocab=vocab) for r in reqs
    ]


def configs(quick: bool) -> dict[str, tuple[list[str], dict[str, str]]]:
    sparse = ["--radix-cache-backend", "sparse"]
    c = {"nocache": (["--disable-radix-cache"], {}), "native": ([], {})}
    c["sparse"] = (sparse, {"SGLANG_SPARSE_POLICY": "sparse"})
    if not quick:
        c["marconi"] = (sparse, {"SGLANG_SPARSE_POLICY": "marconi"})
        c["lru"] = (sparse, {"SGLANG_SPARSE_POLICY": "lru"})
    return c


def run_config(
    model_dir: Path,
    name: str,
    extra: list[str],
    env: dict,
    traces: dict,
    bar,
    context: int,
    log_dir: Path = RESULTS,
) -> dict[str, Any]:
    import requests

    from sglang_sparse.testing.server import SGLangServer

    srv = SGLangServer(
        model_dir,
        extra_args=["--chunked-prefill-size", str(CHUNK), "--mem-fraction-static", "0.3", *extra],
        env={"SGLANG_SPARSE_LOG_EVERY": "0", **env},
        context_length=context,
        max_total_tokens=KV_TOKENS,
        max_mamba_cache_size=STATE_SLOTS,
        log_path=log_dir / f"serving_{name}.log",
    )
    srv.start(timeout=600)
    out: dict[str, Any] = {"startup_s": srv.startup_seconds}
    try:
        srv.generate([5, 6, 7], 1)  # warm-up outside the measurement
        for tname, reqs in traces.items():
            srv.flush_cache()
            rows = []
            for p in reqs:
                t0 = time.perf_counter()
                r = srv.generate(p, 1)
                rows.append(
                    {
                        "ttft": time.perf_counter() - t0,
                        "prompt": r.prompt_tokens,
                        "cached": r.cached_tokens,
                        "token": r.output_ids,
                    }
                )
                bar.update(1)
            stats = None
            if extra and extra[0] == "--radix-cache-backend":
                info = requests.get(f"{srv.url}/server_info", timeout=60).json()
                stats = info["internal_states"][0].get("sparse_cache")
            out[tname] = {"rows": rows, "sparse_stats": stats}
    finally:
        srv.stop()
    return out


def ideal_prefilled(prompts: list[list[int]]) -> int:
    """Lower bound on the tokens any prefix cache must prefill for ``prompts`` replayed in order:
    an unbounded cache with a state at every position reuses each prompt's longest common prefix
    with any earlier prompt (at least the last token is always computed)."""
    from sglang_sparse.tree import RadixTree

    tree = RadixTree(1, 1)
    total = 0
    for p in prompts:
        total += len(p) - min(tree.match(p).kv_depth, len(p) - 1)
        tree.insert(p)
    return total


def _cumulative_prefilled(rows: list[dict]) -> list[int]:
    out, tot = [], 0
    for r in rows:
        tot += r["prompt"] - r["cached"]
        out.append(tot)
    return out


def summarize(results: dict, trace_names: list[str], ideal: dict[str, int] | None = None) -> dict:
    summary: dict[str, dict] = {}
    for tname in trace_names:
        ref = [r["token"] for r in results["nocache"][tname]["rows"]]
        native_mean = None
        s: dict[str, dict] = {}
        for cname, res in results.items():
            rows = res[tname]["rows"]
            ttft = [r["ttft"] for r in rows]
            q = sorted(ttft)
            d = {
                "requests": len(rows),
                "ttft_mean": statistics.fmean(ttft),
                "ttft_median": statistics.median(ttft),
                "ttft_p95": q[min(len(q) - 1, int(round(0.95 * (len(q) - 1))))],
                "prompt_tokens": sum(r["prompt"] for r in rows),
                "cached_tokens": sum(r["cached"] for r in rows),
                "prefilled_tokens": sum(r["prompt"] - r["cached"] for r in rows),
                "tokens_equal_nocache": [r["token"] for r in rows] == ref,
                "mismatches": sum(a["token"] != b for a, b in zip(rows, ref, strict=True)),
            }
            s[cname] = d
            if cname == "native":
                native_mean = d["ttft_mean"]
        for d in s.values():
            d["ttft_mean_vs_native"] = d["ttft_mean"] / native_mean if native_mean else None
        if "native" in s:
            # Never worse than native on any prefix of the slice: cumulative prefilled tokens.
            nat = _cumulative_prefilled(results["native"][tname]["rows"])
            for cname, d in s.items():
                mine = _cumulative_prefilled(results[cname][tname]["rows"])
                pairs = enumerate(zip(mine, nat, strict=True))
                d["prefixes_worse_than_native"] = [i + 1 for i, (a, b) in pairs if a > b]
        if ideal is not None and "native" in s:
            # what no cache can beat: a perfect cache's prefilled tokens, as a fraction of native's
            s["perfect_cache_bound"] = {
                "prefilled_tokens": ideal[tname],
                "prefilled_vs_native": ideal[tname] / max(s["native"]["prefilled_tokens"], 1),
            }
            room = s["native"]["prefilled_tokens"] - ideal[tname]  # the most any cache saves over native
            for cname, d in s.items():
                if cname != "perfect_cache_bound" and room > 0:
                    d["share_of_perfect_saving"] = (
                        s["native"]["prefilled_tokens"] - d["prefilled_tokens"]
                    ) / room
        summary[tname] = s
    return summary


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tnames = list(summary)
    fig, axes = plt.subplots(1, len(tnames), figsize=(5.5 * len(tnames), 4), squeeze=False)
    for ax, t in zip(axes[0], tnames, strict=True):
        names = [c for c in summary[t] if c != "perfect_cache_bound"]
        means = [summary[t][c]["ttft_mean"] for c in names]
        p95 = [summary[t][c]["ttft_p95"] for c in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], means, 0.4, label="mean")
        ax.bar([i + 0.2 for i in x], p95, 0.4, label="p95")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{t}: TTFT per config")
        for i, c in enumerate(names):
            ax.annotate(
                f"{summary[t][c]['cached_tokens']} cached",
                (i, means[i]),
                ha="center",
                fontsize=7,
                xytext=(0, 3),
                textcoords="offset points",
            )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sparse/native/no-cache, fewer requests (< 5 min)")
    ap.add_argument("--traces", default="doc_qa,system_prompts")
    ap.add_argument("--requests", type=int, help="requests per trace (default 8 quick, 60 full)")
    ap.add_argument("--target-len", type=int, default=768, help="median shrunk prompt length")
    ap.add_argument(
        "--size",
        help="tiny-model size preset (default: tiny; the bench preset makes prefill dominate TTFT "
        "but one 800-token prefill of it takes minutes on 2 shared cores)",
    )
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/sglang_sparse_bench_model"))
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results[/quick]/serving.json)"
    )
    args = ap.parse_args(argv)
    if args.out is None:
        from benchmarks._common import results_dir

        args.out = results_dir(args.quick) / "serving.json"

    from tqdm import tqdm

    from sglang_sparse.models.tiny import SIZES, make_tiny_model

    n = args.requests or (8 if args.quick else 60)
    args.size = args.size or "tiny"
    if args.model_dir == Path("/tmp/sglang_sparse_bench_model"):
        args.model_dir = Path(f"/tmp/sglang_sparse_serving_{args.size}")
    vocab = SIZES[args.size].vocab_size
    context = min(4096, SIZES[args.size].max_position_embeddings)
    model_dir = make_tiny_model(args.model_dir, arch="qwen3_next", size=args.size, seed=0)
    trace_names = [t for t in args.traces.split(",") if t]
    traces = {
        t: load_requests(t, n, target=args.target_len, tail=48, max_len=context - 16, vocab=vocab)
        for t in trace_names
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfgs = configs(args.quick)
    total = len(cfgs) * sum(len(v) for v in traces.values())
    t0 = time.time()
    results: dict[str, Any] = {}
    with tqdm(total=total, desc="serving replay", file=sys.stderr) as bar:
        for cname, (extra, env) in cfgs.items():
            bar.set_postfix_str(cname)
            results[cname] = run_config(model_dir, cname, extra, env, traces, bar, context, args.out.parent)
    ideal = {t: ideal_prefilled(v) for t, v in traces.items()}
    summary = summarize(results, trace_names, ideal)
    doc = {
        "model": {"size": args.size, "path": str(model_dir)},
        "quick": args.quick,
        "requests_per_trace": n,
        "prompt_lengths": {t: [len(p) for p in v] for t, v in traces.items()},
        "server": {
            "chunked_prefill_size": CHUNK,
            "max_total_tokens": KV_TOKENS,
            "max_mamba_cache_size": STATE_SLOTS,
        },
        "wall_seconds": time.time() - t0,
        "summary": summary,
        "raw": results,
    }
    args.out.write_text(json.dumps(doc, indent=1))
    plot(summary, args.out.with_suffix(".png"))
    for t, s in summary.items():
        for c, d in s.items():
            if c == "perfect_cache_bound":
                print(
                    f"{t:15s} perfect cache would prefill {d['prefilled_tokens']} tokens = "
                    f"{d['prefilled_vs_native']:.2f}x native's (no cache can do better on this slice)"
                )
                continue
            r = d["ttft_mean_vs_native"]
            share = d.get("share_of_perfect_saving")
            print(
                f"{t:15s} {c:8s} ttft mean {d['ttft_mean']:.3f}s median {d['ttft_median']:.3f}s "
                f"p95 {d['ttft_p95']:.3f}s  vs native {r:.2f}x  prefilled {d['prefilled_tokens']} "
                f"cached {d['cached_tokens']}  tokens==nocache {d['tokens_equal_nocache']}"
                + (f"  perfect-saving share {share:.0%}" if share is not None else "")
                + f"  prefixes worse than native: {len(d.get('prefixes_worse_than_native', []))}"
            )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does time to first token follow the prefilled tokens? Request-by-request paired TTFT.

Whole serving runs drift against each other (``serving_load.py``'s A/A rows); this driver pairs at
the request level instead: every server is up at once, and each request of the workload is sent to
every server in turn (rotated order per request), one request in flight, before the next one goes
out. Every cache sees the same sequence, and the TTFTs of one request are taken seconds apart.

Per request and server: TTFT (ms, from sending ``/generate`` with ``stream`` to the first streamed
chunk, measured by this process) and the prompt and cached tokens the server reports at the end
(``meta_info``). Per pair of servers ``a/b`` (``--pairs``, plus every ``NAME#2`` with ``NAME``: the
A/A control of :func:`benchmarks.serving_load.config_base`):

* ``ttft_ratio`` = sum of TTFT over all requests and repetitions, ``a`` over ``b``;
* ``prefilled_ratio`` = the same for prefilled tokens (prompt - cached);
* ``gap`` = ttft_ratio / prefilled_ratio - 1 (0: TTFT shrinks exactly as the prefill does), with a
  95% interval from a seeded bootstrap over requests;
* ``equal_work_ms``: mean TTFT difference over the requests where both prefilled the same tokens
  (the same work: any difference is overhead or noise), with its bootstrap interval.

Command (the committed run, ~10 min)::

    python -m benchmarks.ttft_paired --workload doc_qa --requests 60 --reps 3 \\
        --configs sparse,native_eb,native_eb#2,lru,native

Writes ``benchmarks/results/ttft_paired.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import bar  # noqa: E402
from benchmarks.serving_load import (  # noqa: E402
    CONFIGS,
    aa_pairs,
    config_base,
    flush,
    make_workload,
    rotated,
    size_pools,
    start_servers,
    tiny_model,
)
from benchmarks.stats import bootstrap_ci, pooled_gap  # noqa: E402

DEFAULT_PAIRS = ("sparse/native_eb", "sparse/lru", "sparse/native", "lru/native_eb", "native/native_eb")


def stream_ttft(server: Any, input_ids: Sequence[int], output_len: int) -> dict[str, Any]:
    """One greedy streamed request (:meth:`SGLangServer.generate_streaming`): ``ttft_ms``,
    ``prompt_tokens`` and ``cached_tokens`` (from the last chunk's meta_info)."""
    ttft, res = server.generate_streaming(input_ids, output_len)
    return {
        "ttft_ms": ttft * 1000.0,
        "prompt_tokens": res.prompt_tokens or len(input_ids),
        "cached_tokens": res.cached_tokens,
    }


def pair_summary(rows: Sequence[dict[str, Any]], a: str, b: str, *, seed: int = 0) -> dict[str, Any] | None:
    """The pair statistics of the module docstring from ``rows`` (one per request and repetition,
    ``{config: {"ttft_ms", "prompt_tokens", "cached_tokens"}}``)."""
    pairs = [(r[a], r[b]) for r in rows if a in r and b in r]
    if not pairs:
        return None

    def sums(ps: Sequence[tuple[dict, dict]]) -> list[list[float]]:
        """Per request: TTFT of a, of b, prefilled tokens of a, of b."""
        return [
            [x["ttft_ms"] for x, _ in ps],
            [y["ttft_ms"] for _, y in ps],
            [x["prompt_tokens"] - x["cached_tokens"] for x, _ in ps],
            [y["prompt_tokens"] - y["cached_tokens"] for _, y in ps],
        ]

    def gap(ps: Sequence[tuple[dict, dict]]) -> float:
        g = pooled_gap(*sums(ps))
        return float("nan") if g is None else g

    ta, tb, pa, pb = (sum(v) for v in sums(pairs))
    same = [x["ttft_ms"] - y["ttft_ms"] for x, y in pairs if x["cached_tokens"] == y["cached_tokens"]]
    out: dict[str, Any] = {
        "requests": len(pairs),
        "ttft_ratio": ta / tb if tb else None,
        "prefilled_ratio": pa / pb if pb else None,
        "gap": gap(pairs),
        "gap_ci95": bootstrap_ci(pairs, gap, seed=seed),
        "equal_work_requests": len(same),
    }
    if same:
        out["equal_work_ms"] = sum(same) / len(same)
        out["equal_work_ms_ci95"] = bootstrap_ci(same, lambda v: sum(v) / len(v), seed=seed)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if config_base(c) not in CONFIGS]
    if bad or len(set(configs)) != len(configs):
        raise SystemExit(f"error: unknown or repeated configs {bad or configs}; valid: {', '.join(CONFIGS)}")
    work = Path(args.work_dir)
    model_dir, spec, template = tiny_model(work)
    context = spec.max_position_embeddings
    wl = make_workload(
        args.workload,
        args.requests,
        target_len=args.target_len,
        output_len=args.output_len,
        context=context,
        vocab=spec.vocab_size,
        seed=0,
        work=work,
    )
    pools = size_pools(wl.accounting, args.pool_fraction, 4)
    servers = start_servers(
        model_dir,
        configs,
        pools,
        chunk=args.chunk,
        context=context,
        chat_template=template,
        log_dir=work,
        tag=f"paired_{args.workload}",
    )
    rows: list[dict[str, Any]] = []
    progress = bar(args.reps * len(wl.prompts) * len(configs), "ttft_paired")
    try:
        for s in servers.values():  # a fresh server's first request is slow: outside the measurement
            s.generate(wl.prompts[0], 2)
        for rep in range(args.reps):
            for s in servers.values():
                flush(s)
            for i, prompt in enumerate(wl.prompts):
                row: dict[str, Any] = {"rep": rep, "request": i}
                for c in rotated(configs, i + rep):
                    row[c] = stream_ttft(servers[c], prompt, wl.output_len)
                    progress.update(1)
                rows.append(row)
    finally:
        progress.close()
        for s in servers.values():
            s.stop()
    pairs = [p.split("/") for p in args.pairs.split(",") if p.strip()]
    pairs += aa_pairs(configs)
    summary = {
        f"{a}/{b}": pair_summary(rows, a, b, seed=args.seed)
        for a, b in pairs
        if a in configs and b in configs
    }
    return {
        "benchmark": "ttft_paired",
        "workload": args.workload,
        "requests": len(wl.prompts),
        "reps": args.reps,
        "output_len": wl.output_len,
        "configs": configs,
        "pools": pools,
        "chunk": args.chunk,
        "summary": summary,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="doc_qa", choices=("doc_qa", "system_prompts", "rag"))
    ap.add_argument("--requests", type=int, default=60, help="requests of the trace (default 60)")
    ap.add_argument("--reps", type=int, default=3, help="passes over the requests (default 3)")
    ap.add_argument(
        "--configs", default="sparse,native_eb,native_eb#2,lru,native", help="servers; NAME#2 = a second NAME"
    )
    ap.add_argument("--pairs", default=",".join(DEFAULT_PAIRS), help="a/b pairs to summarise")
    ap.add_argument("--target-len", type=int, default=768, help="median prompt after shrinking (tokens)")
    ap.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--pool-fraction", type=float, default=0.4, help="pools hold this share of the footprint")
    ap.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size (tokens)")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    ap.add_argument("--work-dir", default="/tmp/sglang_sparse_ttft_paired", help="logs, model, dataset")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ttft_paired.json"))
    args = ap.parse_args(argv)
    if args.requests < 2 or args.reps < 1:
        raise SystemExit("error: need --requests >= 2 and --reps >= 1")
    doc = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(
        f"\n== {doc['workload']}: {doc['requests']} requests x {doc['reps']} passes, one in flight, "
        "each request sent to every server in turn"
    )
    for name, s in doc["summary"].items():
        if s is None:
            continue
        lo, hi = s["gap_ci95"]
        line = (
            f"{name:>18}: TTFT ratio {s['ttft_ratio']:.3f}, prefilled ratio {s['prefilled_ratio']:.3f}, "
            f"gap {s['gap']:+.1%} [95% {lo:+.1%} to {hi:+.1%}]"
        )
        if "equal_work_ms" in s:
            a, b = s["equal_work_ms_ci95"]
            n = s["equal_work_requests"]
            line += f"; same-work requests ({n}): {s['equal_work_ms']:+.1f} ms [{a:+.1f}, {b:+.1f}]"
        print(line)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

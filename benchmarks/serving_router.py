"""Data-parallel replicas behind SGLang's router: what routing does to the cache.

Topology: ``--workers N`` real SGLang CPU servers per configuration (the configurations of
:mod:`benchmarks.serving_load`), behind SGLang's router (PyPI ``sglang-router``,
:class:`sglang_sparse.testing.router.Router`), started afresh for every run so its approximate
prefix tree starts empty like the workers' flushed caches. Routing policies: ``cache_aware`` (the
router's default: the worker whose tree shares most of the prefix, unless the load is imbalanced)
and ``round_robin``. Worker ``i`` is bound to core ``i`` (``SGLANG_CPU_OMP_THREADS_BIND``).

Load: SGLang's client (via :mod:`benchmarks.bench_client`) replays each workload *through the
router*, shrunk and with pools sized per worker as in :mod:`benchmarks.serving_load`: ``doc_qa``,
``system_prompts`` (custom datasets) and ``agent`` (whole sessions over ``/v1/chat/completions``),
all requests at once capped at ``--max-concurrency`` in flight.

Per run: the client's req/s and TTFT mean/p50/p95 (ms), completed and errors; per worker the
requests, prompt and cached tokens served (deltas of SGLang's Prometheus counters, workers run with
``--enable-metrics``), hence ``balance`` (busiest worker's requests / the mean) and the run's
prefilled tokens and hit rate (:func:`token_totals`; the client's per-request ``cached_tokens``, kept
as ``client_*``, read 0 through the router on the chat endpoint). Repetitions are interleaved (cells
rotated by the repetition); cells give the median and min-max spread, ratios are paired per
repetition. Token equality: every run's texts vs the ``nocache`` run of the same repetition
(``nocache`` runs with ``round_robin`` only); if any differ, a sequential greedy pass through the
router decides.

``--fault``: ``sparse`` workers behind each policy on the first workload; when a third of its requests
are served, worker 1 is killed (SIGKILL of its process group) and restarted on the same port. Every
request must complete or fail visibly to the client (``lost`` counts the rest), and the restarted
worker must rejoin: reported healthy by the router and served requests when the same router then
replays the next requests of the trace. ``--dp-size N``: one server per configuration with SGLang's
own data-parallel controller (``--dp-size N``, one core per rank).

Outputs: ``benchmarks/results/serving_router.json`` and ``.png`` (prefilled tokens per cell).

    python -m benchmarks.serving_router --quick    # doc_qa; nocache,native_eb,sparse; 16 requests; 1 rep
    python -m benchmarks.serving_router            # doc_qa,system_prompts,agent; 3 reps; + fault run
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import bar, pyplot, save, table, write_json  # noqa: E402
from benchmarks.serving_load import (  # noqa: E402 - after the sys.path fix for script use
    CONFIGS,
    Workload,
    add_workload_arguments,
    config_base,
    flush,
    make_server,
    make_workload,
    parse_run_args,
    rotated,
    run_client,
    sequential_mismatches,
    sequential_outputs,
    size_pools,
    start_all,
    text_mismatches,
    tiny_model,
)
from benchmarks.stats import Spread, fmt_ratio, fmt_spread, ratio_spread, spread  # noqa: E402
from sglang_sparse.testing.router import POLICIES, Router, worker_counters  # noqa: E402

WORKLOADS = ("doc_qa", "system_prompts", "agent")

FULL_DEFAULTS: dict[str, Any] = dict(
    workloads="doc_qa,system_prompts,agent",
    configs="nocache,native_eb,sparse",
    policies="cache_aware,round_robin",
    reps=3,
    requests=24,
    agent_sessions=4,
    agent_turns=6,
    fault=True,
)
QUICK_DEFAULTS: dict[str, Any] = {
    **FULL_DEFAULTS,
    "workloads": "doc_qa",
    "reps": 1,
    "requests": 16,
    "agent_sessions": 3,
    "agent_turns": 4,
    "fault": False,
}

#: the pairs the acceptance compares (subject, reference): (config, policy)
COMPARISONS: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = (
    (("sparse", "cache_aware"), ("native_eb", "cache_aware")),
    (("sparse", "cache_aware"), ("native", "cache_aware")),
    (("sparse", "cache_aware"), ("sparse", "round_robin")),
    (("native_eb", "cache_aware"), ("native_eb", "round_robin")),
)


def cell_name(config: str, policy: str) -> str:
    return f"{config}+{policy}"


def workload_of(args: argparse.Namespace, name: str, context: int, vocab: int, start: int = 0) -> Workload:
    """:func:`benchmarks.serving_load.make_workload` sized by the command line."""
    keys = "requests target_len output_len seed agent_sessions agent_turns agent_target_len".split()
    sizes = {k: getattr(args, k) for k in keys}
    return make_workload(name, context=context, vocab=vocab, work=args.work_dir, start=start, **sizes)


# ----------------------------------------------------------------------------- workers
def start_workers(
    model_dir: Path,
    configs: Sequence[str],
    n: int,
    pools: dict[str, Any],
    *,
    chunk: int,
    context: int,
    chat_template: Path,
    log_dir: Path,
    tag: str,
) -> dict[str, list[Any]]:
    """``n`` servers per configuration with ``--enable-metrics``, started concurrently, all or none
    (:func:`~benchmarks.serving_load.start_all`). Worker ``i``'s compute is bound to core ``i`` (mod
    the machine's cores; ``SGLANG_CPU_OMP_THREADS_BIND``): replicas do not share cores, as on
    separate GPUs (SGLang's CPU backend otherwise gives each all cores)."""
    cpus = os.cpu_count() or 1
    workers = {
        c: [
            make_server(
                model_dir, c, pools,
                chunk=chunk, context=context, chat_template=chat_template,
                log_path=log_dir / f"router_{tag}_{c}_w{i}.log",
                env={"SGLANG_CPU_OMP_THREADS_BIND": str(i % cpus)}, extra=["--enable-metrics"],
            )
            for i in range(n)
        ]
        for c in configs
    }  # fmt: skip
    start_all(
        {f"{c} w{i}": s for c, ws in workers.items() for i, s in enumerate(ws)},
        "pass fewer --configs/--workers",
    )
    return workers


def flush_all(workers: Sequence[Any]) -> None:
    """``/flush_cache`` on every worker (retried while requests drain)."""
    for w in workers:
        flush(w, tries=40)


def counters(workers: Sequence[Any]) -> list[dict[str, float] | None]:
    """Per worker :func:`~sglang_sparse.testing.router.worker_counters` (None when down)."""
    out: list[dict[str, float] | None] = []
    for w in workers:
        try:
            out.append(worker_counters(w.url))
        except Exception:  # noqa: BLE001 - a dead worker has no counters
            out.append(None)
    return out


def counter_delta(
    before: list[dict[str, float] | None], after: list[dict[str, float] | None]
) -> list[dict[str, Any]]:
    """Per worker: requests, prompt, cached and prefilled tokens served between two reads (a
    worker restarted in between counts from zero; a worker down at the end has None)."""
    rows = []
    for b, a in zip(before, after, strict=True):
        if a is None:
            rows.append(
                {"requests": None, "prompt_tokens": None, "cached_tokens": None, "prefilled_tokens": None}
            )
            continue
        base = b if b is not None and all(a[k] >= b[k] for k in a) else dict.fromkeys(a, 0.0)
        d = {k: int(round(a[k] - base[k])) for k in a}
        d["prefilled_tokens"] = d["prompt_tokens"] - d["cached_tokens"]
        rows.append(d)
    return rows


def balance(per_worker: list[dict[str, Any]]) -> float | None:
    """Busiest worker's requests / the mean over workers (1.0 = perfectly even)."""
    reqs = [w["requests"] for w in per_worker if w["requests"] is not None]
    total = sum(reqs)
    return max(reqs) / (total / len(reqs)) if reqs and total else None


# ----------------------------------------------------------------------------- runs
def run_routed(
    client: Any,
    router_url: str,
    workers: Sequence[Any],
    wl: Workload,
    *,
    model_dir: Path,
    max_concurrency: int,
    seed: int,
    out_file: Path,
    timeout: float,
    during: Callable[[], None] | None = None,
    allow_errors: bool = False,
) -> dict[str, Any]:
    """Run the client once through ``router_url``; return the run record. ``during`` runs in a
    thread alongside the client (the fault injector). Failed requests fail the run unless
    ``allow_errors`` (then they are counted)."""
    before = counters(workers)
    side = threading.Thread(target=during, daemon=True) if during else None
    if side:
        side.start()
    t0 = time.perf_counter()
    row = run_client(
        client,
        router_url,
        wl,
        float("inf"),
        max_concurrency,
        model_dir=model_dir,
        seed=seed,
        out_file=out_file,
        timeout=timeout,
        allow_errors=allow_errors,
    )
    wall = time.perf_counter() - t0
    if side:
        side.join()
    per_worker = counter_delta(before, counters(workers))
    lens = [int(x) for x in row.get("input_lens") or []]
    cached = [int(x or 0) for x in row.get("cached_tokens") or []]
    errors = [str(e) for e in row.get("errors") or [] if e]
    return {
        "request_throughput": row.get("request_throughput"),
        "mean_ttft_ms": row.get("mean_ttft_ms"),
        "median_ttft_ms": row.get("median_ttft_ms"),
        "p95_ttft_ms": row.get("p95_ttft_ms"),
        "completed": int(row.get("completed") or 0),
        "sent": len(row.get("errors") or []) or wl.requests,
        "errors": len(errors),
        "error_messages": sorted({last_line(e) for e in errors}),
        "wall_s": wall,
        "client_prompt_tokens": sum(lens),
        "client_cached_tokens": sum(cached),
        **token_totals(per_worker, sum(lens), sum(cached)),
        "per_worker": per_worker,
        "balance": balance(per_worker),
        "texts": list(row.get("generated_texts") or []),
        "per_request_cached": cached,
    }


def token_totals(per_worker: list[dict[str, Any]], client_prompt: int, client_cached: int) -> dict[str, Any]:
    """Prompt, cached and prefilled tokens of a run and its hit rate (cached / prompt), from the
    workers' own counters when every worker reported (``tokens_from: server``), else from the
    per-request ``cached_tokens`` the client saw (``client``). Through the router the client's
    figure is 0 on the chat endpoint (SGLang's cache report does not come back in the routed
    OpenAI response), so the server counters are the measurement."""
    if per_worker and all(w["prompt_tokens"] is not None for w in per_worker):
        prompt = sum(w["prompt_tokens"] for w in per_worker)
        cached = sum(w["cached_tokens"] for w in per_worker)
        source = "server"
    else:
        prompt, cached, source = client_prompt, client_cached, "client"
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "hit_rate": cached / max(prompt, 1),
        "tokens_from": source,
    }


def last_line(error: str) -> str:
    """The last non-empty line of a client error (a traceback's exception line), 300 chars."""
    lines = [x for x in error.strip().splitlines() if x.strip()]
    return (lines[-1] if lines else error)[:300]


class RoutedGenerator:
    """``generate(ids, n)`` through the router's ``/generate`` (greedy), for the sequential
    equality pass (:func:`benchmarks.serving_load.sequential_outputs` duck type)."""

    def __init__(self, url: str, workers: Sequence[Any]) -> None:
        self.url, self.workers = url, workers

    def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> Any:
        import requests

        from sglang_sparse.testing.server import GenerateResult, _generate_payload

        r = requests.post(
            f"{self.url}/generate", json=_generate_payload(input_ids, max_new_tokens, None, {}), timeout=600
        )
        r.raise_for_status()
        body = r.json()
        return GenerateResult(output_ids=list(body["output_ids"]), meta=dict(body.get("meta_info", {})))

    def flush_cache(self) -> bool:
        flush_all(self.workers)
        return True


def fault_run(
    client: Any,
    workers: list[Any],
    wl: Workload,
    rejoin_wl: Workload,
    *,
    policy: str,
    model_dir: Path,
    max_concurrency: int,
    seed: int,
    work_dir: Path,
    timeout: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Kill worker 1 when a third of ``wl`` is served, restart it at once, let the run finish,
    then check that it rejoins: the same router serves ``rejoin_wl`` (later requests of the trace,
    so new prefixes the cache-aware router places on the emptier tree, the restarted worker's)."""
    victim = workers[1]
    state: dict[str, Any] = {}

    def inject() -> None:
        try:
            kill_and_restart()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON, the run goes on
            state["injector_error"] = repr(exc)[:2000]

    def kill_and_restart() -> None:
        target = max(1, wl.requests // 3)
        t0 = time.monotonic()
        base = counters(workers)
        while time.monotonic() - t0 < timeout:
            now = counters(workers)
            done = sum(
                (a or {}).get("requests", 0) - (b or {}).get("requests", 0)
                for a, b in zip(now, base, strict=True)
            )
            if done >= target:
                break
            time.sleep(0.1)
        state["killed_after_requests"] = done
        state["kill_t"] = time.monotonic()
        victim.stop()  # SIGKILL of its serving processes at once: a crash, in-flight requests die
        victim.log_path = victim.log_path.with_name(victim.log_path.stem + "_restarted.log")
        t1 = time.monotonic()
        victim.start(timeout=900)
        state["restart_s"] = time.monotonic() - t1

    flush_all(workers)
    with Router([w.url for w in workers], policy, log_path=work_dir / f"router_fault_{policy}.log") as router:
        rec = run_routed(
            client, router.url, workers, wl,
            model_dir=model_dir, max_concurrency=max_concurrency, seed=seed,
            out_file=work_dir / "client_fault.jsonl", timeout=timeout, during=inject, allow_errors=True,
        )  # fmt: skip
        log(
            f"[serving_router] fault ({policy}): {rec['completed']} completed, {rec['errors']} errors; "
            f"worker 1 restarted in {state.get('restart_s', float('nan')):.0f} s"
        )
        rejoined = router.wait_healthy(len(workers), timeout=120)
        second = run_routed(
            client, router.url, workers, rejoin_wl,
            model_dir=model_dir, max_concurrency=max_concurrency, seed=seed + 1,
            out_file=work_dir / "client_fault2.jsonl", timeout=timeout, allow_errors=True,
        )  # fmt: skip
    lost = rec["sent"] - rec["completed"] - rec["errors"]
    return {
        "config": "sparse",
        "policy": policy,
        "workload": wl.name,
        "killed_worker": 1,
        "killed_after_requests": state.get("killed_after_requests"),
        "restart_s": state.get("restart_s"),
        "injector_error": state.get("injector_error"),
        "run": _compact(rec),
        "requests": wl.requests,
        "completed": rec["completed"],
        "errors": rec["errors"],
        "lost": lost,
        "error_messages": rec["error_messages"],
        "router_reports_healthy_after": rejoined,
        "rejoin_run": _compact(second),
        "rejoined_requests_on_restarted_worker": second["per_worker"][1]["requests"],
        "texts": rec["texts"],
    }


def _compact(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if k not in ("texts", "per_request_cached")}


# ----------------------------------------------------------------------------- summaries
def summarize(runs: list[dict[str, Any]], cells: Sequence[tuple[str, str]], reps: int) -> dict[str, Any]:
    """Per cell median [min-max] over repetitions; paired ratios for :data:`COMPARISONS`."""

    def series(c: tuple[str, str], key: str) -> list[Any]:
        by = {(r["config"], r["policy"], r["rep"]): r for r in runs}
        return [by.get((*c, i), {}).get(key) for i in range(reps)]

    def sd(s: Spread | None) -> dict[str, Any] | None:
        return s.as_dict() if s else None

    keys = (
        "prefilled_tokens",
        "hit_rate",
        "balance",
        "request_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p95_ttft_ms",
        "errors",
    )
    out: dict[str, Any] = {"cells": {}, "ratios": {}}
    for c in cells:
        out["cells"][cell_name(*c)] = {k: sd(spread(series(c, k))) for k in keys}
    for a, b in COMPARISONS:
        if a in cells and b in cells:
            r = ratio_spread(series(a, "prefilled_tokens"), series(b, "prefilled_tokens"))
            t = ratio_spread(series(a, "mean_ttft_ms"), series(b, "mean_ttft_ms"))
            out["ratios"][f"{cell_name(*a)} / {cell_name(*b)}"] = {
                "prefilled_tokens": sd(r),
                "mean_ttft": sd(t),
                "fewer_in_every_rep": bool(r and r.hi < 1.0),
            }
    return out


def equality(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Texts of every run vs the ``nocache`` run of the same repetition."""
    ref = {r["rep"]: r["texts"] for r in runs if config_base(r["config"]) == "nocache"}
    per: dict[str, dict[str, int]] = {}
    for r in runs:
        if config_base(r["config"]) == "nocache" or r["rep"] not in ref:
            continue
        d = per.setdefault(cell_name(r["config"], r["policy"]), {"compared": 0, "mismatched": 0})
        d["compared"] += len(ref[r["rep"]])
        d["mismatched"] += text_mismatches(r["texts"], ref[r["rep"]])
    return {
        "reference": "nocache" if ref else None,
        "load": per,
        "all_equal": bool(ref) and all(v["mismatched"] == 0 for v in per.values()),
    }


def print_workload(name: str, wdoc: dict[str, Any]) -> None:
    print(
        f"\n== {name}: {wdoc['requests']} requests, perfect cache "
        f"{wdoc['perfect_prefilled']} of {wdoc['prompt_tokens']} prompt tokens"
    )
    keys = ("prefilled_tokens", "hit_rate", "balance", "mean_ttft_ms", "request_throughput")
    rows = [
        [cell, *(fmt_spread(Spread(**v[k]) if v[k] else None) for k in keys)]
        for cell, v in wdoc["summary"]["cells"].items()
    ]
    print(table(rows, ["workers+routing", "prefilled tok", "hit rate", "balance", "TTFT mean ms", "req/s"]))
    for k, v in wdoc["summary"]["ratios"].items():
        s = Spread(**v["prefilled_tokens"]) if v["prefilled_tokens"] else None
        print(f"  prefilled {k}: {fmt_ratio(s)}")
    eq = wdoc["equality"]
    print(f"  token equality vs nocache: {'all equal' if eq['all_equal'] else eq}")


def plot(doc: dict[str, Any], path: Path) -> None:
    """Prefilled tokens per (workers, routing) cell and workload: median bars, min-max whiskers."""
    plt = pyplot()
    if plt is None:
        return
    names = list(doc["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        w = doc["workloads"][name]
        cells = [
            (c, v["prefilled_tokens"])
            for c, v in w["summary"]["cells"].items()
            if v["prefilled_tokens"] and not c.startswith("nocache")
        ]
        xs = range(len(cells))
        med = [v["median"] for _, v in cells]
        err = [[v["median"] - v["lo"] for _, v in cells], [v["hi"] - v["median"] for _, v in cells]]
        colors = ["tab:blue" if "cache_aware" in c else "tab:gray" for c, _ in cells]
        ax.bar(xs, med, yerr=err, color=colors, capsize=3)
        ax.axhline(w["perfect_prefilled"], color="k", ls="--", lw=1, label="perfect cache")
        ax.set_xticks(list(xs), [c.replace("+", "\n") for c, _ in cells], fontsize=8)
        ax.set_title(f"{name} ({doc['workers']} workers)")
        ax.set_ylabel("prefilled tokens (lower is better)")
        ax.legend(fontsize=8)
    save(fig, path)


# ----------------------------------------------------------------------------- main
def run_router_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    from benchmarks.bench_client import ClientWorker

    workloads = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    policies = [p for p in args.policies.split(",") if p]
    bad = [w for w in workloads if w not in WORKLOADS] + [c for c in configs if config_base(c) not in CONFIGS]
    bad += [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"error: unknown workloads/configs/policies {bad}")
    if args.workers < 2:
        raise SystemExit("error: --workers must be >= 2 (one worker needs no router)")
    work = args.work_dir
    model_dir, spec, template = tiny_model(work, args.size, args.model_dir)
    context = spec.max_position_embeddings
    # the no-cache reference only gives tokens: one routing policy is enough
    ref_policy = "round_robin" if "round_robin" in policies else policies[0]
    cells = [(c, p) for c in configs for p in policies if config_base(c) != "nocache" or p == ref_policy]
    t_start = time.time()
    doc: dict[str, Any] = {
        "benchmark": "serving_router",
        "router": "sglang_router.launch_router (" + _router_version() + "), restarted per run",
        "client": "sglang.benchmark.serving through the router",
        "workers": args.workers,
        "model": {"arch": "qwen3_next", "size": args.size, "context": context},
        "configs": {
            c: {"server_flags": list(flags), "env": env, "strategy": strategy}
            for c in configs
            for flags, env, strategy in [CONFIGS[config_base(c)]]
        },
        "policies": policies,
        "reps": args.reps,
        "max_concurrency": args.max_concurrency,
        "rotation": "cells rotated left by the repetition index",
        "workloads": {},
    }
    progress = bar(len(workloads) * args.reps * len(cells), "serving_router")
    with ClientWorker() as client:
        client.start()
        for w in workloads:
            wl = workload_of(args, w, context, spec.vocab_size)
            pools = size_pools(wl.accounting, args.pool_fraction, args.min_running)
            log(
                f"[serving_router] {w}: starting {len(configs)} x {args.workers} workers (per worker KV "
                f"{pools['max_total_tokens']} tokens, {pools['max_mamba_cache_size']} state slots)"
            )
            workers = start_workers(
                model_dir,
                configs,
                args.workers,
                pools,
                chunk=args.chunk,
                context=context,
                chat_template=template,
                log_dir=work,
                tag=w,
            )
            runs: list[dict[str, Any]] = []
            fault = None
            try:
                for rep in range(args.reps):
                    for pos, (c, p) in enumerate(rotated(cells, rep)):
                        progress.set_postfix_str(f"{w} {c}+{p} rep{rep}")
                        flush_all(workers[c])
                        urls = [s.url for s in workers[c]]
                        with Router(urls, p, log_path=work / f"router_{w}.log") as router:
                            rec = run_routed(
                                client,
                                router.url,
                                workers[c],
                                wl,
                                model_dir=model_dir,
                                max_concurrency=args.max_concurrency,
                                seed=args.seed,
                                out_file=work / "client_out.jsonl",
                                timeout=args.client_timeout,
                            )
                        rec.update(config=c, policy=p, rep=rep, position=pos)
                        runs.append(rec)
                        dead = [s.url for s in workers[c] if not s.alive()]
                        if dead:
                            raise RuntimeError(f"{c} worker(s) died: {dead}")
                        progress.update(1)
                eq = equality(runs)
                seq = None
                if not eq["all_equal"] and "nocache" in configs:
                    log(
                        f"[serving_router] {w}: load-run texts differ; sequential greedy pass "
                        "through the router"
                    )
                    seq = sequential_equality(workers, configs, wl, work)
                if args.fault and w == workloads[0] and "sparse" in workers:
                    later = (
                        workload_of(args, w, context, spec.vocab_size, start=args.requests)
                        if wl.dataset == "custom"
                        else wl
                    )
                    ref = next((r["texts"] for r in runs if r["config"] == "nocache"), None)
                    fault = {}
                    for p in policies:
                        f = fault_run(
                            client,
                            workers["sparse"],
                            wl,
                            later,
                            policy=p,
                            model_dir=model_dir,
                            max_concurrency=args.max_concurrency,
                            seed=args.seed,
                            work_dir=work,
                            timeout=args.client_timeout,
                            log=log,
                        )
                        texts = f.pop("texts")
                        f["completed_texts_differing_from_nocache"] = (
                            None
                            if ref is None
                            else sum(
                                a != "" and a.split() != b.split() for a, b in zip(texts, ref, strict=False)
                            )
                        )
                        fault[p] = f
            finally:
                for ws in workers.values():
                    for s in ws:
                        s.stop()
            doc["workloads"][w] = {
                "dataset": wl.dataset,
                "requests": wl.requests,
                "prompt_tokens": wl.accounting["prompt_tokens"],
                "perfect_prefilled": wl.accounting["perfect_prefilled"],
                "accounting": wl.accounting,
                "pools_per_worker": pools,
                "summary": summarize(runs, cells, args.reps),
                "equality": eq,
                "sequential_equality": seq,
                "fault": fault,
                "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs],
            }
            print_workload(w, doc["workloads"][w])
    progress.close()
    if args.dp_size:
        doc["dp_size"] = dp_size_topology(
            model_dir, args, context, template, workloads[0], spec.vocab_size, log
        )
    doc["wall_s"] = time.time() - t_start
    return doc


def sequential_equality(
    workers: dict[str, list[Any]], configs: Sequence[str], wl: Workload, work: Path
) -> dict[str, Any]:
    """Greedy outputs one request at a time through a round-robin router, per configuration,
    against ``nocache``'s."""

    def outputs(c: str) -> list[list[int]]:
        with Router([s.url for s in workers[c]], "round_robin", log_path=work / "router_seq.log") as r:
            return sequential_outputs(RoutedGenerator(r.url, workers[c]), wl)

    return sequential_mismatches(configs, outputs)["configs"]


def dp_size_topology(
    model_dir: Path,
    args: argparse.Namespace,
    context: int,
    template: Path,
    workload: str,
    vocab: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One server with ``--dp-size N`` per configuration (SGLang's data-parallel controller routes
    inside the server, ``--load-balance-method round_robin``): the first workload once each."""
    from benchmarks.bench_client import ClientWorker

    if workload == "agent":
        return {"skipped": "dp-size topology runs a single-turn workload"}
    wl = workload_of(args, workload, context, vocab)
    pools = size_pools(wl.accounting, args.pool_fraction, args.min_running)
    out: dict[str, Any] = {"dp_size": args.dp_size, "workload": workload, "configs": {}}
    texts: dict[str, list[str]] = {}
    bind = "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.dp_size))
    with ClientWorker() as client:
        for c in [c for c in args.configs.split(",") if c]:
            srv = make_server(
                model_dir, c, pools,
                chunk=args.chunk, context=context, chat_template=template,
                log_path=args.work_dir / f"dp_{c}.log", env={"SGLANG_CPU_OMP_THREADS_BIND": bind},
                extra=("--enable-metrics", "--dp-size", str(args.dp_size)),
            )  # fmt: skip
            try:
                srv.start(timeout=900)
                rec = run_routed(
                    client,
                    srv.url,
                    [srv],
                    wl,
                    model_dir=model_dir,
                    max_concurrency=args.max_concurrency,
                    seed=args.seed,
                    out_file=args.work_dir / "client_dp.jsonl",
                    timeout=args.client_timeout,
                )
                out["configs"][c] = _compact(rec)
                texts[c] = rec["texts"]
                log(
                    f"[serving_router] dp-size {args.dp_size} {c}: prefilled "
                    f"{rec['prefilled_tokens']}, errors {rec['errors']}"
                )
            except Exception as exc:  # noqa: BLE001 - reported in the JSON: what stops the topology
                out["configs"][c] = {"error": str(exc)[-3000:]}
            finally:
                srv.stop()
    ref = texts.get("nocache")
    for c, t in texts.items():
        if ref is not None and c != "nocache":
            out["configs"][c]["mismatched_vs_nocache"] = text_mismatches(t, ref)
    return out


def _router_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "sglang-router " + version("sglang-router")
    except PackageNotFoundError:
        return "sglang-router not installed"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_router", description=__doc__.split("\n\n")[0]
    )
    add = ap.add_argument
    add(
        "--quick",
        action="store_true",
        help="smoke size: doc_qa, 16 requests, 1 repetition, no fault run; JSON under "
        "benchmarks/results/quick/",
    )
    add(
        "--configs",
        help=f"worker configurations, comma list of {','.join(CONFIGS)} (full: nocache,native_eb,sparse)",
    )
    add("--policies", help=f"routing policies, comma list of {','.join(POLICIES)} (default: both)")
    add("--workers", type=int, default=2, help="workers per configuration (default %(default)s)")
    add(
        "--max-concurrency",
        type=int,
        default=4,
        help="requests in flight through the router (default %(default)s)",
    )
    add(
        "--fault",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kill and restart a sparse worker mid-run (full: on)",
    )
    add(
        "--dp-size",
        type=int,
        default=0,
        help="also run one server with --dp-size N per config (0: skip; default)",
    )
    add_workload_arguments(ap, "serving_router", FULL_DEFAULTS, QUICK_DEFAULTS, output_len=8)
    return ap


def main(argv: list[str] | None = None) -> int:
    args, out, command = parse_run_args(build_parser(), argv, "serving_router", FULL_DEFAULTS, QUICK_DEFAULTS)
    doc = {"command": command, **run_router_bench(args)}
    path = write_json(out.stem, doc, out.parent)
    plot(doc, out.with_suffix(".png"))
    print(f"\nwrote {path} and {out.with_suffix('.png')} in {doc['wall_s']:.0f} s")
    for w in doc["workloads"].values():
        for p, f in (w.get("fault") or {}).items():
            print(
                f"fault run ({f['workload']}, {p}): {f['completed']}/{f['requests']} completed, "
                f"{f['errors']} errors seen by the client, {f['lost']} lost; restarted worker healthy "
                f"again: {f['router_reports_healthy_after']}, requests routed to it afterwards: "
                f"{f['rejoined_requests_on_restarted_worker']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

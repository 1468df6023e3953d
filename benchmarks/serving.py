"""Replay JSONL traces against a real SGLang CPU server with each cache policy; measure TTFT.

For every trace (default ``doc_qa`` and ``system_prompts``) and every configuration -- SGLang's
native cache on its GPU default path (``native_eb``: ``extra_buffer`` state strategy, overlap
schedule on; on the CPU through the project's platform, ``SGLANG_PLATFORM=sglang_sparse_cpu``) and on
``no_buffer`` (``native``: overlap off, page size 1), the ``sparse`` backend on extra_buffer with
``SGLANG_SPARSE_POLICY`` = ``sparse`` / ``marconi`` / ``lru`` and on no_buffer (``sparse_nb``), and
``--disable-radix-cache`` (reference) -- the script starts a fresh server (the
bench-size tiny hybrid model from :mod:`sglang_sparse.models.tiny`, random weights, where prefill
dominates), replays a prefix of the trace **sequentially** and records per request:

* TTFT: client-side latency of a ``max_new_tokens=1`` greedy request (prefill + one sample);
* prefilled tokens (``prompt_tokens - cached_tokens``) and cached tokens (SGLang ``meta_info``);
* the generated token, compared with the no-cache run (token equality).

Trace shrinking (deterministic, keeps prefix structure; real prompts are 10k-30k tokens): each input
``x`` becomes ``x[:n-T][::k] + x[n-T:]`` (every ``k``-th token of the head, the last ``T`` tokens
verbatim), truncated to the context; requests sharing a head prefix still share the (shorter)
prefix, their distinct tails stay distinct. Ids are remapped into the model vocabulary by a fixed
multiplicative hash. Multi-turn traces lose part of their turn-extends-turn structure under this map.

Outputs: ``benchmarks/results/serving.json`` and ``benchmarks/results/serving.png``. ``ttft_fit``:
the no-cache server's affine fit of TTFT on prefilled tokens and, per configuration and trace, the
requests above 3x that fit at their own prefilled tokens (the stalls a cached configuration
would add; on a quiet machine there are none); per request ``queue_s`` / ``forward_s`` (SGLang's
``ReqTimeStats``: queue wait, first forward to completion; the rest of the TTFT is HTTP, tokenizer
and detokenizer); per trace ``foreign_load``: CPU seconds other processes took during the run and
their share of the machine (a warning above 10%: slices run beside another benchmark show 1-13 s
TTFTs even without a cache).

    python benchmarks/serving.py --quick   # < 5 min: sparse vs native_eb, native, no cache; 8 requests
    python benchmarks/serving.py           # + sparse_nb, marconi, lru; 60 requests per trace

Prefilled tokens are deterministic (the acceptance figures: never more than the native cache of
the same state strategy on any prefix of a slice, share of the perfect-cache saving over it); TTFT
here is sequential and noisy, the comparison under load is ``benchmarks/serving_load.py``.

HiCache mode (``--hicache``; default traces ``doc_qa``, ``system_prompts``, ``agent``): SGLang's
hierarchical cache (``--enable-hierarchical-cache --hicache-write-policy write_back``, a host tier
below a small device pool) on the extra_buffer strategy. One fresh server per trace and config:
``native_eb_hicache`` (SGLang's cache + HiCache), ``sparse_hicache`` (``--radix-cache-backend
sparse`` + HiCache), ``sparse_small`` (sparse without HiCache, the same device pool) and
``nocache`` (token equality). Sizes per trace (:func:`hicache_sizing`) from the slice's KV
footprint, the tokens of a trie of all its shrunk prompts (:func:`footprint_tokens`): device pool
(``--max-total-tokens``) ~10% of it but at least the longest prompt + 64, rounded up to 64; host
~50% of it via ``--hicache-ratio`` = host / device (at least 1.25); state slots
(``--max-mamba-cache-size``) ~10% of the requests but at least 8 (the host holds ratio x as many).
Acceptance: ``sparse_hicache`` prefills no more tokens than ``native_eb_hicache`` at any prefix of a
slice (cumulative prefilled tokens), and fewer than ``sparse_small`` in total. Outputs:
``benchmarks/results/serving_hicache.json`` and ``.png`` (cumulative prefilled tokens).

    python benchmarks/serving.py --hicache             # 60 requests per trace
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: `python benchmarks/serving.py`
    sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS, bar, pyplot, results_dir, save  # noqa: E402
from benchmarks.serving_load import server_cpu  # noqa: E402
from benchmarks.stats import busy_cpu_seconds, own_cpu_seconds  # noqa: E402

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


def load_requests(
    name: str, n: int, *, target: int, tail: int, max_len: int, vocab: int, start: int = 0
) -> list[list[int]]:
    """Requests ``start .. start + n`` of ``traces/build/<name>.jsonl``, shrunk (see :func:`shrink`)."""
    from sglang_sparse.sim.trace import load_trace

    path = TRACES / f"{name}.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} missing; run `python -m sglang_sparse.traces build all`")
    reqs = load_trace(path)[start : start + n]
    lens = sorted(len(r.input_tokens) for r in reqs)
    stride = max(1, -(-lens[len(lens) // 2] // target))
    return [
        shrink(list(r.input_tokens), stride=stride, tail=tail, max_len=max_len, vocab=vocab) for r in reqs
    ]


#: ``name -> (extra args, env, state strategy)`` (:data:`benchmarks.serving_load.CONFIGS`'s
#: shape); ``native`` / ``native_eb`` are the baselines of their strategy (see :func:`baseline_of`).
Config = tuple[Sequence[str], dict[str, str], str]


#: the slices' configurations (``--configs`` picks among them; no cache always runs: token equality)
DEFAULT_CONFIGS = ("nocache", "native", "native_eb", "sparse", "sparse_nb", "marconi", "lru")
QUICK_CONFIGS = ("nocache", "native", "native_eb", "sparse")


def configs(quick: bool, names: Sequence[str] | None = None) -> dict[str, Config]:
    """The slices' configurations, as :data:`benchmarks.serving_load.CONFIGS` defines them:
    ``names`` (plus ``nocache``), else the quick or the full set."""
    from benchmarks.serving_load import CONFIGS

    if names:
        unknown = sorted(set(names) - set(CONFIGS))
        if unknown:
            raise SystemExit(f"error: unknown configuration(s) {unknown}; valid: {', '.join(CONFIGS)}")
        names = ["nocache", *(n for n in names if n != "nocache")]
    else:
        names = list(QUICK_CONFIGS if quick else DEFAULT_CONFIGS)
    return {n: CONFIGS[n] for n in names}


def baseline_of(strategy: str) -> str:
    """The native configuration a config on ``strategy`` is compared with."""
    return "native_eb" if strategy == "extra_buffer" else "native"


def run_config(
    model_dir: Path,
    name: str,
    extra: list[str],
    env: dict,
    traces: dict,
    progress: Any,
    context: int,
    log_dir: Path = RESULTS,
    strategy: str = "no_buffer",
    kv_tokens: int = KV_TOKENS,
    state_slots: int = STATE_SLOTS,
) -> dict[str, Any]:
    import requests

    from sglang_sparse.testing.server import SGLangServer, strategy_setup

    base, strategy_env = strategy_setup(strategy)
    srv = SGLangServer(
        model_dir,
        extra_args=[
            "--chunked-prefill-size",
            str(CHUNK),
            "--mem-fraction-static",
            "0.3",
            "--enable-request-time-stats-logging",  # each request's queue and forward time (the log)
            *extra,
        ],
        env={"SGLANG_SPARSE_LOG_EVERY": "0", **strategy_env, **env},
        base_args=base,
        context_length=context,
        max_total_tokens=kv_tokens,
        max_mamba_cache_size=state_slots,
        log_path=log_dir / f"serving_{name}.log",
    )
    srv.start(timeout=600)
    out: dict[str, Any] = {"startup_s": srv.startup_seconds, "strategy": strategy}
    try:
        srv.generate([5, 6, 7], 1)  # warm-up outside the measurement
        for tname, reqs in traces.items():
            srv.flush_cache()
            load = ForeignLoad(srv)
            rows = []
            for i, p in enumerate(reqs):
                t0 = time.perf_counter()
                r = srv.generate(p, 1, rid=f"{tname}-{i}")
                rows.append(
                    {
                        "ttft": time.perf_counter() - t0,
                        "prompt": r.prompt_tokens,
                        "cached": r.cached_tokens,
                        "token": r.output_ids,
                    }
                )
                progress.update(1)
            stats = None
            if extra and extra[0] == "--radix-cache-backend":
                info = requests.get(f"{srv.url}/server_info", timeout=60).json()
                stats = info["internal_states"][0].get("sparse_cache")
            foreign = load.stop()
            out[tname] = {"rows": rows, "sparse_stats": stats, "foreign_load": foreign}
            if foreign["share"] > FOREIGN_LOAD_WARN:
                print(
                    f"warning: {name}/{tname}: other processes used {foreign['share']:.0%} of the "
                    "machine's CPU during the run: its TTFT says little about speed",
                    file=sys.stderr,
                )
        timeline = parse_time_stats(Path(srv.log_path).read_text(errors="replace"))
        for tname in traces:
            for i, row in enumerate(out[tname]["rows"]):
                row["queue_s"], row["forward_s"] = timeline.get(f"{tname}-{i}", (None, None))
    finally:
        srv.stop()
    return out


#: share of the machine's CPU time used by processes other than the server and this benchmark
#: above which a run's TTFT is flagged (a sequential slice run beside another benchmark stalls)
FOREIGN_LOAD_WARN = 0.10


class ForeignLoad:
    """CPU seconds the rest of the machine (every process but ``srv``'s tree and this benchmark's
    own process) spends between construction and :meth:`stop`; ``share`` = that over the wall time
    x CPUs."""

    def __init__(self, srv: Any) -> None:
        self._srv = srv
        self._t0 = time.perf_counter()
        self._busy0, self._own0 = busy_cpu_seconds(), own_cpu_seconds()
        self._server0 = server_cpu(srv)["tree"]

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self._t0
        busy = busy_cpu_seconds() - self._busy0
        server = server_cpu(self._srv)["tree"] - self._server0
        own = own_cpu_seconds() - self._own0
        foreign = max(busy - server - own, 0.0)
        cpus = os.cpu_count() or 1
        return {
            "wall_s": wall,
            "foreign_cpu_s": foreign,
            "server_cpu_s": server,
            "share": foreign / (wall * cpus),
        }


_TIME_STATS = re.compile(
    r"ReqTimeStats\(rid=([^,]+),.*?queue_duration=([0-9.]+)ms, forward_duration=([0-9.]+)ms"
)


def parse_time_stats(log: str) -> dict[str, tuple[float, float]]:
    """``rid -> (queue s, forward s)`` from the scheduler's ``ReqTimeStats`` log lines
    (``--enable-request-time-stats-logging``): the time a request waited in SGLang's queue and the
    time from its first forward to its completion. The rest of a client-side TTFT is the HTTP,
    tokenizer and detokenizer path."""
    return {m[1]: (float(m[2]) / 1e3, float(m[3]) / 1e3) for m in _TIME_STATS.finditer(log)}


def ideal_prefilled(prompts: list[list[int]]) -> int:
    """Lower bound on the tokens any prefix cache must prefill for ``prompts`` replayed in order:
    an unbounded cache with a state at every position reuses each prompt's longest common prefix
    with any earlier prompt (at least the last token is always computed)."""
    from benchmarks.serving_load import prefix_accounting

    return prefix_accounting(prompts, prompts)["perfect_prefilled"]


def _cumulative_prefilled(rows: list[dict]) -> list[int]:
    out, tot = [], 0
    for r in rows:
        tot += r["prompt"] - r["cached"]
        out.append(tot)
    return out


def config_stats(rows: list[dict], ref: list[int]) -> dict[str, Any]:
    """One config's replay of a slice (``rows``): TTFT (mean, median, p95), tokens, and token
    equality with the no-cache run's tokens ``ref``."""
    ttft = [r["ttft"] for r in rows]
    q = sorted(ttft)
    return {
        "requests": len(rows),
        "ttft_mean": statistics.fmean(ttft) if ttft else None,
        "ttft_median": statistics.median(ttft) if ttft else None,
        "ttft_p95": q[min(len(q) - 1, int(round(0.95 * (len(q) - 1))))] if q else None,
        "prompt_tokens": sum(r["prompt"] for r in rows),
        "cached_tokens": sum(r["cached"] for r in rows),
        "prefilled_tokens": sum(r["prompt"] - r["cached"] for r in rows),
        "tokens_equal_nocache": [r["token"] for r in rows] == ref,
        "mismatches": sum(a["token"] != b for a, b in zip(rows, ref, strict=True)),
    }


def versus_baseline(rows: list[dict], base_rows: list[dict], base: str, ideal: int | None) -> dict[str, Any]:
    """A config against the baseline ``base`` on the same slice: the prefixes (1-based) where it
    prefilled more tokens in total, and, with the perfect cache's prefilled tokens ``ideal``, its
    share of the most any cache saves over the baseline."""
    mine, nat = _cumulative_prefilled(rows), _cumulative_prefilled(base_rows)
    worse = [i + 1 for i, (x, y) in enumerate(zip(mine, nat, strict=True)) if x > y]
    out: dict[str, Any] = {f"prefixes_worse_than_{base}": worse}
    room = nat[-1] - ideal if ideal is not None and nat else 0
    if room > 0:
        out[f"share_of_perfect_saving_vs_{base}"] = (nat[-1] - (mine[-1] if mine else 0)) / room
    return out


def summarize(results: dict, trace_names: list[str], ideal: dict[str, int] | None = None) -> dict:
    """Per trace and config: TTFT, tokens, token equality, and against each native baseline present
    (``native``, ``native_eb``): TTFT ratio, the prefixes of the slice where the config prefilled
    more in total, and its share of the perfect cache's saving over that baseline."""
    summary: dict[str, dict] = {}
    for tname in trace_names:
        ref = [r["token"] for r in results["nocache"][tname]["rows"]]
        s: dict[str, dict] = {}
        for cname, res in results.items():
            s[cname] = {"strategy": res.get("strategy", "no_buffer"), **config_stats(res[tname]["rows"], ref)}
        for base in ("native", "native_eb"):
            if base not in s:
                continue
            b = s[base]
            for cname, d in s.items():
                d[f"ttft_mean_vs_{base}"] = d["ttft_mean"] / b["ttft_mean"] if b["ttft_mean"] else None
                d.update(
                    versus_baseline(
                        results[cname][tname]["rows"],
                        results[base][tname]["rows"],
                        base,
                        ideal[tname] if ideal is not None else None,
                    )
                )
        if ideal is not None:
            # what no cache can beat: a perfect cache's prefilled tokens
            s["perfect_cache_bound"] = {
                "prefilled_tokens": ideal[tname],
                **{
                    f"prefilled_vs_{base}": ideal[tname] / max(s[base]["prefilled_tokens"], 1)
                    for base in ("native", "native_eb")
                    if base in s
                },
            }
        summary[tname] = s
    return summary


#: a request whose TTFT exceeds this many times the no-cache affine fit at its prefilled tokens is
#: an outlier (issue 46: the stalls of the sequential slices)
OUTLIER_FACTOR = 3.0


def ttft_fit(results: dict, trace_names: list[str]) -> dict[str, Any]:
    """The affine fit ``TTFT = a + b * prefilled tokens`` of the no-cache server's requests (every
    trace; each is one prefill of its whole prompt and one sampled token), and per configuration
    and trace the requests whose TTFT exceeds :data:`OUTLIER_FACTOR` x the fit at their prefilled
    tokens (``(index, ttft s, prefilled, ratio)``) with the largest ratio. Seconds, tokens."""
    from scipy.stats import linregress

    xs, ys = [], []
    for t in trace_names:
        for r in results["nocache"][t]["rows"]:
            xs.append(r["prompt"] - r["cached"])
            ys.append(r["ttft"])
    fit = linregress(xs, ys)
    a, b = float(fit.intercept), float(fit.slope)
    out: dict[str, Any] = {
        "intercept_s": a,
        "slope_s_per_token": b,
        "r2": float(fit.rvalue**2),
        "configs": {},
    }
    for cname, res in results.items():
        per: dict[str, Any] = {}
        for t in trace_names:
            ratios = []
            for i, r in enumerate(res[t]["rows"]):
                pre = r["prompt"] - r["cached"]
                ratios.append((i, r["ttft"], pre, r["ttft"] / max(a + b * pre, 1e-6)))
            per[t] = {
                "max_ratio": max(x[3] for x in ratios),
                "outliers": [list(x) for x in ratios if x[3] > OUTLIER_FACTOR],
            }
        out["configs"][cname] = per
    return out


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
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
    save(fig, path, dpi=120)


# --------------------------------------------------------------------------------------------------
# HiCache mode (--hicache): a small device pool with a host tier below it, see the module docstring

HICACHE_TRACES = "doc_qa,system_prompts,agent"
HICACHE_WRITE_POLICY = "write_back"
#: shares of the slice's footprint: device pool, host tier; share of the requests: state slots
HICACHE_DEVICE_SHARE, HICACHE_HOST_SHARE, HICACHE_STATE_SHARE = 0.10, 0.50, 0.10
HICACHE_MARGIN, HICACHE_ALIGN, HICACHE_MIN_STATES, HICACHE_MIN_RATIO = 64, 64, 8, 1.25


def footprint_tokens(requests: list[list[int]]) -> int:
    """KV footprint of a slice in tokens: what an unbounded prefix cache holds after the slice (every
    distinct prefix counted once: the tokens of a radix tree of all ``requests``)."""
    from benchmarks.serving_load import prefix_accounting

    return prefix_accounting(requests, requests)["footprint_tokens"]


def hicache_sizing(
    requests: list[list[int]],
    *,
    device_share: float = HICACHE_DEVICE_SHARE,
    host_share: float = HICACHE_HOST_SHARE,
    state_share: float = HICACHE_STATE_SHARE,
    margin: int = HICACHE_MARGIN,
    align: int = HICACHE_ALIGN,
    min_states: int = HICACHE_MIN_STATES,
    min_ratio: float = HICACHE_MIN_RATIO,
) -> dict[str, Any]:
    """Device pool, host tier and state slots of a HiCache server for ``requests`` (a non-empty
    slice): device ``device_share`` of :func:`footprint_tokens` but at least the longest prompt +
    ``margin``, rounded up to ``align``; host ``host_share`` of the footprint as SGLang's
    ``--hicache-ratio`` (host / device, rounded to 2 decimals, at least ``min_ratio``); state slots
    ``state_share`` of the requests but at least ``min_states``."""
    fp = footprint_tokens(requests)
    floor = max(len(p) for p in requests) + margin
    device = -(-max(-(-fp * device_share // 1), floor) // align) * align
    ratio = max(round(host_share * fp / device, 2), min_ratio)
    states = max(-(-len(requests) * state_share // 1), min_states)
    return {
        "footprint_tokens": fp,
        "device_tokens": int(device),
        "device_floor": floor,
        "device_share": device / fp,
        "hicache_ratio": ratio,
        "host_tokens": int(device * ratio),
        "host_share": device * ratio / fp,
        "state_slots": int(states),
        "host_state_slots": int(states * ratio),
    }


def hicache_configs(ratio: float) -> dict[str, Config]:
    """The HiCache mode's configs; ``ratio``: ``--hicache-ratio`` (host / device)."""
    sparse = ["--radix-cache-backend", "sparse"]
    env = {"SGLANG_SPARSE_POLICY": "sparse"}
    hicache = [
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        str(ratio),
        "--hicache-write-policy",
        HICACHE_WRITE_POLICY,
    ]
    return {
        "nocache": (["--disable-radix-cache"], {}, "no_buffer"),
        "native_eb_hicache": (hicache, {}, "extra_buffer"),
        "sparse_hicache": ([*sparse, *hicache], env, "extra_buffer"),
        "sparse_small": (sparse, env, "extra_buffer"),
    }


def hicache_summary(results: dict[str, dict], ideal: int | None = None) -> dict[str, Any]:
    """One trace of the HiCache mode: ``results[config] = {"rows": [...], ...}`` (``nocache``,
    ``native_eb_hicache``, ``sparse_hicache``, ``sparse_small``). Per config: tokens, TTFT, token
    equality with ``nocache``, the prefixes of the slice where it prefilled more in total than
    ``native_eb_hicache`` and its share of the perfect cache's saving over it; plus the acceptance:
    sparse_hicache never above native_eb_hicache at any prefix, below sparse_small in total."""
    ref = [r["token"] for r in results["nocache"]["rows"]]
    base = "native_eb_hicache"
    base_rows = results[base]["rows"]
    configs_ = {
        cname: {**config_stats(res["rows"], ref), **versus_baseline(res["rows"], base_rows, base, ideal)}
        for cname, res in results.items()
    }
    sp, small = configs_["sparse_hicache"], configs_["sparse_small"]
    worse = sp[f"prefixes_worse_than_{base}"]
    acceptance = {
        f"sparse_hicache_never_above_{base}": not worse,
        "first_prefix_above": worse[0] if worse else None,
        "sparse_hicache_below_sparse_small": sp["prefilled_tokens"] < small["prefilled_tokens"],
        "tokens_equal_nocache": all(d["tokens_equal_nocache"] for d in configs_.values()),
    }
    return {"configs": configs_, "perfect_cache_prefilled": ideal, "acceptance": acceptance}


def plot_hicache(raw: dict, summary: dict, path: Path) -> None:
    """Cumulative prefilled tokens per request, one panel per trace, one line per config."""
    plt = pyplot()
    if plt is None:
        return
    tnames = list(raw)
    fig, axes = plt.subplots(1, len(tnames), figsize=(5.5 * len(tnames), 4), squeeze=False)
    for ax, t in zip(axes[0], tnames, strict=True):
        for cname, res in raw[t]["configs"].items():
            cum = _cumulative_prefilled(res["rows"])
            ax.plot(range(1, len(cum) + 1), cum, label=cname)
        sz = raw[t]["sizing"]
        ax.set_title(
            f"{t}: device {sz['device_tokens']} / host {sz['host_tokens']} of {sz['footprint_tokens']} tok",
            fontsize=9,
        )
        ax.set_xlabel("request")
        ax.set_ylabel("cumulative prefilled tokens")
        ax.legend(fontsize=7)
    save(fig, path, dpi=120)


def run_hicache(
    args: argparse.Namespace, model_dir: Path, traces: dict[str, list[list[int]]], context: int
) -> int:
    """The ``--hicache`` mode: one server per trace and config (sizes per trace), sequential replay."""
    sizing = {t: hicache_sizing(v) for t, v in traces.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(len(hicache_configs(2.0)) * len(v) for v in traces.values())
    t0 = time.time()
    raw: dict[str, Any] = {}
    with bar(total, "serving hicache") as progress:
        for t, reqs in traces.items():
            sz = sizing[t]
            raw[t] = {"sizing": sz, "configs": {}}
            for cname, (extra, env, strategy) in hicache_configs(sz["hicache_ratio"]).items():
                progress.set_postfix_str(f"{t}/{cname}")
                res = run_config(
                    model_dir,
                    f"hicache_{t}_{cname}",
                    extra,
                    env,
                    {t: reqs},
                    progress,
                    context,
                    args.out.parent,
                    strategy,
                    kv_tokens=sz["device_tokens"],
                    state_slots=sz["state_slots"],
                )
                raw[t]["configs"][cname] = {
                    "strategy": strategy,
                    "args": extra,
                    "startup_s": res["startup_s"],
                    **res[t],
                }
    summary = {t: hicache_summary(raw[t]["configs"], ideal_prefilled(v)) for t, v in traces.items()}
    wall = time.time() - t0
    doc = {
        "model": {"arch": args.arch, "size": args.size, "path": str(model_dir)},
        "requests_per_trace": {t: len(v) for t, v in traces.items()},
        "prompt_lengths": {t: [len(p) for p in v] for t, v in traces.items()},
        "server": {"chunked_prefill_size": CHUNK, "hicache_write_policy": HICACHE_WRITE_POLICY},
        "sizing": sizing,
        "wall_seconds": wall,
        "summary": summary,
        "raw": raw,
    }
    args.out.write_text(json.dumps(doc, indent=1))
    plot_hicache(raw, summary, args.out.with_suffix(".png"))
    for t, s in summary.items():
        sz = sizing[t]
        print(
            f"{t}: footprint {sz['footprint_tokens']} tok, device {sz['device_tokens']} "
            f"({sz['device_share']:.0%}), host {sz['host_tokens']} ({sz['host_share']:.0%}, ratio "
            f"{sz['hicache_ratio']}), state slots {sz['state_slots']} (host {sz['host_state_slots']}); "
            f"perfect cache prefills {s['perfect_cache_prefilled']}"
        )
        for c, d in s["configs"].items():
            share = d.get("share_of_perfect_saving_vs_native_eb_hicache")
            print(
                f"  {c:18s} prefilled {d['prefilled_tokens']:6d} cached {d['cached_tokens']:6d}  "
                f"tokens==nocache {d['tokens_equal_nocache']} ({d['mismatches']} mismatches)  "
                f"ttft mean {d['ttft_mean']:.3f}s  prefixes above native_eb_hicache: "
                f"{len(d['prefixes_worse_than_native_eb_hicache'])}"
                + (f"  perfect-saving share {share:.0%}" if share is not None else "")
            )
        a = s["acceptance"]
        print(
            f"  acceptance: sparse_hicache <= native_eb_hicache at every prefix "
            f"{a['sparse_hicache_never_above_native_eb_hicache']}"
            + (f" (first above at prefix {a['first_prefix_above']})" if a["first_prefix_above"] else "")
            + f"; sparse_hicache < sparse_small {a['sparse_hicache_below_sparse_small']}; "
            f"tokens equal {a['tokens_equal_nocache']}"
        )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {wall:.0f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sparse/native/no-cache, fewer requests (< 5 min)")
    ap.add_argument(
        "--hicache",
        action="store_true",
        help="HiCache mode: native_eb/sparse with HiCache, sparse without, small device pool per trace",
    )
    ap.add_argument("--traces", help=f"default doc_qa,system_prompts ({HICACHE_TRACES} with --hicache)")
    ap.add_argument("--requests", type=int, help="requests per trace (default 8 quick, 60 full)")
    ap.add_argument("--target-len", type=int, default=768, help="median shrunk prompt length")
    ap.add_argument(
        "--size",
        help="tiny-model size preset (default: tiny; the bench preset makes prefill dominate TTFT "
        "but one 800-token prefill of it takes minutes on 2 shared cores)",
    )
    ap.add_argument(
        "--arch",
        default="qwen3_next",
        help="tiny-model architecture (sglang_sparse.models.tiny.ARCHS), e.g. nemotron_h (Mamba2)",
    )
    ap.add_argument(
        "--mamba-chunk-size",
        type=int,
        default=128,
        help="SSM chunk (tokens) of a Mamba2 --arch: its state grid (real checkpoints: 128-256)",
    )
    ap.add_argument(
        "--configs", help=f"comma-separated configurations (default: {','.join(DEFAULT_CONFIGS)})"
    )
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/sglang_sparse_bench_model"))
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results[/quick]/serving.json)"
    )
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = results_dir(args.quick) / ("serving_hicache.json" if args.hicache else "serving.json")
    if args.traces is None:
        args.traces = HICACHE_TRACES if args.hicache else "doc_qa,system_prompts"

    from sglang_sparse.models.tiny import ARCHS, MAMBA2_ARCHS, SIZES, make_tiny_model

    if args.arch not in ARCHS:
        raise SystemExit(f"error: unknown --arch {args.arch!r}; valid: {', '.join(ARCHS)}")
    n = args.requests or (8 if args.quick else 60)
    args.size = args.size or "tiny"
    if args.model_dir == Path("/tmp/sglang_sparse_bench_model"):
        suffix = "" if args.arch == "qwen3_next" else f"_{args.arch}"
        args.model_dir = Path(f"/tmp/sglang_sparse_serving_{args.size}{suffix}")
    vocab = SIZES[args.size].vocab_size
    context = min(4096, SIZES[args.size].max_position_embeddings)
    overrides = {"mamba_chunk_size": args.mamba_chunk_size} if args.arch in MAMBA2_ARCHS else {}
    model_dir = make_tiny_model(args.model_dir, arch=args.arch, size=args.size, seed=0, **overrides)
    trace_names = [t for t in args.traces.split(",") if t]
    traces = {
        t: load_requests(t, n, target=args.target_len, tail=48, max_len=context - 16, vocab=vocab)
        for t in trace_names
    }
    if args.hicache:
        return run_hicache(args, model_dir, traces, context)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfgs = configs(args.quick, [c for c in (args.configs or "").split(",") if c])
    total = len(cfgs) * sum(len(v) for v in traces.values())
    t0 = time.time()
    results: dict[str, Any] = {}
    with bar(total, "serving replay") as progress:
        for cname, (extra, env, strategy) in cfgs.items():
            progress.set_postfix_str(cname)
            results[cname] = run_config(
                model_dir, cname, extra, env, traces, progress, context, args.out.parent, strategy
            )
    ideal = {t: ideal_prefilled(v) for t, v in traces.items()}
    summary = summarize(results, trace_names, ideal)
    fit = ttft_fit(results, trace_names)
    doc = {
        "model": {"arch": args.arch, "size": args.size, "path": str(model_dir), **overrides},
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
        "ttft_fit": fit,
        "raw": results,
    }
    args.out.write_text(json.dumps(doc, indent=1))
    plot(summary, args.out.with_suffix(".png"))
    for t, s in summary.items():
        for c, d in s.items():
            if c == "perfect_cache_bound":
                vs = "  ".join(
                    f"{v:.2f}x {k[len('prefilled_vs_') :]}'s" for k, v in d.items() if k != "prefilled_tokens"
                )
                print(f"{t:15s} perfect cache would prefill {d['prefilled_tokens']} tokens = {vs}")
                continue
            base = baseline_of(d["strategy"])
            r = d.get(f"ttft_mean_vs_{base}")
            share = d.get(f"share_of_perfect_saving_vs_{base}")
            worse = d.get(f"prefixes_worse_than_{base}", [])
            print(
                f"{t:15s} {c:9s} ({d['strategy']}) ttft mean {d['ttft_mean']:.3f}s "
                f"median {d['ttft_median']:.3f}s "
                f"p95 {d['ttft_p95']:.3f}s  prefilled {d['prefilled_tokens']} cached {d['cached_tokens']}  "
                f"tokens==nocache {d['tokens_equal_nocache']}  vs {base}: "
                + (f"ttft {r:.2f}x" if r is not None else "-")
                + (f"  perfect-saving share {share:.0%}" if share is not None else "")
                + f"  prefixes worse: {len(worse)}"
            )
    print(
        f"TTFT fit (no cache): {fit['intercept_s'] * 1e3:.1f} ms + "
        f"{fit['slope_s_per_token'] * 1e6:.1f} us/token (r2 {fit['r2']:.2f}); "
        f"requests above {OUTLIER_FACTOR:g}x the fit at their prefilled tokens:"
    )
    for cname, per in fit["configs"].items():
        worst = max(v["max_ratio"] for v in per.values())
        n_out = sum(len(v["outliers"]) for v in per.values())
        busy = max(results[cname][t]["foreign_load"]["share"] for t in trace_names)
        print(f"  {cname:9s} {n_out} (largest ratio {worst:.2f}); other processes' CPU share <= {busy:.1%}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Serving comparisons under real load, with SGLang's own benchmark client.

Every configuration (:data:`CONFIGS`) runs as its own real SGLang CPU server, all at once on
different loopback ports (the random-weight tiny hybrid Qwen3-Next of :mod:`sglang_sparse.models.tiny`,
word-level tokenizer):

* ``native_eb`` - SGLang's radix cache on its GPU default path (``extra_buffer`` Mamba strategy,
  overlap schedule on; on the CPU through ``SGLANG_PLATFORM=sglang_sparse_cpu``), the baseline of
  every ratio; ``native_eb_py`` the same on SGLang's Python tree core (the core the sparse backend's
  component hooks need; not in the default set);
* ``native`` - SGLang's radix cache on ``no_buffer`` (a state at chunk ends; overlap off);
* ``sparse`` - ``--radix-cache-backend sparse``, ``SGLANG_SPARSE_POLICY=sparse``, on extra_buffer;
  ``sparse_nb`` the same on no_buffer; ``lru`` / ``marconi`` the backend with those policies;
  ``sparse_a0`` / ``sparse_a8`` the eviction weight fixed (``SGLANG_SPARSE_ALPHA``, no tuning replay);
  ``sparse_cut`` states planned by chunk cuts (``SGLANG_SPARSE_CAPTURE=cut``; not in the default set);
* ``nocache`` - ``--disable-radix-cache``, the reference for token equality;
* ``NAME#2`` (any suffix after ``#``) - a second, independent server of ``NAME``: the A/A control, how
  far two server processes of one configuration differ (the floor for reading any A/B ratio).

Server flags on top of :data:`sglang_sparse.testing.server.CPU_SERVER_ARGS`: the tokenizer on (the
client sends text and times streamed text; ``--sleep-on-idle`` is among the CPU flags),
``--chunked-prefill-size --chunk``, a chat template and the pools below. Load: SGLang's client
(``sglang.benchmark.serving`` via :mod:`benchmarks.bench_client`, one persistent process), Poisson
arrivals at each ``--rates`` value plus one run capped at ``--max-concurrency`` requests in flight
(rate ``inf``); it measures req/s, output tok/s, TTFT p50/p95/p99 and ITL p50/p95 (ms).

Workloads (``python -m sglang_sparse.traces build all --out traces/build``): ``doc_qa``,
``system_prompts``, ``rag``: the first ``--requests`` of the trace shrunk by
:func:`benchmarks.serving.load_requests` (median prompt ``--target-len`` tokens, last 48 verbatim),
the client's ``custom`` dataset, written so that the client's seeded shuffle sends them in trace order
(checked per run from the prompt lengths the server reports). ``agent``: the first
``--agent-sessions`` SWE-agent sessions, ``--agent-turns`` turns each, as the ``agentic-trace``
dataset (chat endpoint, template :data:`benchmarks.bench_client.WORD_CHAT_TEMPLATE`: each prompt =
previous prompt + the server's reply + the new message; every turn's new tokens shrunk by one stride,
median last prompt ~``--agent-target-len``); its rates are sessions/s (``--agent-rates``).

Pools, per workload, put the cache under contention: ``--max-total-tokens`` = max(``--pool-fraction``
x the unique-prefix footprint (the distinct tokens of all prompts + outputs: their radix tree), 2 x
the longest sequence); ``--max-mamba-cache-size`` = 5 x ``--min-running`` working slots +
``--pool-fraction`` x the reuse points (distinct depths at which a request reuses an earlier sequence:
the states a perfect cache needs). The JSON records both pools and the fractions they are.

Repetitions are interleaved: per workload every server starts once; each repetition runs every rate
point on every configuration in a rotated order, flushing the cache before each run. Cells: median and
spread (min-max, ``--spread iqr``) over repetitions. Ratios vs ``--baselines`` are paired per
repetition, claimed only when their spread excludes 1 (else "n.s."); ``sign_test_p`` is the two-sided
sign-test p-value of n ratios all on one side of 1 (0.25 for n=3: a weak test).

Per run also: prompt, cached and prefilled tokens (per-request ``cached_tokens``), the sparse
counters (``/server_info`` before/after; alpha carries over flushes), server and scheduler CPU
seconds per completed request and prefill forwards; per workload the perfect-cache bound (each prompt's
longest common prefix with an earlier sequence reused, at least its last token computed).
``ttft_vs_prefill`` (per rate point, :func:`ttft_vs_prefill`): per repetition the ratio of mean TTFT,
of prefilled tokens and ``gap`` = TTFT ratio / prefilled ratio - 1. Read it at the lowest rate
(queueing makes TTFT non-linear in prefill work); TTFT has a fixed part per request, so the gap reads
high when the prefilled ratio is well below 1; with noisy runs add ``NAME#2`` servers and read
``pooled_gap``. ``benchmarks/ttft_paired.py`` pairs requests one by one.

Token equality: every run's greedy outputs vs the ``nocache`` run of the same rate point and
repetition (``nocache`` runs vs each other too). If any differ (CPU batching can change a greedy
token), or with ``--equality always``, a sequential greedy pass through every server
(:func:`sequential_outputs`) separates a cache bug from batching effects.

Outputs: ``benchmarks/results/serving_load.json`` (written after each workload with ``"partial":
true``, then once more at the end) and ``serving_load.png`` (TTFT p50, TTFT p95 and req/s vs load
point, one column per workload); ``--quick`` writes under ``benchmarks/results/quick/``. Server logs
and datasets go to ``--work-dir``. A storm (every request at once): ``--rates inf --max-concurrency 0``.

    python -m benchmarks.serving_load --quick   # doc_qa, 16 requests at 4/s and capped at 4; ~5 min
    python -m benchmarks.serving_load           # every workload, the default configs; ~1 h on 2 cores
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/serving_load.py` as well as `-m`
    sys.path.insert(0, str(ROOT))

from benchmarks._common import bar  # noqa: E402 - after the sys.path set-up above
from benchmarks.stats import (  # noqa: E402
    Spread,
    claim,
    fmt_ratio,
    fmt_spread,
    mem_available_gb,
    paired_ratios,
    pooled_gap,
    sign_test_p,
    spread,
)

TRACES = ROOT / "traces" / "build"

_SPARSE, _POLICY = ("--radix-cache-backend", "sparse"), {"SGLANG_SPARSE_POLICY": "sparse"}
#: configuration name -> (extra server flags, extra environment, Mamba state strategy)
CONFIGS: dict[str, tuple[tuple[str, ...], dict[str, str], str]] = {
    "native_eb": ((), {}, "extra_buffer"),
    "native_eb_py": ((), {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}, "extra_buffer"),
    "native": ((), {}, "no_buffer"),
    "sparse": (_SPARSE, _POLICY, "extra_buffer"),
    "sparse_nb": (_SPARSE, _POLICY, "no_buffer"),
    "lru": (_SPARSE, {"SGLANG_SPARSE_POLICY": "lru"}, "extra_buffer"),
    "marconi": (_SPARSE, {"SGLANG_SPARSE_POLICY": "marconi"}, "extra_buffer"),
    "sparse_cut": (_SPARSE, {**_POLICY, "SGLANG_SPARSE_CAPTURE": "cut"}, "extra_buffer"),
    "sparse_a0": (_SPARSE, {**_POLICY, "SGLANG_SPARSE_ALPHA": "0"}, "extra_buffer"),
    "sparse_a8": (_SPARSE, {**_POLICY, "SGLANG_SPARSE_ALPHA": "8"}, "extra_buffer"),
    "nocache": (("--disable-radix-cache",), {}, "no_buffer"),
}
#: configurations served by the sparse backend (their /server_info carries the sparse statistics)
SPARSE_BACKEND = tuple(c for c, (flags, _, _) in CONFIGS.items() if "--radix-cache-backend" in flags)


def config_base(name: str) -> str:
    """The configuration a server name runs: ``lru#2`` is a second, independent ``lru`` server."""
    return name.split("#", 1)[0]


def aa_pairs(configs: Sequence[str]) -> list[tuple[str, str]]:
    """``(second, first)`` for every second instance in ``configs`` (``("lru#2", "lru")``)."""
    return [(c, config_base(c)) for c in configs if c != config_base(c)]


def is_sparse_backend(name: str) -> bool:
    """Does server ``name`` run the sparse backend (its /server_info carries sparse statistics)?"""
    return config_base(name) in SPARSE_BACKEND


DATASET = {"doc_qa": "custom", "system_prompts": "custom", "rag": "custom", "agent": "agentic-trace"}

#: client metric key -> (label, unit, higher is better)
METRICS: dict[str, tuple[str, str, bool]] = {
    "request_throughput": ("req/s", "req/s", True),
    "output_throughput": ("out tok/s", "tok/s", True),
    "mean_ttft_ms": ("TTFT mean", "ms", False),
    "median_ttft_ms": ("TTFT p50", "ms", False),
    "p95_ttft_ms": ("TTFT p95", "ms", False),
    "p99_ttft_ms": ("TTFT p99", "ms", False),
    "median_itl_ms": ("ITL p50", "ms", False),
    "p95_itl_ms": ("ITL p95", "ms", False),
}
#: measured on the server per run: CPU seconds (user + system) per completed request of the whole
#: server process tree and of its scheduler process, and the prefill forwards it ran
SERVER_METRICS: dict[str, tuple[str, str, bool]] = {
    "cpu_s_per_request": ("server CPU/req", "s", False),
    "scheduler_cpu_s_per_request": ("scheduler CPU/req", "s", False),
    "prefill_forwards": ("prefill fwds", "", False),
}
ALL_METRICS = {**METRICS, **SERVER_METRICS}
#: token counts per run (sums over the run's requests)
TOKEN_KEYS = ("prompt_tokens", "cached_tokens", "prefilled_tokens")

#: sparse-cache counters reported per run as the difference of /server_info before and after
SPARSE_COUNTERS = (
    "requests",
    "finished",
    "hit_requests",
    "input_tokens",
    "resume_tokens",
    "kv_hit_tokens",
    "ckpt_admitted",
    "ckpt_rejected",
    "ckpt_final",
    "states_inserted",
    "states_evicted",
    "kv_leaves_evicted",
    "eviction_walks",
    "kv_eviction_walks",
    "unscored_evictions",
    "mirror_errors",
    "captures_published",
    "captures_dropped",
    "invariant_violations",
    "tune_runs",
    "tune_wait_s",
)
#: sparse-cache gauges read after each run (``tune_worker_cpu_s``: the replay worker's CPU since the
#: server started; the alpha is tuned once per server, in its first run)
SPARSE_GAUGES = (
    "alpha",
    "states_held",
    "kv_tokens_held",
    "mamba_pool_size",
    "kv_pool_size",
    "tune_worker_cpu_s",
)

#: the flags of :func:`server_args` every configuration gets, as the JSON records them (then the chunk)
COMMON_FLAGS = ("--chat-template", "<word template>", "--chunked-prefill-size")
#: resident memory of one tiny-model CPU server (4 processes; measured 1.95 GB), GB
SERVER_RSS_GB = 2.1

FULL_DEFAULTS: dict[str, Any] = dict(
    workloads="doc_qa,system_prompts,rag,agent",
    configs="native_eb,native,sparse,sparse_nb,lru,marconi,nocache",
    reps=3,
    requests=24,
    rates="2,4,8",
    agent_rates="0.5,1,2",
    max_concurrency=4,
    agent_sessions=6,
    agent_turns=8,
)
QUICK_DEFAULTS: dict[str, Any] = {
    **FULL_DEFAULTS,
    "workloads": "doc_qa",
    "configs": "native_eb,native,sparse,nocache",
    "requests": 16,
    "rates": "4",
    "agent_rates": "1",
    "agent_sessions": 3,
    "agent_turns": 6,
}


def rotated(names: Sequence[str], offset: int) -> list[str]:
    """``names`` rotated left by ``offset`` (mod its length)."""
    if not names:
        return []
    k = offset % len(names)
    return list(names[k:]) + list(names[:k])


def text_mismatches(texts: Sequence[str], ref: Sequence[str]) -> int:
    """Requests whose generated text (as whitespace-split words) differs from ``ref``'s, position
    by position; a length difference counts as mismatches too."""
    n = sum(a.split() != b.split() for a, b in zip(texts, ref, strict=False))
    return n + abs(len(texts) - len(ref))


# ----------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """One workload shrunk to CPU size, with its dataset file and cache accounting (tokens)."""

    name: str
    dataset: str  # client --dataset-name: custom | agentic-trace
    path: Path
    rows: int  # client --num-prompts: requests (custom) or sessions (agentic-trace)
    output_len: int  # tokens generated per request / turn
    prompts: list[list[int]]  # custom: prompts in arrival order
    sessions: list[list[list[int]]] = field(default_factory=list)  # agent: per-turn new tokens
    accounting: dict[str, int] = field(default_factory=dict)
    expected_input_lens: list[int] = field(default_factory=list)  # per request, client order
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        """Requests the client sends (turns for the agent workload)."""
        return len(self.expected_input_lens)


def client_file_order(n: int, seed: int) -> list[int]:
    """Positions at which to write ``n`` custom rows so the client, after its
    ``random.seed(seed); random.shuffle(rows)``, sends them in the original order: row ``i``
    goes to line ``order[i]``."""
    idx = list(range(n))
    random.Random(seed).shuffle(idx)  # the client's shuffle: shuffled[i] = file[idx[i]]
    return idx


def prefix_accounting(prompts: Sequence[Sequence[int]], seqs: Sequence[Sequence[int]]) -> dict[str, int]:
    """Cache accounting of a workload whose request ``i`` has prompt ``prompts[i]`` and leaves
    ``seqs[i]`` (prompt + output) in the cache, in arrival order.

    Returns (all in tokens, except ``reuse_points``): ``prompt_tokens``; ``footprint_tokens`` (the
    distinct tokens of all ``seqs``: the size of their radix tree, what an unbounded cache holds);
    ``reuse_points`` (distinct prefixes at which a prompt reuses an earlier sequence: the states a
    perfect hybrid cache needs); ``perfect_prefilled`` (each prompt minus its longest common prefix
    with an earlier sequence, at least one token: no cache prefills fewer); ``max_seq``.
    For single-turn prompts with unique outputs ``perfect_prefilled`` equals
    :func:`benchmarks.serving.ideal_prefilled`; for multi-turn sessions it also reuses the previous
    turn's output, which ``ideal_prefilled`` (prompts only) does not.
    """
    from sglang_sparse.tree import RadixTree

    if len(prompts) != len(seqs):
        raise ValueError("one cached sequence per prompt")
    tree = RadixTree(1, 1)
    footprint = perfect = 0
    points: set[tuple[int, ...]] = set()
    for p, s in zip(prompts, seqs, strict=True):
        m = tree.match(list(p)).kv_depth
        perfect += len(p) - min(m, len(p) - 1)
        if m > 0:
            points.add(tuple(p[:m]))
        footprint += len(s) - tree.match(list(s)).kv_depth
        tree.insert(list(s))
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "footprint_tokens": footprint,
        "reuse_points": len(points),
        "perfect_prefilled": perfect,
        "max_seq": max((len(s) for s in seqs), default=0),
    }


def size_pools(acc: dict[str, int], fraction: float, min_running: int) -> dict[str, Any]:
    """``--max-total-tokens`` / ``--max-mamba-cache-size`` for a workload (see the module docstring)
    and the fractions of the footprint they hold."""
    if not 0 < fraction <= 1:
        raise ValueError(f"pool fraction must be in (0, 1], got {fraction}")
    kv_floor = 2 * acc["max_seq"]
    kv = max(math.ceil(fraction * acc["footprint_tokens"]), kv_floor)
    cached_states = max(1, math.ceil(fraction * acc["reuse_points"]))
    # SGLang caps running requests at pool / 3 with no_buffer and pool / 5 with extra_buffer and the
    # overlap schedule (a working slot + two ping-pong track slots each): room for min_running on both
    working = 5 * min_running
    return {
        "target_fraction": fraction,
        "max_total_tokens": kv,
        "kv_fraction": kv / max(acc["footprint_tokens"], 1),
        "kv_floor_applied": kv == kv_floor and kv_floor > fraction * acc["footprint_tokens"],
        "max_mamba_cache_size": working + cached_states,
        "state_working_slots": working,
        "state_fraction": cached_states / max(acc["reuse_points"], 1),
        "max_running_requests": (working + cached_states) // 5,
    }


def _write_custom(name: str, prompts: list[list[int]], seed: int, path: Path) -> None:
    from sglang_sparse.traces.export import to_custom_rows
    from sglang_sparse.traces.schema import Request

    reqs = [Request.make(f"{name}-{i}", 0, float(i), p, (4, 4)) for i, p in enumerate(prompts)]
    rows = to_custom_rows(reqs)  # ids are already remapped into the vocabulary
    lines: list[str] = [""] * len(rows)
    for i, pos in enumerate(client_file_order(len(rows), seed)):
        lines[pos] = json.dumps(rows[i], separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_custom(
    name: str,
    n: int,
    *,
    target_len: int,
    output_len: int,
    context: int,
    vocab: int,
    seed: int,
    work: Path,
    start: int = 0,
) -> Workload:
    """A single-turn workload: requests ``start .. start + n`` of ``traces/build/<name>.jsonl``,
    shrunk."""
    from benchmarks.serving import load_requests

    prompts = load_requests(
        name, n, target=target_len, tail=48, max_len=context - output_len - 8, vocab=vocab, start=start
    )
    path = work / (f"{name}.custom.jsonl" if not start else f"{name}.from{start}.custom.jsonl")
    _write_custom(name, prompts, seed, path)
    outs = [[-(i + 1)] * output_len for i in range(len(prompts))]  # unique, never shared
    acc = prefix_accounting(prompts, [p + o for p, o in zip(prompts, outs, strict=True)])
    return Workload(
        name=name,
        dataset="custom",
        path=path,
        rows=len(prompts),
        output_len=output_len,
        prompts=prompts,
        accounting=acc,
        expected_input_lens=[len(p) for p in prompts],
        meta={"shrink": {"target_len": target_len, "tail": 48}, "lengths": [len(p) for p in prompts]},
    )


def build_agent(
    sessions: int, turns: int, *, target_len: int, output_len: int, context: int, vocab: int, work: Path
) -> Workload:
    """The first ``sessions`` sessions of ``traces/build/agent.jsonl``, ``turns`` turns each; every
    turn's new tokens shrunk by one stride (see the module docstring)."""
    from benchmarks.serving import shrink
    from sglang_sparse.traces.export import _sessions, to_agentic, turn_deltas
    from sglang_sparse.traces.schema import Request, read_trace

    path = TRACES / "agent.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} missing; run `python -m sglang_sparse.traces build all`")
    groups = [g[:turns] for g in _sessions(read_trace(path))[:sessions]]
    finals = sorted(len(g[-1].input_tokens) for g in groups)
    stride = max(1, -(-finals[len(finals) // 2] // target_len))
    limit = context - output_len - 8
    shrunk: list[list[list[int]]] = []
    for g in groups:
        deltas, total = [], 0
        for d in turn_deltas(g):
            s = shrink(list(d), stride=stride, tail=min(8, len(d)), max_len=10**9, vocab=vocab) or [4]
            if total + len(s) > limit:
                break
            deltas.append(s)
            total += len(s) + output_len
        shrunk.append(deltas)
    # Export through the project's exporter: synthetic requests whose turn deltas are exactly ours.
    reqs, prompts, seqs, lens = [], [], [], []
    for si, deltas in enumerate(shrunk):
        prev: list[int] = []
        acc_prev: list[int] = []
        for ti, d in enumerate(deltas):
            inp = prev + d
            reqs.append(Request.make(f"s{si}", ti, float(ti), inp, [4] * output_len))
            prev = inp + [4] * output_len
            prompt = acc_prev + d  # accounting: unique placeholder outputs, never shared
            out = [-(si * 1000 + ti + 1)] * output_len
            prompts.append(prompt)
            seqs.append(prompt + out)
            lens.append(len(prompt))
            acc_prev = prompt + out
    doc = to_agentic(reqs, name="agent-shrunk")
    doc["metadata"].update(stride=stride, output_len=output_len)
    out_path = work / "agent.agentic.json"
    out_path.write_text(json.dumps(doc), encoding="utf-8")
    return Workload(
        name="agent",
        dataset="agentic-trace",
        path=out_path,
        rows=len(shrunk),
        output_len=output_len,
        prompts=prompts,
        sessions=shrunk,
        accounting=prefix_accounting(prompts, seqs),
        expected_input_lens=lens,
        meta={
            "shrink": {"stride": stride, "target_len": target_len},
            "turns_per_session": [len(d) for d in shrunk],
            "lengths": lens,
        },
    )


def make_workload(
    name: str,
    requests: int,
    *,
    target_len: int,
    seed: int,
    agent_sessions: int = 0,
    agent_turns: int = 0,
    agent_target_len: int = 1024,
    start: int = 0,
    **common: Any,
) -> Workload:
    """:func:`build_agent` (``agent_*``) for ``agent``, else :func:`build_custom`; ``common``: both's
    ``output_len``, ``context``, ``vocab`` and ``work``."""
    if name == "agent":
        return build_agent(agent_sessions, agent_turns, target_len=agent_target_len, **common)
    return build_custom(name, requests, target_len=target_len, seed=seed, start=start, **common)


# ----------------------------------------------------------------------------- servers
def tiny_model(work_dir: Path, size: str = "tiny", model_dir: Path | None = None) -> tuple[Path, Any, Path]:
    """``(checkpoint dir, size spec, chat template)``: the random-weight tiny Qwen3-Next of ``size``
    (in ``model_dir``, default ``<work_dir>/model_<size>``) and the word chat template, written into
    ``work_dir``."""
    from benchmarks.bench_client import write_word_chat_template
    from sglang_sparse.models.tiny import SIZES, make_tiny_model

    work_dir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(model_dir or work_dir / f"model_{size}", arch="qwen3_next", size=size, seed=0)
    return model, SIZES[size], write_word_chat_template(work_dir / "word_chat_template.jinja")


def server_args(config: str, chunk: int, chat_template: Path) -> list[str]:
    """Extra server flags of ``config`` on top of the CPU defaults (which sleep on idle)."""
    flags, template, size = CONFIGS[config_base(config)][0], str(chat_template), str(chunk)
    return ["--chat-template", template, "--chunked-prefill-size", size, *flags]


def make_server(
    model_dir: Path,
    config: str,
    pools: dict[str, Any],
    *,
    chunk: int,
    context: int,
    chat_template: Path,
    log_path: Path,
    env: dict[str, str] | None = None,
    extra: Sequence[str] = (),
) -> Any:
    """An unstarted server of ``config`` (its strategy's CPU flags with the tokenizer on, its flags
    and environment, then ``extra`` / ``env``) with the workload's ``pools``."""
    from sglang_sparse.testing.server import SGLangServer, strategy_setup

    _, config_env, strategy = CONFIGS[config_base(config)]  # the flags: server_args
    base, strategy_env = strategy_setup(strategy)
    return SGLangServer(
        model_dir,
        extra_args=[*server_args(config, chunk, chat_template), *extra],
        env={
            "SGLANG_SPARSE_LOG_EVERY": os.environ.get("SGLANG_SPARSE_LOG_EVERY", "0"),
            **strategy_env,
            **config_env,
            **(env or {}),
        },
        base_args=[a for a in base if a != "--skip-tokenizer-init"],
        max_total_tokens=pools["max_total_tokens"],
        max_mamba_cache_size=pools["max_mamba_cache_size"],
        context_length=context,
        log_path=log_path,
    )


def start_all(servers: dict[str, Any], hint: str = "pass fewer --configs") -> None:
    """Start ``servers`` (name -> unstarted server) concurrently; all or none (a failure stops the
    started ones and raises with every failure). Refuses up front when the machine lacks the memory
    (:data:`SERVER_RSS_GB` each)."""
    need = len(servers) * SERVER_RSS_GB + 1.0
    avail = mem_available_gb()
    if avail < need:
        raise SystemExit(
            f"error: {len(servers)} servers need ~{need:.0f} GB, {avail:.1f} GB available; {hint}"
        )
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as ex:
        futs = {c: ex.submit(s.start, 900.0) for c, s in servers.items()}
        errors = []
        for c, f in futs.items():
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - reported below with every failure
                errors.append(f"{c}: {str(exc)[:3000]}")
    if errors:
        for s in servers.values():
            s.stop()
        raise RuntimeError("server start failed:\n" + "\n".join(errors))


def start_servers(
    model_dir: Path,
    configs: Sequence[str],
    pools: dict[str, Any],
    *,
    chunk: int,
    context: int,
    chat_template: Path,
    log_dir: Path,
    tag: str,
) -> dict[str, Any]:
    """Start one server per configuration (:func:`make_server`, :func:`start_all`)."""
    servers = {
        c: make_server(
            model_dir,
            c,
            pools,
            chunk=chunk,
            context=context,
            chat_template=chat_template,
            log_path=log_dir / f"{tag}_{c}.log",
        )
        for c in configs
    }
    start_all(servers)
    return servers


def flush(srv: Any, tries: int = 20) -> None:
    """``/flush_cache`` until it succeeds (SGLang refuses while requests run); raises after
    ``tries`` attempts 0.5 s apart."""
    for _ in range(tries):
        if srv.flush_cache():
            return
        time.sleep(0.5)
    raise RuntimeError(f"/flush_cache kept failing on {srv.url}")


def sparse_snapshot(srv: Any) -> dict[str, Any]:
    """The sparse cache statistics of rank 0 once nothing is protected (empty dict on failure)."""
    try:
        return srv.wait_sparse_idle(timeout=30)
    except Exception:  # noqa: BLE001 - statistics are optional for a run
        return {}


def sparse_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters of :data:`SPARSE_COUNTERS` as ``after - before`` plus :data:`SPARSE_GAUGES` read
    after (keys missing from the statistics are skipped)."""
    out: dict[str, Any] = {}
    for k in SPARSE_COUNTERS:
        if isinstance(after.get(k), int | float):
            out[k] = after[k] - (before.get(k) or 0)
    for k in SPARSE_GAUGES:
        if k in after:
            out[k] = after[k]
    return out


# ----------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class RatePoint:
    """One load level: Poisson ``rate`` (requests or sessions per second, inf = all at once) and
    an optional cap on requests in flight."""

    label: str
    rate: float
    max_concurrency: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "request_rate": self.rate, "max_concurrency": self.max_concurrency}


def rate_points(rates: Sequence[float], max_concurrency: int | None) -> list[RatePoint]:
    """The Poisson rates, then the concurrency-capped point (rate inf) when ``max_concurrency``."""
    pts = [RatePoint(f"{r:g}/s", float(r)) for r in rates]
    if max_concurrency:
        pts.append(RatePoint(f"cap{max_concurrency}", math.inf, int(max_concurrency)))
    return pts


def run_client(
    worker: Any,
    url: str,
    wl: Workload,
    rate: float,
    max_concurrency: int | None,
    *,
    model_dir: Path,
    seed: int,
    out_file: Path,
    timeout: float,
    allow_errors: bool = False,
) -> dict[str, Any]:
    """One run of the client (:class:`benchmarks.bench_client.ClientWorker`) replaying ``wl``
    against ``url`` with per-request details and the cache report: its checked result row."""
    return worker.run(
        out_file,
        timeout=timeout,
        allow_errors=allow_errors,
        base_url=url,
        dataset_name=wl.dataset,
        dataset_path=wl.path,
        tokenizer=model_dir,
        num_prompts=wl.rows,
        request_rate=rate,
        max_concurrency=max_concurrency,
        output_len=wl.output_len,
        seed=seed,
        extra=["--output-details", "--cache-report", "--warmup-requests", "0"],
    )


def run_one(
    worker: Any,
    srv: Any,
    config: str,
    wl: Workload,
    rp: RatePoint,
    *,
    model_dir: Path,
    seed: int,
    out_file: Path,
    timeout: float,
) -> dict[str, Any]:
    """Flush ``srv``, run the client once, return the run record (metrics, tokens, texts)."""
    flush(srv)
    before = sparse_snapshot(srv) if is_sparse_backend(config) else {}
    cpu0, log0 = server_cpu(srv), log_size(srv)
    t0 = time.perf_counter()
    row = run_client(
        worker,
        srv.url,
        wl,
        rp.rate,
        rp.max_concurrency,
        model_dir=model_dir,
        seed=seed,
        out_file=out_file,
        timeout=timeout,
    )
    wall = time.perf_counter() - t0
    cpu1, forwards = server_cpu(srv), prefill_forwards(srv, log0)
    after = sparse_snapshot(srv) if is_sparse_backend(config) else {}
    lens = [int(x) for x in row.get("input_lens") or []]
    cached = [int(x or 0) for x in row.get("cached_tokens") or []]
    rec: dict[str, Any] = {k: row.get(k) for k in METRICS}
    done = max(int(row.get("completed") or 0), 1)
    rec.update(
        cpu_s_per_request=(cpu1["tree"] - cpu0["tree"]) / done,
        scheduler_cpu_s_per_request=(cpu1["scheduler"] - cpu0["scheduler"]) / done,
        prefill_forwards=forwards,
        completed=row.get("completed"),
        duration_s=row.get("duration"),
        wall_s=wall,
        prompt_tokens=sum(lens),
        cached_tokens=sum(cached),
        prefilled_tokens=sum(lens) - sum(cached),
        order_mismatches=sum(a != b for a, b in zip(lens, wl.expected_input_lens, strict=False))
        + abs(len(lens) - len(wl.expected_input_lens)),
        texts=list(row.get("generated_texts") or []),
        per_request_cached=cached,
        per_request_ttft_ms=[round(float(x) * 1000, 3) for x in row.get("ttfts") or []],
    )
    if is_sparse_backend(config):
        rec["sparse"] = sparse_delta(before, after)
    return rec


def server_cpu(srv: Any) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's whole process tree (launcher, tokenizer,
    scheduler, detokenizer, the sparse backend's replay worker) and of its scheduler process."""
    import psutil

    tree = sched = 0.0
    try:
        root = psutil.Process(srv.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.Error, AttributeError):
        return {"tree": 0.0, "scheduler": 0.0}
    for p in procs:
        try:
            t = p.cpu_times()
            c = t.user + t.system
            title = (p.cmdline() or [""])[0]
        except psutil.Error:
            continue
        tree += c
        if title.startswith("sglang::scheduler"):
            sched += c
    return {"tree": tree, "scheduler": sched}


def log_size(srv: Any) -> int:
    try:
        return Path(srv.log_path).stat().st_size
    except OSError:
        return 0


def prefill_forwards(srv: Any, since: int) -> int:
    """Prefill forwards the scheduler logged (``Prefill batch``) after byte offset ``since``."""
    try:
        with open(srv.log_path, "rb") as f:
            f.seek(since)
            return f.read().count(b"Prefill batch")
    except OSError:
        return 0


def sequential_outputs(srv: Any, wl: Workload) -> list[list[int]]:
    """Greedy outputs of ``wl`` replayed one request at a time (flushed first). Agent sessions are
    replayed turn by turn, each prompt = previous prompt + previous output (ids < 4, the special
    tokens, dropped as the chat round trip drops them) + the turn's new tokens."""
    flush(srv)
    outs: list[list[int]] = []
    if not wl.sessions:
        for p in wl.prompts:
            outs.append(srv.generate(p, wl.output_len).output_ids)
        return outs
    for deltas in wl.sessions:
        prompt: list[int] = []
        for d in deltas:
            prompt = prompt + d
            ids = srv.generate(prompt, wl.output_len).output_ids
            outs.append(ids)
            prompt = prompt + [t for t in ids if t >= 4]
    return outs


def sequential_mismatches(
    configs: Sequence[str], outputs: Callable[[str], list[list[int]]]
) -> dict[str, Any]:
    """Requests, and per configuration but ``nocache`` the requests compared and mismatched:
    ``outputs(config)`` (:func:`sequential_outputs`) against ``outputs("nocache")`` (called first)."""
    ref = outputs("nocache")
    bad = {c: sum(a != b for a, b in zip(outputs(c), ref, strict=True)) for c in configs if c != "nocache"}
    return {
        "requests": len(ref),
        "configs": {c: {"compared": len(ref), "mismatched": n} for c, n in bad.items()},
    }


# ----------------------------------------------------------------------------- summaries
def summarize_workload(
    runs: list[dict[str, Any]],
    configs: Sequence[str],
    baselines: Sequence[str],
    points: Sequence[RatePoint],
    reps: int,
    kind: str,
) -> dict[str, Any]:
    """Per rate point: each configuration's median/spread of :data:`METRICS` and
    :data:`TOKEN_KEYS` over repetitions, and paired ratios: every configuration vs the first
    baseline present, ``sparse`` (the subject) vs each further one."""
    by = {(r["rate"], r["config"], r["rep"]): r for r in runs}
    present = [b for b in baselines if b in configs]
    out: dict[str, Any] = {}
    for rp in points:

        def series(c: str, key: str, rp: RatePoint = rp) -> list[float | None]:
            return [by[(rp.label, c, i)].get(key) if (rp.label, c, i) in by else None for i in range(reps)]

        cells: dict[str, Any] = {}
        for c in configs:
            cells[c] = {}
            for key in (*ALL_METRICS, *TOKEN_KEYS):
                s = spread(series(c, key), kind)
                cells[c][key] = {**s.as_dict(), "values": series(c, key)} if s else None
        ratios: dict[str, Any] = {}
        for bi, b in enumerate(present):
            ratios[b] = {}
            for c in configs:
                if c == b or (bi > 0 and c != "sparse"):
                    continue
                ratios[b][c] = {}
                for key in (*ALL_METRICS, "prefilled_tokens"):
                    per_rep = paired_ratios(series(c, key), series(b, key))
                    s = spread(per_rep, kind)
                    ratios[b][c][key] = None
                    if s:
                        ratios[b][c][key] = {**s.as_dict(), "per_rep": per_rep, "claim": claim(s)}
                        ratios[b][c][key]["sign_test_p"] = sign_test_p(s.n)
        out[rp.label] = {
            "point": rp.as_dict(),
            "configs": cells,
            "ratios": ratios,
            "ttft_vs_prefill": ttft_vs_prefill(series, configs, kind),
        }
    return out


#: (subject, reference) pairs whose TTFT ratio is checked against their prefilled-token ratio
TTFT_PAIRS = (
    ("sparse", "native_eb"),
    ("sparse", "lru"),
    ("sparse", "native"),
    ("sparse", "marconi"),
    ("sparse_cut", "lru"),
    ("sparse", "sparse_cut"),
)


def ttft_vs_prefill(
    series: Callable[[str, str], list[float | None]], configs: Sequence[str], kind: str
) -> dict[str, Any]:
    """Does a config's time to first token follow the tokens it prefills? Per pair of
    :data:`TTFT_PAIRS` present, plus every second instance with its first (``lru#2/lru``: the A/A
    floor): paired per-repetition ratios of mean TTFT and of prefilled tokens, and ``gap`` = TTFT
    ratio / prefilled ratio - 1 per repetition (0: TTFT shrinks exactly as the prefill does).
    ``pooled_gap``: the same from the repetitions' totals, steadier when single runs are noisy.
    Meaningful only where queueing is light (the lowest rate or one request in flight)."""
    out: dict[str, Any] = {}
    pairs = [*TTFT_PAIRS, *aa_pairs(configs)]
    for a, b in pairs:
        if a not in configs or b not in configs:
            continue
        ta, tb = series(a, "mean_ttft_ms"), series(b, "mean_ttft_ms")
        pa, pb = series(a, "prefilled_tokens"), series(b, "prefilled_tokens")
        t, pf = paired_ratios(ta, tb), paired_ratios(pa, pb)
        gaps = [x / y - 1 for x, y in zip(t, pf, strict=False) if y]
        st, sp, sg = spread(t, kind), spread(pf, kind), spread(gaps, kind)
        out[f"{a}/{b}"] = {
            "ttft_ratio": st.as_dict() if st else None,
            "prefilled_ratio": sp.as_dict() if sp else None,
            "gap": {**sg.as_dict(), "per_rep": gaps} if sg else None,
            "pooled_gap": pooled_gap(ta, tb, pa, pb),
        }
    return out


def equality_summary(
    runs: list[dict[str, Any]], configs: Sequence[str], points: Sequence[RatePoint], reps: int
) -> dict[str, Any]:
    """Load-run token equality: per configuration, requests whose output differs from the
    ``nocache`` run of the same rate point and repetition; ``nocache_self``: nocache runs vs the
    first repetition's (batching effects without any cache)."""
    if "nocache" not in configs:
        return {"reference": None, "note": "no nocache configuration: token equality not checked"}
    by = {(r["rate"], r["config"], r["rep"]): r for r in runs}
    per: dict[str, dict[str, int]] = {c: {"compared": 0, "mismatched": 0} for c in configs if c != "nocache"}
    self_: dict[str, int] = {"compared": 0, "mismatched": 0}
    for rp in points:
        for i in range(reps):
            ref = by.get((rp.label, "nocache", i))
            if ref is None:
                continue
            for c in per:
                r = by.get((rp.label, c, i))
                if r is not None:
                    per[c]["compared"] += len(ref["texts"])
                    per[c]["mismatched"] += text_mismatches(r["texts"], ref["texts"])
            first = by.get((rp.label, "nocache", 0))
            if i > 0 and first is not None:
                self_["compared"] += len(ref["texts"])
                self_["mismatched"] += text_mismatches(ref["texts"], first["texts"])
    clean = all(v["mismatched"] == 0 for v in per.values()) and self_["mismatched"] == 0
    return {"reference": "nocache", "load": per, "nocache_self": self_, "all_equal": clean}


# ----------------------------------------------------------------------------- output
def _cell(ws: dict[str, Any], c: str, key: str) -> Spread | None:
    d = ws["configs"][c].get(key)
    return Spread(d["median"], d["lo"], d["hi"], d["n"], d["kind"]) if d else None


def _ratio(ws: dict[str, Any], b: str, c: str, key: str) -> Spread | None:
    d = ws["ratios"].get(b, {}).get(c, {}).get(key)
    return Spread(d["median"], d["lo"], d["hi"], d["n"], d["kind"]) if d else None


#: the columns of the printed tables (then prefilled tokens)
TABLE_KEYS = (
    "request_throughput",
    "median_ttft_ms",
    "p95_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p95_itl_ms",
    "cpu_s_per_request",
    "scheduler_cpu_s_per_request",
    "prefill_forwards",
)


def print_workload(name: str, doc: dict[str, Any], configs: Sequence[str], baselines: Sequence[str]) -> None:
    """Tables of one workload: cells (median [spread]) and ratios vs each baseline."""
    from benchmarks._common import table

    acc, pools = doc["accounting"], doc["pools"]
    print(
        f"\n== {name}: {doc['requests']} requests ({doc['dataset']}), footprint "
        f"{acc['footprint_tokens']} tokens / {acc['reuse_points']} reuse points; pools "
        f"{pools['max_total_tokens']} tokens ({pools['kv_fraction']:.0%}) / "
        f"{pools['max_mamba_cache_size']} state slots ({pools['state_fraction']:.0%} of reuse points "
        f"+ {pools['state_working_slots']} working); perfect cache prefills "
        f"{acc['perfect_prefilled']} of {acc['prompt_tokens']} prompt tokens"
    )
    keys = (*TABLE_KEYS, "prefilled_tokens")
    header = ["config", *(ALL_METRICS[k][0] for k in TABLE_KEYS), "prefilled tok"]
    for label, ws in doc["summary"].items():
        rows = [[c, *(fmt_spread(_cell(ws, c, k)) for k in keys)] for c in configs]
        print(f"\n-- {name} @ {label} (median [min-max] over repetitions)")
        print(table(rows, header))
        for b in baselines:
            if b not in ws["ratios"]:
                continue
            others = [c for c in configs if c in ws["ratios"][b]]
            rrows = [[c, *(fmt_ratio(_ratio(ws, b, c, k)) for k in keys)] for c in others]
            if rrows:
                print(f"   ratios vs {b} (per-repetition, n.s. = spread includes 1)")
                print(table(rrows, header))
        for pair, v in ws.get("ttft_vs_prefill", {}).items():
            if v["gap"] is None:
                continue
            tr, pr, g = v["ttft_ratio"], v["prefilled_ratio"], v["gap"]
            print(
                f"   {pair}: mean TTFT ratio {tr['median']:.3f} [{tr['lo']:.3f}-{tr['hi']:.3f}], "
                f"prefilled-token ratio {pr['median']:.3f}; gap {g['median']:+.1%} "
                f"[{g['lo']:+.1%} to {g['hi']:+.1%}]"
                + (f", pooled {v['pooled_gap']:+.1%}" if v.get("pooled_gap") is not None else "")
            )
    eq = doc["equality"]
    if eq.get("reference"):
        parts = [f"{c} {v['mismatched']}/{v['compared']}" for c, v in eq["load"].items()]
        ns = eq["nocache_self"]
        print(
            f"   token mismatches vs nocache under load: {', '.join(parts)}; nocache vs itself "
            f"{ns['mismatched']}/{ns['compared']}"
        )
    seq = doc.get("sequential_equality")
    if seq:
        parts = [f"{c} {v['mismatched']}/{v['compared']}" for c, v in seq["configs"].items()]
        print(f"   sequential greedy pass, mismatches vs nocache: {', '.join(parts)}")


def plot(doc: dict[str, Any], path: Path) -> None:
    """TTFT p50, TTFT p95 and request throughput vs load point, one column per workload."""
    from benchmarks._common import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    wls = list(doc["workloads"])
    rows = (
        ("median_ttft_ms", "TTFT p50 (ms)"),
        ("p95_ttft_ms", "TTFT p95 (ms)"),
        ("request_throughput", "req/s"),
    )
    fig, axes = plt.subplots(len(rows), len(wls), figsize=(max(4.6 * len(wls), 7.0), 9), squeeze=False)
    for j, w in enumerate(wls):
        summ = doc["workloads"][w]["summary"]
        labels = list(summ)
        for i, (key, ylabel) in enumerate(rows):
            ax = axes[i][j]
            for k, c in enumerate(doc["configs"]):
                xs, ys, lo, hi = [], [], [], []
                for x, lab in enumerate(labels):
                    d = summ[lab]["configs"][c].get(key)
                    if d:
                        xs.append(x + (k - (len(doc["configs"]) - 1) / 2) * 0.08)
                        ys.append(d["median"])
                        lo.append(d["median"] - d["lo"])
                        hi.append(d["hi"] - d["median"])
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4, capsize=3, label=c)
            ax.set_xticks(range(len(labels)), labels)
            ax.set_xlim(-0.5, len(labels) - 0.5)
            ax.set_ylabel(ylabel)
            ds = [summ[lab]["configs"][c].get(key) for lab in labels for c in doc["configs"]]
            his, los = [d["hi"] for d in ds if d], [d["lo"] for d in ds if d]
            if key != "request_throughput" and los and min(los) > 0 and max(his) / min(los) > 20:
                ax.set_yscale("log")
            if i == 0:
                ax.set_title(f"{w} ({doc['workloads'][w]['dataset']})")
            if i == len(rows) - 1:
                ax.set_xlabel("load (Poisson rate; capN = N in flight)")
    axes[0][0].legend(fontsize=8)
    reps = doc["reps"]
    fig.suptitle(f"serving under load, median and min-max over {reps} interleaved repetitions", fontsize=10)
    save(fig, path)


# ----------------------------------------------------------------------------- driver
def run_load(
    args: argparse.Namespace,
    log: Callable[[str], None] = print,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark for the parsed command line and return the JSON document (see the module
    docstring). ``checkpoint(doc)`` is called after each workload but the last with the document so
    far (``partial`` true), so an interrupted run keeps its finished workloads."""
    from benchmarks.bench_client import ClientWorker

    workloads = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    baselines = [b for b in args.baselines.split(",") if b]
    unknown = [c for c in configs if config_base(c) not in CONFIGS]
    unknown += [w for w in workloads if w not in DATASET]
    if unknown:
        raise SystemExit(f"error: unknown configs/workloads {unknown}")
    reps, seed, chunk, work_dir = args.reps, args.seed, args.chunk, args.work_dir
    t_start = time.time()
    model_dir, spec, chat_template = tiny_model(work_dir, args.size, args.model_dir)
    context = spec.max_position_embeddings
    wls = {
        w: make_workload(
            w, args.requests, target_len=args.target_len, agent_sessions=args.agent_sessions,
            agent_turns=args.agent_turns, agent_target_len=args.agent_target_len, output_len=args.output_len,
            context=context, vocab=spec.vocab_size, work=work_dir, seed=seed,
        )
        for w in workloads
    }  # fmt: skip
    max_concurrency = args.max_concurrency or None
    rates = {w: _floats(args.agent_rates if w == "agent" else args.rates) for w in workloads}
    points = {w: rate_points(rates[w], max_concurrency) for w in workloads}
    progress = bar(sum(reps * len(points[w]) * len(configs) for w in workloads), "serving_load")
    doc: dict[str, Any] = {
        "benchmark": "serving_load",
        "client": "sglang.benchmark.serving (SGLang's bench_serving), persistent process",
        "model": {"arch": "qwen3_next", "size": args.size, "path": str(model_dir), "context": context},
        "configs": {
            c: {"server_flags": list(CONFIGS[config_base(c)][0]), "env": CONFIGS[config_base(c)][1]}
            for c in configs
        },
        "server_common_flags": [*COMMON_FLAGS, str(chunk)],
        "baselines": [b for b in baselines if b in configs],
        "reps": reps,
        "seed": seed,
        "output_len": args.output_len,
        "spread": args.spread,
        "rotation": "configs rotated left by (repetition + rate index) per rate point",
        "workloads": {},
    }
    try:
        with ClientWorker() as worker:
            worker.start()  # the client's import overlaps the first server start
            for w in workloads:
                wl = wls[w]
                pools = size_pools(wl.accounting, args.pool_fraction, args.min_running)
                t0 = time.time()
                log(
                    f"[serving_load] {w}: starting {len(configs)} servers "
                    f"(KV {pools['max_total_tokens']} tokens, {pools['max_mamba_cache_size']} state slots)"
                )
                servers = start_servers(
                    model_dir,
                    configs,
                    pools,
                    chunk=chunk,
                    context=context,
                    chat_template=chat_template,
                    log_dir=work_dir,
                    tag=w,
                )
                startup = {c: s.startup_seconds for c, s in servers.items()}
                for s in servers.values():  # first requests of a fresh server outside the measurement
                    s.generate(wl.prompts[0], wl.output_len)
                log(f"[serving_load] {w}: servers up in {time.time() - t0:.0f} s")
                runs: list[dict[str, Any]] = []
                try:
                    for rep in range(reps):
                        for ri, rp in enumerate(points[w]):
                            for pos, c in enumerate(rotated(list(configs), rep + ri)):
                                progress.set_postfix_str(f"{w} {rp.label} {c} rep{rep}")
                                rec = run_one(
                                    worker,
                                    servers[c],
                                    c,
                                    wl,
                                    rp,
                                    model_dir=model_dir,
                                    seed=seed,
                                    out_file=work_dir / "client_out.jsonl",
                                    timeout=args.client_timeout,
                                )
                                rec.update(rate=rp.label, config=c, rep=rep, position=pos)
                                runs.append(rec)
                                if not servers[c].alive():
                                    raise RuntimeError(f"{c} server died:\n{servers[c].log_tail()}")
                                progress.update(1)
                    eq = equality_summary(runs, configs, points[w], reps)
                    seq_eq = None
                    if "nocache" in configs and (
                        args.equality == "always"
                        or (
                            args.equality == "auto"
                            and (not eq["all_equal"] or any(r["order_mismatches"] for r in runs))
                        )
                    ):
                        log(f"[serving_load] {w}: sequential greedy equality pass")
                        seq_eq = sequential_mismatches(
                            configs,
                            lambda c: sequential_outputs(servers[c], wl),  # noqa: B023 - called at once
                        )
                finally:
                    for s in servers.values():
                        s.stop()
                doc["workloads"][w] = {
                    "dataset": wl.dataset,
                    "dataset_path": str(wl.path),
                    "rows": wl.rows,
                    "requests": wl.requests,
                    "output_len": wl.output_len,
                    "accounting": wl.accounting,
                    "perfect_cache": {
                        "prefilled_tokens": wl.accounting["perfect_prefilled"],
                        "prompt_tokens": wl.accounting["prompt_tokens"],
                    },
                    "pools": pools,
                    "points": [rp.as_dict() for rp in points[w]],
                    "server_startup_s": startup,
                    "meta": wl.meta,
                    "summary": summarize_workload(runs, configs, baselines, points[w], reps, args.spread),
                    "equality": eq,
                    "sequential_equality": seq_eq,
                    "runs": [_compact(r) for r in runs],
                    "wall_s": time.time() - t0,
                }
                if checkpoint is not None and w != workloads[-1]:
                    checkpoint({**doc, "partial": True, "wall_s": time.time() - t_start})
    finally:
        progress.close()
    doc["wall_s"] = time.time() - t_start
    doc["partial"] = False
    return doc


def _compact(run: dict[str, Any]) -> dict[str, Any]:
    """A run record for the JSON: generated texts replaced by one digest (equal digests = equal
    outputs; the comparisons themselves are in ``equality``). Per request (client order) it keeps
    the cached tokens and the TTFT (ms), so TTFT can be paired request by request."""
    out = {k: v for k, v in run.items() if k != "texts"}
    out["texts_sha1"] = hashlib.sha1("\x00".join(run["texts"]).encode()).hexdigest()[:16]
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_workload_arguments(
    ap: argparse.ArgumentParser,
    name: str,
    full: dict[str, Any],
    quick: dict[str, Any],
    *,
    output_len: int,
    reps_help: str | None = None,
    seed_help: str = "client seed (default %(default)s)",
    work_help: str = "datasets, logs, client output",
    timeout_help: str = "seconds per client run (default %(default)s)",
) -> None:
    """The flags shared by this module and ``benchmarks.serving_router`` (``name``): workloads (all
    in ``full``) and their sizes (the help quotes ``full`` and ``quick``), shrinking, pool sizing,
    model and output paths."""

    def fq(key: str) -> str:
        return f"full {full[key]}, quick {quick[key]}"

    add = ap.add_argument
    add("--workloads", help=f"comma list of {full['workloads']} (full: all)")
    add("--reps", type=int, help=reps_help or f"interleaved repetitions ({fq('reps')})")
    add("--requests", type=int, help=f"requests per single-turn workload ({fq('requests')})")
    add("--agent-sessions", type=int, help=f"agent sessions ({fq('agent_sessions')})")
    add("--agent-turns", type=int, help=f"turns per agent session ({fq('agent_turns')})")
    add("--target-len", type=int, default=768, help="median shrunk prompt, tokens (default %(default)s)")
    dflt = " (default %(default)s)"
    add("--output-len", type=int, default=output_len, help="tokens generated per request/turn" + dflt)
    add("--agent-target-len", type=int, default=1024, help="median last-turn agent prompt, tokens" + dflt)
    add(
        "--pool-fraction",
        type=float,
        default=0.4,
        help="pools (per server) hold this fraction of the unique-prefix footprint (default %(default)s)",
    )
    add("--min-running", type=int, default=4, help="state working slots for N running requests" + dflt)
    add("--chunk", type=int, default=512, help="--chunked-prefill-size, tokens (default %(default)s)")
    add("--seed", type=int, default=0, help=seed_help)
    add("--size", default="tiny", help="tiny-model size preset (default %(default)s)")
    add("--model-dir", type=Path, help="model checkpoint dir (default <work-dir>/model_<size>)")
    add("--work-dir", type=Path, default=Path(f"/tmp/sglang_sparse_{name}"), help=work_help + dflt)
    add("--out", type=Path, help=f"JSON path (default benchmarks/results[/quick]/{name}.json)")
    add("--client-timeout", type=float, default=1800.0, help=timeout_help)


def parse_run_args(
    ap: argparse.ArgumentParser, argv: list[str] | None, name: str, full: dict[str, Any], quick: dict
) -> tuple[argparse.Namespace, Path, str]:
    """``argv`` parsed, the flags left unset taken from ``quick`` (``--quick``) or ``full``; the
    JSON path (``--out`` or ``benchmarks/results[/quick]/<name>.json``) and the command line."""
    from benchmarks._common import results_dir

    args = ap.parse_args(argv)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = args.out or results_dir(args.quick) / f"{name}.json"
    return args, out, f"python -m benchmarks.{name} " + shlex.join(argv if argv is not None else sys.argv[1:])


def build_parser() -> argparse.ArgumentParser:
    """The command line (every flag is described in the module docstring too)."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_load",
        description=__doc__.split("\n\n")[0],
        epilog="Full run: python -m benchmarks.serving_load  |  quick: --quick (see the module docstring)",
    )
    add = ap.add_argument
    add(
        "--quick",
        action="store_true",
        help="README main-job size (4-6 min): doc_qa; native,sparse,lru,nocache; 16 requests; "
        "rate 4/s + cap 4; 3 repetitions; JSON/PNG under benchmarks/results/quick/",
    )
    add(
        "--configs",
        help=f"comma list of {','.join(CONFIGS)} (full: all but sparse_cut); NAME#2 starts a second "
        "server of NAME (A/A control, e.g. lru,lru#2)",
    )
    add(
        "--baselines", default="native_eb,native,lru,marconi", help="ratio denominators (default %(default)s)"
    )
    add("--rates", help="Poisson request rates, req/s, comma list (full 2,4,8; quick 4)")
    add("--agent-rates", help="Poisson session rates for agent, sessions/s (full 0.5,1,2; quick 1)")
    add(
        "--max-concurrency",
        type=int,
        help="add a load point with all requests at once capped at N in flight (full and quick 4; 0 = none)",
    )
    add("--spread", choices=("minmax", "iqr"), default="minmax", help="spread over repetitions")
    add(
        "--equality",
        choices=("auto", "always", "never"),
        default="auto",
        help="sequential greedy equality pass: auto = only if load-run outputs differ (default)",
    )
    add_workload_arguments(
        ap,
        "serving_load",
        FULL_DEFAULTS,
        QUICK_DEFAULTS,
        output_len=16,
        reps_help="interleaved repetitions per cell (default 3)",
        seed_help="client seed: dataset order and Poisson arrivals",
        work_help="datasets, server logs, client output",
        timeout_help="seconds per client run",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    from benchmarks._common import write_json

    args, out, command = parse_run_args(build_parser(), argv, "serving_load", FULL_DEFAULTS, QUICK_DEFAULTS)
    head = {
        "command": command,
        "quick": args.quick,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }

    def checkpoint(partial: dict[str, Any]) -> None:
        write_json(out.stem, {**head, **partial}, out.parent)
        print(f"[serving_load] partial results ({', '.join(partial['workloads'])}) -> {out}", flush=True)

    doc = {**head, **run_load(args, checkpoint=checkpoint)}
    path = write_json(out.stem, doc, out.parent)
    plot(doc, out.with_suffix(".png"))
    configs = [c for c in args.configs.split(",") if c]
    for name, wdoc in doc["workloads"].items():
        print_workload(name, wdoc, configs, doc["baselines"])
    print(f"\nwrote {path} and {out.with_suffix('.png')} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

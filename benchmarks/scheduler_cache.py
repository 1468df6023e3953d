"""Scheduler-side cache time per request of SGLang's real ``UnifiedRadixCache`` (hybrid GDN model).

A harness of what SGLang 0.5.23's scheduler does with its tree cache, without a model forward: the
real CPU pools (built like ``mem_cache/kv_cache_configurator.py``; 1 attention + 1 GDN layer, 1 KV
head of dim 8), the real ``Req`` and the real cache from ``create_tree_cache`` (so the ``sparse``
backend goes through its registered factory). Timed per request, in scheduler order:

1. ``match``: ``Req.init_next_round_input(tree_cache)`` (``match_kv_cache`` with
   ``cow_mamba=True``; allocates the request's Mamba slot from the match's state);
2. ``plan`` (``sparse`` only): what the backend's ``PrefillAdder`` asks the cache at admission
   (``plan_request`` + ``next_cut``), when the cache has those methods;
3. ``lock``: ``tree_cache.lock(req.last_node)`` (``PrefillAdder._commit_prefill_admission``);
4. ``evict``: ``ensure_mamba_capacity`` + ``evict_from_tree_cache`` before the request row and
   every KV allocation (``alloc_req_slots`` / ``alloc_token_slots``), i.e. eviction when the pools
   run short; ``prefix_indices``: ``tree_cache.prefix_device_indices(req)`` (``alloc_for_extend``);
5. KV allocation and the ``req_to_token`` row write (not cache time, not timed);
6. ``checkpoint``: ``checkpoint_kv_cache`` at every chunk end (``--chunk``, and for ``sparse`` at
   every planned cut, ``SGLANG_SPARSE_CAPTURE=cut``) and at the prompt end;
7. decode of ``--out`` tokens (one KV slot per step, eviction timed as ``evict``);
8. ``release``: ``release_kv_cache(req, tree_cache, checkpoint=True)`` (final checkpoint, row
   free, unlock, ``on_release``).

Workload (random token ids, seeded, identical for every configuration): ``--docs`` documents of
~32k tokens, then questions (document + question), multi-turn continuations (an earlier prompt + its
output + a new user turn) and repeats. ``--warmup`` requests grow SGLang's tree (the pools are sized
so that it just fits), then ``--requests`` requests are timed (new documents arrive: eviction). Then
eviction walks at that tree size: ``evict(mamba_num=1)`` and ``evict(num_tokens=1)``, with the
Mamba/KV components' ``_evict_device_start`` and first ``_evict_device_next_node`` timed apart
(Python tree cores only). Times in the tables: ms per request (median, p90, per operation), us per
eviction call.

Configurations (one subprocess each, so each gets its own published ``ServerArgs``):

* ``native``: ``create_tree_cache`` with default settings (tree core from
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default ``rust`` when it loads; the JSON says which
  core actually ran), ``no_buffer`` Mamba strategy;
* ``native_python``: the same with ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``;
* ``sparse_lru`` / ``sparse``: ``--radix-cache-backend sparse`` (plugin loaded as the scheduler
  does) with ``SGLANG_SPARSE_POLICY=lru`` / ``sparse``.

    python benchmarks/scheduler_cache.py [--quick] [--configs native,sparse] [--profile]

Writes ``benchmarks/results/scheduler_cache.json`` (``--quick``: ``benchmarks/results/quick/``).
Targets: sparse <= 1.5x native per request (median), eviction walk <= 1 ms at 10k nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks._common import results_dir, table  # noqa: E402
from benchmarks.stats import latency_us as stats  # noqa: E402

#: name -> (radix cache backend, extra environment)
CONFIGS: dict[str, tuple[str | None, dict[str, str]]] = {
    "native": (None, {}),
    "native_python": (None, {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}),
    "sparse_lru": ("sparse", {"SGLANG_SPARSE_POLICY": "lru", "SGLANG_SPARSE_CAPTURE": "cut"}),
    "sparse": ("sparse", {"SGLANG_SPARSE_POLICY": "sparse", "SGLANG_SPARSE_CAPTURE": "cut"}),
}
#: per-request operation timers, in report order
OPS = ("match", "plan", "lock", "evict", "prefix_indices", "checkpoint", "release")
MODEL_DIR = Path(tempfile.gettempdir()) / "sglang_sparse_scheduler_cache_model"


# ---------------------------------------------------------------------- workload


def random_ids(rng: np.random.Generator, n: int) -> array:
    """``n`` random token ids in ``[4, 2^30)`` as SGLang's ``array('q')``."""
    return array("q", rng.integers(4, 2**30, size=n, dtype=np.int64).tobytes())


def output_ids(i: int, n: int) -> array:
    """The ``n`` generated token ids of request ``i`` (deterministic, no model): continuations
    reuse the outputs of earlier requests."""
    return random_ids(np.random.default_rng(10_000_019 + i), n)


def build_workload(
    *,
    docs: int,
    doc_len: int,
    warmup_reqs: int,
    timed_reqs: int,
    out_len: int,
    new_doc_frac: float,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], int]:
    """A request list (dicts ``kind``, ``prompt`` as ``array('q')``, ``out``), the first
    ``warmup_reqs`` are the warm-up. Kinds: ``doc`` (first use of a document), ``question``
    (document + new question), ``turn`` (an earlier request's prompt + output + a new user turn),
    ``repeat`` (an earlier prompt again). Returns ``(requests, n_documents_used)``."""
    rng = np.random.default_rng(seed)

    def rand(n: int) -> array:
        return random_ids(rng, n)

    doc_tokens: list[array] = []
    reqs: list[dict[str, Any]] = []

    def new_doc() -> None:
        doc_tokens.append(rand(doc_len))
        reqs.append(
            {"kind": "doc", "prompt": doc_tokens[-1] + rand(int(rng.integers(256, 1024))), "out": out_len}
        )

    for _ in range(docs):
        new_doc()
    total = warmup_reqs + timed_reqs
    while len(reqs) < total:
        timed = len(reqs) >= warmup_reqs
        u = rng.random()
        if timed and u < new_doc_frac:
            new_doc()
            continue
        if u < 0.55:
            d = int(rng.integers(len(doc_tokens)))
            prompt = doc_tokens[d] + rand(int(rng.integers(256, 1024)))
            reqs.append({"kind": "question", "prompt": prompt, "out": out_len})
        elif u < 0.85:
            j = int(rng.integers(len(reqs)))
            prev = reqs[j]
            prompt = prev["prompt"] + output_ids(j, prev["out"]) + rand(int(rng.integers(64, 256)))
            reqs.append({"kind": "turn", "prompt": prompt, "out": out_len})
        else:
            j = int(rng.integers(len(reqs)))
            reqs.append({"kind": "repeat", "prompt": reqs[j]["prompt"], "out": out_len})
    return reqs, len(doc_tokens)


# ---------------------------------------------------------------------- SGLang set-up


def make_model_dir(path: Path = MODEL_DIR, context_len: int = 65536) -> Path:
    """A tiny Qwen3-Next checkpoint (1 GDN + 1 attention layer, 1 KV head of dim 8): only its
    config is read (``ServerArgs`` resolution, pool shapes, the sparse cost model)."""
    from sglang_sparse.models.tiny import make_tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_tiny_model(
            path,
            hidden_size=32,
            num_layers=2,
            full_attention_interval=2,
            vocab_size=64,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=8,
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            intermediate_size=32,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            max_position_embeddings=context_len,
        )


@dataclass
class Built:
    """The scheduler's cache objects."""

    cache: Any
    req_to_token_pool: Any
    allocator: Any
    kv_tokens: int
    mamba_slots: int
    core: str


def build_cache(
    backend: str | None,
    *,
    model_dir: Path,
    kv_tokens: int,
    mamba_slots: int,
    max_reqs: int,
    context_len: int,
    chunk: int,
) -> Built:
    """Publish ``ServerArgs`` like the scheduler, build the pools like ``kv_cache_configurator`` and
    the cache like ``kv_cache_builder.build_kv_cache`` (``create_tree_cache``)."""
    import torch
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.runtime_context import get_exec, get_memory, get_schedule, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        skip_tokenizer_init=True,
        mamba_radix_cache_strategy="no_buffer",
        disable_overlap_schedule=True,
        page_size=1,
        chunked_prefill_size=chunk,
        context_length=context_len,
        dtype="bfloat16",
        radix_cache_backend=backend,
    )
    if backend is not None:  # what run_scheduler_process does first: load the general plugins
        from sglang.srt.plugins import load_plugins

        load_plugins()
    publish(sa, role="scheduler")
    mc = ModelConfig.from_server_args(sa)
    cache_params = mambaish_config(mc).mamba2_cache_params
    layer_ids = list(cache_params.layers)
    full_ids = [i for i in range(mc.num_hidden_layers) if i not in layer_ids]
    rtp = HybridReqToTokenPool(
        size=max_reqs,
        mamba_size=mamba_slots,
        mamba_spec_state_size=max_reqs,
        max_context_len=context_len + 4,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=layer_ids,
        enable_mamba_extra_buffer=get_exec().mamba.enable_mamba_extra_buffer,
        enable_mamba_extra_buffer_lazy=get_exec().mamba.enable_mamba_extra_buffer_lazy,
        speculative_num_draft_tokens=None,
        speculative_eagle_topk=None,
        enable_overlap_schedule=not get_schedule().disable_overlap_schedule,
        start_layer=0,
    )
    kv_pool = HybridLinearKVPool(
        page_size=1,
        size=kv_tokens,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=mc.head_dim,
        full_attention_layer_ids=full_ids,
        device="cpu",
        mamba_pool=rtp.mamba_pool,
        start_layer=0,
    )
    alloc = TokenToKVPoolAllocator(
        kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=rtp,
        token_to_kv_pool_allocator=alloc,
        page_size=1,
        eviction_policy=get_memory().radix_eviction_policy,
        eviction_policy_config=get_memory().radix_eviction_policy_config,
        enable_session_radix_cache=get_memory().enable_session_radix_cache,
        enable_mamba_extra_buffer=get_exec().mamba.enable_mamba_extra_buffer,
        enable_mamba_extra_buffer_lazy=get_exec().mamba.enable_mamba_extra_buffer_lazy,
        chunked_prefill_size=get_schedule().chunked_prefill_size,
    )
    ctx = TreeCacheBuildContext(
        server_args=sa,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=True,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=mc,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_tree_cache(ctx)
    return Built(cache, rtp, alloc, kv_tokens, mamba_slots, type(cache.tree_core).__name__)


# ---------------------------------------------------------------------- the harness


class Harness:
    """Drives one cache like SGLang's scheduler (one request at a time, no forward)."""

    def __init__(self, built: Built, chunk: int) -> None:
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.b = built
        self.cache = built.cache
        self.chunk = chunk
        self._sp = SamplingParams
        self.t: dict[str, float] = {}
        self.n = 0
        self.cuts = 0
        self.checkpoints = 0
        self._plan = getattr(self.cache, "plan_request", None)
        self._next_cut = getattr(self.cache, "next_cut", None)

    @contextmanager
    def timer(self, op: str) -> Iterator[None]:
        a = time.perf_counter()
        try:
            yield
        finally:
            self.t[op] = self.t.get(op, 0.0) + time.perf_counter() - a

    def _alloc_kv(self, n: int) -> Any:
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        with self.timer("evict"):
            evict_from_tree_cache(self.cache, n)
        loc = self.b.allocator.alloc(n)
        if loc is None:
            raise RuntimeError(
                f"KV pool out of memory: {n} tokens; {self.cache.available_and_evictable_str()}"
            )
        return loc

    def _extend(self, req: Any) -> None:
        """``alloc_for_extend`` for one request: row, prefix indices, KV, row write."""
        import torch
        from sglang.srt.mem_cache.allocation import ensure_mamba_capacity

        rtp = self.b.req_to_token_pool
        first = not req.kv.holds_kv
        if first:
            with self.timer("evict"):
                ensure_mamba_capacity(rtp, [req], self.cache)
            if rtp.alloc([req]) is None:
                raise RuntimeError("request row / Mamba slot allocation failed")
            if req.prefix_len:
                with self.timer("prefix_indices"):
                    prefix = self.cache.prefix_device_indices(req)
                rtp.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix.to(torch.int32))
        loc = self._alloc_kv(req.extend_end - req.prefix_len)
        rtp.write((req.kv.req_pool_idx, slice(req.prefix_len, req.extend_end)), loc.to(torch.int32))
        req.kv.kv_allocated_len = req.extend_end
        req.kv.kv_committed_len = req.extend_end

    def _chunk_end(self, req: Any, prefix_len: int, total: int) -> int:
        """Where this extend stops: the chunked-prefill size, cut at the sparse backend's next
        planned position (its ``PrefillAdder`` does the same)."""
        end = min(total, prefix_len + self.chunk)
        if self._next_cut is not None:
            with self.timer("plan"):
                cut = self._next_cut(req, prefix_len)
            if cut is not None and prefix_len < cut < end:
                end = cut
                self.cuts += 1
        return end

    def run(self, rid: str, prompt: array, out: array) -> int:
        """One request start to finish; returns the cached (resumed-from) prefix length."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        cache = self.cache
        req = Req(rid, "", array("q", prompt), self._sp(max_new_tokens=len(out), ignore_eos=True))
        req.refresh_fill_ids()  # origin + output copy (not cache work): the match below reuses it
        with self.timer("match"):
            req.init_next_round_input(cache)
        cached = int(req.prefix_len)
        total = len(req.full_untruncated_fill_ids)
        if self._plan is not None:
            with self.timer("plan"):
                self._plan(req)
        req.extend_end = self._chunk_end(req, req.prefix_len, total)
        with self.timer("lock"):
            req.lock = cache.lock(req.last_node)
        while True:
            self._extend(req)
            if req.extend_end >= total:
                break
            with self.timer("checkpoint"):  # stash_chunked_request on the next step
                checkpoint_kv_cache(req, cache)
            self.checkpoints += 1
            req.init_next_round_input()  # a chunked request continues without a rematch
            req.extend_end = self._chunk_end(req, req.prefix_len, total)
        # prefill done: the first output token; the prompt-end checkpoint
        req.output_ids.append(out[0])
        self._update_finish_state(req)
        if not req.finished():
            with self.timer("checkpoint"):
                checkpoint_kv_cache(req, cache)
            self.checkpoints += 1
        rtp = self.b.req_to_token_pool
        for tok in out[1:]:  # decode: one KV slot per step for the previous token
            seq = req.seqlen - 1
            loc = self._alloc_kv(1)
            rtp.write((req.kv.req_pool_idx, seq), loc.to(rtp.req_to_token.dtype))
            req.kv.kv_allocated_len = req.kv.kv_committed_len = seq + 1
            req.output_ids.append(tok)
            self._update_finish_state(req)
            if req.finished():
                break
        with self.timer("release"):
            release_kv_cache(req, cache, checkpoint=True)
        self.n += 1
        return cached

    @staticmethod
    def _update_finish_state(req: Any) -> None:
        """``Req.update_finish_state`` for a length-only stop (no tokenizer, no stop strings)."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        n = req.sampling_params.max_new_tokens
        if len(req.output_ids) >= n:
            req.finished_reason = FINISH_LENGTH(length=n)
            req.finished_len = n

    def take(self) -> dict[str, float]:
        t, self.t = self.t, {}
        return t


def count_nodes(cache: Any) -> int | None:
    """Tree nodes below the root (None when the tree core does not expose them)."""
    core = cache.tree_core
    arena = getattr(core, "_node_arena", None)
    if arena is not None:
        return len(arena) - 1
    for name in ("num_nodes", "node_count", "__len__"):
        f = getattr(core, name, None)
        if callable(f):
            try:
                return int(f()) - (1 if name == "__len__" else 0)
            except Exception:  # noqa: BLE001 - best effort
                pass
    return None


def pools_free(b: Built) -> tuple[int, int]:
    """``(free KV tokens, free Mamba slots)``."""
    return int(b.allocator.available_size()), int(b.req_to_token_pool.mamba_allocator.available_size())


def flush(b: Built) -> None:
    """``Scheduler.flush_cache`` for an idle scheduler."""
    b.cache.reset()
    b.req_to_token_pool.clear()
    b.allocator.clear()


@contextmanager
def _timed_method(obj: Any, name: str, sink: list[float], first_only: bool = False) -> Iterator[None]:
    """Time calls of ``obj.name`` (an instance attribute wrapper; removed afterwards)."""
    orig = getattr(obj, name)
    state = {"first": True}

    def wrapped(*a: Any, **kw: Any) -> Any:
        if first_only and not state["first"]:
            return orig(*a, **kw)
        state["first"] = False
        t0 = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapped)
    try:
        yield
    finally:
        try:
            delattr(obj, name)
        except AttributeError:
            setattr(obj, name, orig)


def eviction_walks(b: Built, n: int) -> dict[str, Any]:
    """Time ``evict(mamba_num=1)`` / ``evict(num_tokens=1)`` ``n`` times each; on Python tree cores
    also the component walk: ``_evict_device_start`` and the first ``_evict_device_next_node``."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    cache = b.cache
    comps = getattr(cache, "components", {}) or {}
    python_core = hasattr(cache.tree_core, "_node_arena")
    res: dict[str, Any] = {"nodes_before": count_nodes(cache)}
    for label, ct, ep in (
        ("mamba", ComponentType.MAMBA, EvictParams(mamba_num=1)),
        ("kv", ComponentType.FULL, EvictParams(num_tokens=1)),
    ):
        total: list[float] = []
        start: list[float] = []
        nxt: list[float] = []
        comp = comps.get(ct) if python_core else None
        for _ in range(n):
            if comp is not None:
                s0: list[float] = []
                n0: list[float] = []
                with (
                    _timed_method(comp, "_evict_device_start", s0),
                    _timed_method(comp, "_evict_device_next_node", n0, first_only=True),
                ):
                    a = time.perf_counter()
                    cache.evict(ep)
                    total.append(time.perf_counter() - a)
                start += s0
                nxt += n0
            else:
                a = time.perf_counter()
                cache.evict(ep)
                total.append(time.perf_counter() - a)
        res[f"{label}_evict_call"] = stats(total)
        if start:
            res[f"{label}_walk_start"] = stats(start)
        if nxt:
            res[f"{label}_walk_first_next"] = stats(nxt)
        if start and nxt:
            res[f"{label}_walk_start_plus_first_next"] = stats(
                [s + x for s, x in zip(start, nxt, strict=False)]
            )
    res["nodes_after"] = count_nodes(cache)
    return res


# ---------------------------------------------------------------------- one configuration


@dataclass
class Sizes:
    """Workload and pool sizes."""

    docs: int
    doc_len: int
    warmup: int
    requests: int
    out: int
    chunk: int
    new_doc_frac: float
    walks: int
    kv_tokens: int = 0
    mamba_slots: int = 0
    context_len: int = 0


def plan_sizes(quick: bool, args: argparse.Namespace) -> Sizes:
    """Sizes for a full or ``--quick`` run; pools hold ~95% of what the warm-up writes."""
    s = Sizes(
        docs=24, doc_len=31 * 1024, warmup=220, requests=60, out=8, chunk=8192, new_doc_frac=0.05, walks=5
    )
    if not quick:
        s.docs, s.warmup, s.requests, s.out, s.walks = 180, 5000, 300, 16, 20
    for k in ("docs", "warmup", "requests", "chunk"):
        v = getattr(args, k, None)
        if v is not None:
            setattr(s, k, v)
    return s


def size_pools(s: Sizes, reqs: list[dict[str, Any]]) -> None:
    """KV pool = 95% of the distinct tokens the warm-up caches (a trie over the prompts + outputs,
    counted on 64-token blocks), Mamba slots = 95% of the states SGLang's native cache keeps at
    the end of the warm-up (chunk ends, prompt ends, finishes; an upper bound of its nodes)."""
    seen: set[bytes] = set()
    toks = 0
    states = 0
    for i, r in enumerate(reqs[: s.warmup]):
        full = r["prompt"] + output_ids(i, r["out"])[:-1]
        b = full.tobytes()
        h = 0
        for a in range(0, len(full), 64):  # chained block hashes = the trie's 64-token nodes
            h = hash((h, b[8 * a : 8 * (a + 64)]))
            if h not in seen:
                seen.add(h)
                toks += min(64, len(full) - a)
        states += 2 + (len(r["prompt"]) // s.chunk if r["kind"] == "doc" else 0)
    s.kv_tokens = int(toks * 0.95)
    s.mamba_slots = max(64, int(states * 0.95))
    s.context_len = max(len(r["prompt"]) + r["out"] for r in reqs) + 16


def run_config(name: str, s: Sizes, reqs: list[dict[str, Any]], profile: Path | None) -> dict[str, Any]:
    """Build ``name``'s cache, warm it up, time ``s.requests`` requests and the eviction walks."""
    backend, _env = CONFIGS[name]
    t0 = time.perf_counter()
    model = make_model_dir(context_len=max(65536, s.context_len))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = build_cache(
            backend,
            model_dir=model,
            kv_tokens=s.kv_tokens,
            mamba_slots=s.mamba_slots,
            max_reqs=8,
            context_len=s.context_len,
            chunk=s.chunk,
        )
    print(
        f"[{name}] built {type(built.cache).__name__} (core {built.core}) "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    h = Harness(built, s.chunk)
    t0 = time.perf_counter()
    for i in range(s.warmup):
        r = reqs[i]
        h.run(f"w{i}", r["prompt"], output_ids(i, r["out"]))
        if (i + 1) % 1000 == 0:
            print(
                f"[{name}] warm-up {i + 1}/{s.warmup}: {count_nodes(built.cache)} nodes, "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    h.take()
    warm_s = time.perf_counter() - t0
    nodes_warm = count_nodes(built.cache)
    free_warm = pools_free(built)
    per_req: list[float] = []
    per_op: dict[str, list[float]] = {k: [] for k in OPS}
    hits: list[int] = []
    by_kind: dict[str, list[float]] = {}
    prof = None
    if profile is not None:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for i in range(s.warmup, s.warmup + s.requests):
        r = reqs[i]
        hits.append(h.run(f"t{i}", r["prompt"], output_ids(i, r["out"])))
        t = h.take()
        tot = sum(t.values())
        per_req.append(tot)
        by_kind.setdefault(r["kind"], []).append(tot)
        for k in OPS:
            per_op[k].append(t.get(k, 0.0))
    if prof is not None:
        prof.disable()
        import pstats

        profile.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(profile))
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(35)
        st.sort_stats("tottime").print_stats(25)
    nodes_timed = count_nodes(built.cache)
    walks = eviction_walks(built, s.walks)
    # invariant: after a flush every slot is free again
    flush(built)
    free_after = pools_free(built)
    res = {
        "config": name,
        "cache_class": type(built.cache).__name__,
        "tree_core": built.core,
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(("SGLANG_SPARSE_", "SGLANG_UNIFIED_RADIX"))
        },
        "kv_pool_tokens": built.kv_tokens,
        "mamba_slots": built.mamba_slots,
        "nodes_after_warmup": nodes_warm,
        "nodes_after_timed": nodes_timed,
        "free_after_warmup": {"kv_tokens": free_warm[0], "mamba_slots": free_warm[1]},
        "warmup_s": warm_s,
        "per_request": stats(per_req),
        "per_op": {k: stats(v) for k, v in per_op.items() if any(v)},
        "per_op_share": {k: float(sum(v) / max(sum(per_req), 1e-12)) for k, v in per_op.items() if any(v)},
        "per_kind": {k: stats(v) for k, v in by_kind.items()},
        "cached_tokens_mean": float(np.mean(hits)) if hits else 0.0,
        "token_hit_rate": float(
            sum(hits) / max(1, sum(len(reqs[i]["prompt"]) for i in range(s.warmup, s.warmup + s.requests)))
        ),
        "chunk_checkpoints_and_cuts": {"checkpoints": h.checkpoints, "sparse_cuts": h.cuts},
        "eviction_walks": walks,
        "pools_free_after_flush": free_after == (built.kv_tokens, built.mamba_slots),
    }
    if hasattr(built.cache, "sparse_stats"):
        try:
            res["sparse_stats"] = built.cache.sparse_stats()
        except Exception as e:  # noqa: BLE001 - stats are informative only
            res["sparse_stats"] = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------------- smoke check (tests)


def small_harness(backend: str | None, model: Path) -> Harness:
    """A :class:`Harness` over tiny pools (2,500 KV tokens, 24 state slots, 4 request rows, 1,024-token
    context, 128-token chunks): a few hundred-token prompts make it evict. Used by :func:`smoke` and
    ``tools/request_path.py``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = build_cache(
            backend, model_dir=model, kv_tokens=2500, mamba_slots=24, max_reqs=4, context_len=1024, chunk=128
        )
    return Harness(b, chunk=128)


def smoke(names: list[str]) -> dict[str, Any]:
    """A few hundred tokens per prompt, tiny pools, all ``names`` in this process (re-published
    one after the other): per config, the cached length of a first request, of its repeat and of
    its next turn, whether eviction ran, and whether the pools are fully free after evicting
    everything and after a flush. Used by ``tests/serving/test_scheduler_cache_harness.py``."""
    rng = np.random.default_rng(7)

    def rand(n: int) -> array:
        return random_ids(rng, n)

    doc = rand(200)
    first = doc + rand(100)
    others = [rand(300) for _ in range(12)]  # distinct prompts: the small pools must evict
    model = make_model_dir(context_len=4096)
    out: dict[str, Any] = {}
    for name in names:
        backend, env = CONFIGS[name]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            h = small_harness(backend, model)
            b = h.b
            o1 = output_ids(1, 4)
            res: dict[str, Any] = {"tree_core": b.core, "cache_class": type(b.cache).__name__}
            res["first"] = h.run("a", first, o1)
            res["repeat"] = h.run("b", first, output_ids(2, 4))
            turn = first + o1 + rand(40)
            res["turn"] = h.run("c", turn, output_ids(3, 4))
            res["turn_prefix_len"] = len(first) + len(o1) - 1
            free0 = pools_free(b)
            for i, p in enumerate(others):
                h.run(f"o{i}", p, output_ids(10 + i, 4))
            res["evict_ms"] = 1e3 * h.take().get("evict", 0.0)
            res["repeat_after_pressure"] = h.run("d", others[-1], output_ids(30, 4))
            res["free_before_pressure"] = list(free0)
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            b.cache.evict(EvictParams(num_tokens=b.kv_tokens, mamba_num=b.mamba_slots))
            res["free_after_evict_all"] = list(pools_free(b))
            flush(b)
            res["free_after_flush"] = list(pools_free(b))
            res["pool_sizes"] = [b.kv_tokens, b.mamba_slots]
            out[name] = res
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return out


# ---------------------------------------------------------------------- main


def _child(args: argparse.Namespace) -> int:
    s = plan_sizes(args.quick, args)
    reqs, _ = build_workload(
        docs=s.docs,
        doc_len=s.doc_len,
        warmup_reqs=s.warmup,
        timed_reqs=s.requests,
        out_len=s.out,
        new_doc_frac=s.new_doc_frac,
    )
    size_pools(s, reqs)
    prof = Path(args.profile_dir) / f"scheduler_cache_{args.child}.prof" if args.profile_dir else None
    res = run_config(args.child, s, reqs, prof)
    res["sizes"] = s.__dict__
    Path(args.child_out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def _row(res: dict[str, Any]) -> list[Any]:
    pr = res["per_request"]
    return [
        res["config"],
        res["tree_core"],
        res["nodes_after_warmup"],
        round(pr["median_us"] / 1e3, 2),
        round(pr["p90_us"] / 1e3, 2),
        *[round(res["per_op"].get(k, {}).get("median_us", 0.0) / 1e3, 3) for k in OPS],
        round(res["token_hit_rate"], 3),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small tree (~1k nodes), < 2 min")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {sorted(CONFIGS)}")
    ap.add_argument("--docs", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests")
    ap.add_argument("--requests", type=int, default=None, help="timed requests")
    ap.add_argument("--chunk", type=int, default=None, help="chunked prefill size (default 8192)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed phase of each config")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny correctness run (JSON to stdout; tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        print("SMOKE " + json.dumps(smoke([c for c in args.configs.split(",") if c])), flush=True)
        return 0
    if args.child:
        return _child(args)
    out = args.out or results_dir(args.quick) / "scheduler_cache.json"
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {sorted(CONFIGS)}")
    results: dict[str, Any] = {}
    prof_dir = out.parent / "profiles" if args.profile else None
    t_start = time.perf_counter()
    for name in names:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SPARSE_")}
        env.update(CONFIGS[name][1])
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            child_out = f.name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-out", child_out]
        for k in ("docs", "warmup", "requests", "chunk"):
            v = getattr(args, k)
            if v is not None:
                cmd += [f"--{k}", str(v)]
        if args.quick:
            cmd.append("--quick")
        if prof_dir is not None:
            cmd += ["--profile-dir", str(prof_dir)]
        rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
        if rc != 0:
            results[name] = {"config": name, "error": f"exit code {rc}"}
            print(f"[{name}] FAILED (exit code {rc})", flush=True)
            continue
        results[name] = json.loads(Path(child_out).read_text())
        os.unlink(child_out)
    ok = [r for r in results.values() if "error" not in r]
    header = ["config", "core", "nodes", "med ms", "p90 ms", *[f"{k} ms" for k in OPS], "hit rate"]
    print(table([_row(r) for r in ok], header))
    ratios: dict[str, float] = {}  # every config vs native, the sparse ones vs native_python
    for ref, of in (("native", lambda c: c != "native"), ("native_python", lambda c: c.startswith("sparse"))):
        base = results.get(ref)
        if base is None or "error" in base:
            continue
        for r in ok:
            if of(r["config"]):
                ratios[f"{r['config']}/{ref}"] = (
                    r["per_request"]["median_us"] / base["per_request"]["median_us"]
                )
    for k, v in ratios.items():
        print(f"{k:28s} {v:6.2f}x  (per-request median)")
    walk_rows = []
    for r in ok:
        w = r["eviction_walks"]
        for lab in ("mamba", "kv"):
            parts = ("evict_call", "walk_start", "walk_first_next", "walk_start_plus_first_next")
            meds = [round(w.get(f"{lab}_{k}", {}).get("median_us", float("nan")), 1) for k in parts]
            walk_rows.append([r["config"], lab, w.get("nodes_before"), *meds])
    header = ["config", "walk", "nodes", "evict() us", "start us", "1st next us", "start+next us"]
    print(table(walk_rows, header))
    targets: dict[str, Any] = {"sparse_over_native_per_request_max": 1.5, "eviction_walk_max_us": 1000.0}
    if "sparse/native" in ratios:
        targets["sparse_over_native"] = ratios["sparse/native"]
        targets["per_request_met"] = ratios["sparse/native"] <= 1.5
    sp = results.get("sparse")
    if sp is not None and "error" not in sp:
        w = sp["eviction_walks"]
        worst = max(
            w.get(f"{lab}_walk_start_plus_first_next", w[f"{lab}_evict_call"])["median_us"]
            for lab in ("mamba", "kv")
        )
        targets["sparse_walk_worst_median_us"] = worst
        targets["walk_met"] = worst <= 1000.0
    payload = {
        "machine": {"python": sys.version.split()[0], "cpus": os.cpu_count()},
        "quick": args.quick,
        "configs": results,
        "ratios_per_request_median": ratios,
        "target": targets,
        "total_s": time.perf_counter() - t_start,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")
    return 0 if len(ok) == len(names) else 1


if __name__ == "__main__":
    raise SystemExit(main())

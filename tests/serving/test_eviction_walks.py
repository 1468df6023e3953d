"""The sparse backend's eviction walks never evict what they iterate over and keep SGLang's tree
consistent: a regression test for issue 20 and a seeded randomized test, on SGLang's real caches.

Both run in one subprocess (this file run as a script: its own published ``ServerArgs``), which
builds, through ``benchmarks/scheduler_cache.py``'s ``build_cache``, the sparse backend's cache
(its registered factory: ``SparseRadixCache`` on the ``sparse_python`` tree core, capture ``cut``,
mirror checks on) once per serving policy, and SGLang's own ``UnifiedRadixCache`` (Python tree
core) as the control.

* **Regression (issue 20)**: insert ``[1, 2]``, ``[1, 2, 3]``, ``[1, 2, 4]``, each with a state, then
  ``evict(EvictParams(mamba_num=4))``. ``SparseMambaComponent._walk_order`` used to yield SGLang's
  Mamba LRU list lazily once the policy's scored states ran out; the caller evicted the yielded
  leaf, and the next ``get_prev_no_lock`` asserted. Every serving policy must free the three
  states SGLang's own cache frees (the KV it frees along with them follows the policy's order).
* **Drift**: the policy's mirror names a state node SGLang does not hold; both walks skip it (a
  stale mirror may cost order, never a crash) and still free everything.
* **Randomized**: per configuration, at least ``OPS`` (10,000) operations generated from ``SEED``
  (the sequence depends on the seed only; an inapplicable operation is skipped and not counted):
  requests driven like SGLang's scheduler (match with copy-on-write of the state, plan, lock,
  chunked extends with KV allocation, a checkpoint at every chunk end and at the prompt end,
  decode steps, release with the final checkpoint; up to 3 at once, so locks overlap), bare
  ``match_prefix``, direct ``insert`` of a sequence with its own KV and state, extra locks
  (``inc_lock_ref``) and their release (``dec_lock_ref``), ``evict(EvictParams(num_tokens,
  mamba_num))`` (both walks, the KV walk first) and ``evict_for_alloc`` (the allocation-shortfall
  path; the scheduler's own allocations reach it too), and rarely a flush. Pools are small (KV
  512 tokens, 16 state slots), so nearly every allocation evicts. After every operation:

  - SGLang's ``UnifiedRadixCache.sanity_check`` (tree structure, leaf sets, LRU lists, sizes);
  - sparse: ``SparseRadixCache.check_policy_mirror``, no mirror drift or invariant violation
    counted, the leaf set's id index equal to the set;
  - pool accounting: every KV index and every state slot is exactly one of free, held by the
    tree, or held by a live request (its ``req_to_token`` row / its state slot); no duplicate in
    a free list;
  - walk completeness: ``evict`` frees at least what it was asked or everything evictable, and
    ``evict_for_alloc`` and every scheduler allocation reach their target whenever the pool's
    free plus evictable part covers it.

  At the end every request is released, every lock dropped, everything evicted, and both pools
  must be entirely free. On a failure the child shrinks the operation list (suffixes, then
  chunk removal, time-bounded) and the assertion prints the shortest failing sequence.

Whole file: about 2 minutes of CPU, 2-3.5 minutes wall on 2 busy shared cores (one subprocess,
~1.3 ms of CPU per operation with its checks; ``EVICTION_WALKS_OPS`` / ``EVICTION_WALKS_SEED``
override the operation count and seed).
The child alone: ``python tests/serving/test_eviction_walks.py --configs native,lru --ops 2000``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.serving

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # the child: the repository's packages (benchmarks) importable
    sys.path[:0] = [p for p in (str(REPO), str(REPO / "kernels")) if p not in sys.path]
OPS = int(os.environ.get("EVICTION_WALKS_OPS", "10000"))
SEED = int(os.environ.get("EVICTION_WALKS_SEED", "20"))
PREFIX = "EVICTION_WALKS "

# pools and workload (small, so that nearly every allocation evicts)
KV_TOKENS = 512
MAMBA_SLOTS = 16
MAX_REQS = 4  # request rows
CHUNK = 16  # chunked-prefill size: prompts of up to 64 tokens take up to 4 extends
MAX_PROMPT = 64
MAX_OUT = 6
MAX_LIVE = 3  # requests in flight at once
MAX_PINS = 2  # extra locks held at once
N_BASES = 6
BASE_LEN = 56
#: sparse options of every sparse configuration (a 16-token grid plans states on these short prompts)
SPARSE_ENV = {
    "SGLANG_SPARSE_CAPTURE": "cut",
    "SGLANG_SPARSE_CHECK_INVARIANTS": "1",
    "SGLANG_SPARSE_GRID": "16",
}

#: one operation: ``("start", prompt, out)``, ``("advance", k)``, ``("match", seq)``,
#: ``("insert", seq)``, ``("pin", seq, anchor)``, ``("unpin", k)``, ``("evict", num_tokens,
#: mamba_num)``, ``("evict_for_alloc", num_tokens, mamba_num)``, ``("flush",)``; ``k`` picks a live
#: request / lock modulo their number
Op = tuple


def serving_policies() -> list[str]:
    """``sglang_sparse.policy.POLICY_NAMES`` minus the simulator-only ones (as the config does)."""
    from sglang_sparse.policy import POLICY_NAMES, get_policy

    return [n for n in POLICY_NAMES if not get_policy(n).needs_law_provider]


# ====================================================================== the parent (pytest)

if __name__ != "__main__":
    _MISSING = [m for m in ("torch", "sglang", "transformers") if importlib.util.find_spec(m) is None]
    if _MISSING:
        pytest.skip(
            f"serving stack not installed ({', '.join(_MISSING)} missing); run tools/setup_env.sh",
            allow_module_level=True,
        )
    from importlib.metadata import entry_points

    if not any(ep.name == "sparse" for ep in entry_points(group="sglang.srt.plugins")):
        pytest.skip(
            "sglang_sparse is installed without its 'sparse' sglang plugin entry point; "
            "run `pip install -e . --no-deps` in the serving venv",
            allow_module_level=True,
        )

POLICIES = serving_policies()
CONFIGS = ["native", *POLICIES]


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    """Run this file as the child once, for every configuration; its JSON report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SPARSE_")}
    env.pop("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--configs", ",".join(CONFIGS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, f"child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(lines[-1][len(PREFIX) :])


def _failure(r: dict[str, Any]) -> str:
    """The assertion message of a failed randomized run: where, what, the shrunk operations."""
    e = r.get("error")
    if not e:
        return ""
    trace = e.get("minimal_trace") or []
    shown = "\n".join(f"  {i:>4}: {op}" for i, op in enumerate(trace) if i >= len(trace) - 200)
    return (
        f"{e['where']}: {e['signature']}\n{e['traceback'][-3000:]}\n"
        f"shortest failing operation sequence found: {len(trace)} ops (of {e['trace_len']}, seed "
        f"{e['seed']}; the last 200 shown; replay: run_ops(config, ops)):\n{shown}"
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_issue20_three_states_evict(child: dict[str, Any], policy: str) -> None:
    """``[1,2]``, ``[1,2,3]``, ``[1,2,4]`` with states, ``evict(mamba_num=4)``: no assertion, the
    three states freed as by SGLang's own cache, the tree consistent, nothing leaked."""
    native = child["repro"]["native"]
    r = child["repro"][policy]
    assert not r.get("error"), r["error"]
    assert native["mamba_num_evicted"] == 3, native  # SGLang frees all three
    assert r["mamba_num_evicted"] == native["mamba_num_evicted"], r
    assert r["mamba_free"] == native["mamba_free"] == MAMBA_SLOTS, r
    assert r["states_left"] == 0, r
    # the KV evicted with them depends on the order (a leaf first frees its KV too), and is freed
    assert r["kv_free"] - r["kv_free_before"] == r["num_tokens_evicted"], r
    assert r["kv_free"] + r["kv_held"] == KV_TOKENS, r


@pytest.mark.parametrize("policy", POLICIES)
def test_walks_skip_a_node_sglang_no_longer_holds(child: dict[str, Any], policy: str) -> None:
    """A mirror that drifted (here: a phantom state node) costs order, never a crash: both walks
    skip the phantom and free every state and KV token SGLang holds."""
    r = child["drift"][policy]
    assert not r.get("error"), r["error"]
    assert r["mamba"]["mamba_free"] == MAMBA_SLOTS, r
    assert r["kv"] == {"kv_free": KV_TOKENS, "mamba_free": MAMBA_SLOTS}, r


@pytest.mark.parametrize("config", CONFIGS)
def test_random_operations(child: dict[str, Any], config: str) -> None:
    """At least ``OPS`` seeded operations, every invariant checked after each: no failure."""
    r = child["random"][config]
    assert not r.get("error"), _failure(r)
    ops = r["ops"]
    assert r["executed"] >= OPS, r
    # every kind of operation ran, and the walks under test ran often (10,000 ops: >= 50 of each
    # kind, >= 500 walks of each component, >= 1,000 states and 10,000 KV tokens evicted by the
    # explicit evictions alone)
    for kind in ("start", "advance", "match", "insert", "pin", "unpin", "evict", "evict_for_alloc"):
        assert ops.get(kind, 0) >= OPS // 200, (kind, ops)
    assert min(r["walks"]["MAMBA"], r["walks"]["FULL"]) >= OPS // 20, r["walks"]
    assert r["states_evicted"] >= OPS // 10 and r["kv_evicted"] >= OPS, r
    assert r["final"] == {"kv_free": KV_TOKENS, "mamba_free": MAMBA_SLOTS}, r["final"]
    if config != "native":
        s = r["sparse_stats"]
        assert s["invariant_violations"] == 0 and s["mirror_errors"] == 0, s
        assert min(s["kv_eviction_walks"], s["eviction_walks"]) >= OPS // 20, s


def test_unscored_fallback_exercised(child: dict[str, Any]) -> None:
    """The Mamba walk's fallback to SGLang's LRU order (where issue 20 was) ran under load: some
    policy offered no score for some states, and their leaves were evicted from the fallback."""
    fallback = {p: child["random"][p]["sparse_stats"]["unscored_evictions"] for p in POLICIES}
    assert sum(fallback.values()) >= OPS // 100, fallback


# ====================================================================== the child

_WHERE = ""  # what the current operation is doing (for the failure report)


class CheckFailed(AssertionError):
    """An invariant the test checks (not one SGLang asserts) does not hold."""


def _need(cond: bool, msg: Callable[[], str] | str) -> None:
    """Raise :class:`CheckFailed` with ``msg`` (a string, or built lazily) unless ``cond``."""
    if not cond:
        raise CheckFailed(msg() if callable(msg) else msg)


def gen_ops(seed: int) -> Iterator[Op]:
    """The operation stream of ``seed`` (infinite; a function of the seed only, so any sub-list
    can be replayed). Sequences share bases (prefixes of different lengths: splits), extend earlier
    requests (turns), repeat or cut them (partial overlaps), with suffixes from a 12-token alphabet
    (collisions)."""
    rng = random.Random(seed)
    bases = [[rng.randrange(16, 4096) for _ in range(BASE_LEN)] for _ in range(N_BASES)]
    history: list[tuple[int, ...]] = []

    def suffix(n: int) -> list[int]:
        return [rng.randrange(4, 16) for _ in range(n)]

    def seq(max_len: int = MAX_PROMPT) -> tuple[int, ...]:
        u = rng.random()
        if history and u < 0.25:  # a turn: an earlier sequence + new tokens
            s = list(rng.choice(history[-40:])) + suffix(rng.randint(1, 12))
        elif history and u < 0.45:  # an earlier sequence, whole or cut anywhere
            h = rng.choice(history[-40:])
            s = list(h[: rng.randint(1, len(h))]) if rng.random() < 0.5 else list(h)
        else:
            b = rng.choice(bases)
            s = b[: rng.choice((0, 8, 16, 24, 32, 40, 48, rng.randint(1, BASE_LEN)))] + suffix(
                rng.randint(1, 12)
            )
        return tuple(s[:max_len])

    while True:
        u = rng.random()
        if u < 0.16:
            prompt = seq()
            out = tuple(rng.randrange(4, 16) for _ in range(rng.randint(1, MAX_OUT)))
            history.append(prompt + out)
            yield ("start", prompt, out)
        elif u < 0.56:
            yield ("advance", rng.randrange(MAX_LIVE))
        elif u < 0.62:
            yield ("match", seq())
        elif u < 0.76:
            s = seq()
            history.append(s)
            yield ("insert", s)
        elif u < 0.80:
            yield ("pin", seq(), rng.randrange(2))
        elif u < 0.84:
            yield ("unpin", rng.randrange(MAX_PINS))
        elif u < 0.995:  # mostly small (pressure comes from the allocations), now and then all
            v = rng.random()
            if v < 0.03:  # everything: the KV walk first, then the Mamba walk finds inner states
                kv, st = KV_TOKENS, MAMBA_SLOTS
            elif v < 0.08:  # every state: the Mamba walk runs past the policy's scored states
                kv, st = 0, MAMBA_SLOTS
            elif v < 0.10:  # every KV leaf
                kv, st = KV_TOKENS, 0
            else:
                kv = rng.choice((0, 1, rng.randint(1, 8), rng.randint(1, 32), rng.randint(1, 128)))
                st = rng.choice((0, 1, 1, 2, rng.randint(1, 4)))
                if kv == st == 0:
                    st = 1
            yield ("evict" if u < 0.915 else "evict_for_alloc", kv, st)
        else:
            yield ("flush",)


@dataclass
class Live:
    """A request in flight: its ``Req``, its output tokens, its phase."""

    req: Any
    out: tuple[int, ...]
    total: int
    phase: str = "prefill"  # prefill -> decode -> done (released by the next advance)


@dataclass
class Driver:
    """Drives one cache like SGLang's scheduler plus direct tree operations; checks after each."""

    built: Any
    sparse: bool
    live: list[Live] = field(default_factory=list)
    pins: list[Any] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)
    walks: Counter = field(default_factory=Counter)
    #: states / KV tokens the explicit ``evict`` and ``evict_for_alloc`` operations freed
    states_evicted: int = 0
    kv_evicted: int = 0
    n_rid: int = 0
    #: per check: tree nodes, states held, nodes locked (sums and maxima, for the report)
    shape: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.cache = self.built.cache
        self.rtp = self.built.req_to_token_pool
        self.alloc = self.built.allocator
        self.malloc = self.rtp.mamba_allocator
        self._sp = SamplingParams
        core = self.cache.tree_core
        orig = core.evict_device_start

        def counted(ct: Any, request_cnt: int) -> None:
            self.walks[ct.name] += 1
            return orig(ct, request_cnt)

        core.evict_device_start = counted  # instance attribute: the cache calls it through the core

    # ------------------------------------------------------------------ allocation (scheduler)

    def _reclaimable_kv(self) -> int:
        """Free KV tokens plus the tree's unlocked (evictable) ones."""
        return int(self.alloc.available_size() + self.cache.full_evictable_size())

    def _reclaimable_states(self) -> int:
        """Free state slots plus the tree's unlocked (evictable) states."""
        return int(self.malloc.available_size() + self.cache.mamba_evictable_size())

    def _alloc_kv(self, n: int) -> Any:
        """``alloc_token_slots``: evict for the shortfall (``evict_for_alloc``), then allocate."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        could = self._reclaimable_kv() >= n
        evict_from_tree_cache(self.cache, n)
        loc = self.alloc.alloc(n)
        if loc is None:
            _need(not could, f"KV allocation of {n} failed although free + evictable covered it")
            raise CheckFailed(f"harness over-committed the KV pool ({n} tokens)")
        return loc

    def _extend(self, req: Any) -> None:
        """``alloc_for_extend`` of one request (row + state slot the first time, prefix, KV)."""
        import torch
        from sglang.srt.mem_cache.allocation import ensure_mamba_capacity

        if not req.kv.holds_kv:
            could = self._reclaimable_states() >= (0 if req.kv.holds_mamba else 1)
            ok = ensure_mamba_capacity(self.rtp, [req], self.cache)
            _need(ok or not could, "ensure_mamba_capacity failed although free + evictable covered it")
            _need(ok, "harness over-committed the state pool")
            _need(self.rtp.alloc([req]) is not None, "request row allocation failed")
            if req.prefix_len:
                prefix = self.cache.prefix_device_indices(req)
                self.rtp.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix.to(torch.int32))
        loc = self._alloc_kv(req.extend_end - req.prefix_len)
        self.rtp.write((req.kv.req_pool_idx, slice(req.prefix_len, req.extend_end)), loc.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end

    def _chunk_end(self, req: Any, total: int) -> int:
        """Where this extend stops: the chunk size, or the sparse plan's next cut before it."""
        end = min(total, req.prefix_len + CHUNK)
        if self.sparse:  # the sparse PrefillAdder ends the chunk at the next planned cut
            cut = self.cache.next_cut(req, req.prefix_len)
            if cut is not None and req.prefix_len < cut < end:
                end = cut
        return end

    @staticmethod
    def _update_finish_state(req: Any) -> None:
        """``Req.update_finish_state`` for a length-only stop."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        n = req.sampling_params.max_new_tokens
        if len(req.output_ids) >= n:
            req.finished_reason = FINISH_LENGTH(length=n)
            req.finished_len = n

    # ------------------------------------------------------------------ operations

    def apply(self, op: Op) -> bool:
        """Run ``op``; False if it does not apply to the current state (skipped, not counted)."""
        kind = op[0]
        if kind == "start" and len(self.live) >= MAX_LIVE:
            return False
        if kind == "advance" and not self.live:
            return False
        if kind == "unpin" and not self.pins:
            return False
        if kind == "pin" and len(self.pins) >= MAX_PINS:
            return False
        if kind == "flush" and (self.live or self.pins):
            return False
        done = getattr(self, "_op_" + kind)(*op[1:])
        if done is False:
            return False
        self.ops[kind] += 1
        return True

    def _op_start(self, prompt: tuple[int, ...], out: tuple[int, ...]) -> None:
        """Admit a request: match (state copy-on-write), plan, lock, first extend."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req

        self.n_rid += 1
        req = Req(
            f"r{self.n_rid}", "", array("q", prompt), self._sp(max_new_tokens=len(out), ignore_eos=True)
        )
        req.refresh_fill_ids()
        req.init_next_round_input(self.cache)  # match + copy-on-write of the matched state
        if self.sparse:
            self.cache.plan_request(req)  # what the sparse PrefillAdder asks at admission
        total = len(req.full_untruncated_fill_ids)
        req.extend_end = self._chunk_end(req, total)
        req.lock = self.cache.lock(req.last_node)
        lv = Live(req, out, total)
        self.live.append(lv)
        self._extend(req)

    def _op_advance(self, k: int) -> None:
        """One scheduler step of live request ``k``: the next chunk (after its chunk-end
        checkpoint), the end of prefill (first token, prompt-end checkpoint), one decode token, or
        the release (final checkpoint, unlock) once finished."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        lv = self.live[k % len(self.live)]
        req = lv.req
        if lv.phase == "prefill":
            if req.extend_end < lv.total:  # next chunk: stash (chunk-end checkpoint), extend
                checkpoint_kv_cache(req, self.cache)
                req.init_next_round_input()
                req.extend_end = self._chunk_end(req, lv.total)
                self._extend(req)
                return
            req.output_ids.append(lv.out[0])  # prefill done: first token, prompt-end checkpoint
            self._update_finish_state(req)
            if not req.finished():
                checkpoint_kv_cache(req, self.cache)
            lv.phase = "done" if req.finished() else "decode"
        elif lv.phase == "decode":
            seq = req.seqlen - 1
            loc = self._alloc_kv(1)
            self.rtp.write((req.kv.req_pool_idx, seq), loc.to(self.rtp.req_to_token.dtype))
            req.kv.kv_allocated_len = req.kv.kv_committed_len = seq + 1
            req.output_ids.append(lv.out[len(req.output_ids)])
            self._update_finish_state(req)
            if req.finished():
                lv.phase = "done"
        else:
            release_kv_cache(req, self.cache, checkpoint=True)
            self.live.remove(lv)

    def _key(self, seq: tuple[int, ...]) -> Any:
        """SGLang's ``RadixKey`` of ``seq``."""
        from array import array

        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", seq), None)

    def _op_match(self, seq: tuple[int, ...]) -> None:
        """A bare ``match_prefix`` (no request): LRU refresh, maybe a split."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        self.cache.match_prefix(MatchPrefixParams(key=self._key(seq)))

    def _op_insert(self, seq: tuple[int, ...]) -> None:
        """A sequence with its own KV and state (a request that never matched), as
        ``checkpoint_into_tree`` inserts it; the insert frees the KV it duplicates, the state slot
        is freed here if the node already has one."""
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

        kv = self._alloc_kv(len(seq))
        could = self._reclaimable_states() >= 1
        if self.malloc.available_size() < 1:
            self.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
        slot = self.malloc.alloc(1)
        if slot is None:
            self.alloc.free(kv)
            _need(not could, "state allocation failed although free + evictable covered it")
            raise CheckFailed("harness over-committed the state pool")
        r = self.cache.insert(InsertParams(key=self._key(seq), value=kv.to(torch.int64), mamba_value=slot))
        if r.mamba_exist:
            self.malloc.free(slot)

    def _op_pin(self, seq: tuple[int, ...], anchor: int) -> bool | None:
        """``inc_lock_ref`` on the node a match of ``seq`` ends on (``anchor`` 0: its state-aligned
        node, 1: the deepest node it visited); kept until an ``unpin``. False if it is the root."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        m = self.cache.match_prefix(MatchPrefixParams(key=self._key(seq)))
        node = m.last_device_node if anchor == 0 else m.last_visited_node_id
        if node is None or node == self.cache.tree_core.root_node.id:
            return False
        self.pins.append(self.cache.lock(node))
        return None

    def _op_unpin(self, k: int) -> None:
        """``dec_lock_ref`` of a lock taken by ``pin``."""
        self.cache.unlock(self.pins.pop(k % len(self.pins)))

    def _evict_op(self, num_tokens: int, mamba_num: int, for_alloc: bool) -> None:
        """``evict`` or ``evict_for_alloc``; what it reports is what the pools got back, and it
        frees what it must (see the module docstring)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        kv0, st0 = self.alloc.available_size(), self.malloc.available_size()
        e_kv, e_st = int(self.cache.full_evictable_size()), int(self.cache.mamba_evictable_size())
        p = EvictParams(num_tokens=num_tokens, mamba_num=mamba_num)
        r = self.cache.evict_for_alloc(p) if for_alloc else self.cache.evict(p)
        kv1, st1 = self.alloc.available_size(), self.malloc.available_size()
        self.kv_evicted += r.num_tokens_evicted
        self.states_evicted += r.mamba_num_evicted
        _need(kv1 - kv0 == r.num_tokens_evicted, f"KV freed {kv1 - kv0} != reported {r.num_tokens_evicted}")
        _need(st1 - st0 == r.mamba_num_evicted, f"states freed {st1 - st0} != reported {r.mamba_num_evicted}")
        if for_alloc:  # the shortfall is met whenever free + evictable covers it
            _need(kv1 >= min(kv0 + num_tokens, kv0 + e_kv), f"{p}: KV {kv0} -> {kv1}, evictable {e_kv}")
            _need(st1 >= min(st0 + mamba_num, st0 + e_st), f"{p}: states {st0} -> {st1}, evictable {e_st}")
        else:  # at least what was asked, or everything evictable
            _need(r.num_tokens_evicted >= min(num_tokens, e_kv), f"{p}: {r}, evictable KV {e_kv}")
            _need(r.mamba_num_evicted >= min(mamba_num, e_st), f"{p}: {r}, evictable states {e_st}")

    def _op_evict(self, num_tokens: int, mamba_num: int) -> None:
        """``evict(EvictParams(num_tokens, mamba_num))``: the KV walk, then the Mamba walk."""
        self._evict_op(num_tokens, mamba_num, for_alloc=False)

    def _op_evict_for_alloc(self, num_tokens: int, mamba_num: int) -> None:
        """``evict_for_alloc(EvictParams(num_tokens, mamba_num))``: shortfalls as targets."""
        self._evict_op(num_tokens, mamba_num, for_alloc=True)

    def _op_flush(self) -> None:
        """``Scheduler.flush_cache`` of an idle scheduler."""
        self.cache.reset()
        self.rtp.clear()
        self.alloc.clear()

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """Every invariant of the module docstring, after one operation."""
        from sglang_sparse.sglang_adapter.cache import _LeafSet

        c = self.cache
        c.sanity_check()  # SGLang's own: structure, leaf sets, LRU lists, size accounting
        if self.sparse:
            c.check_policy_mirror()
            _need(c.invariant_violations == 0, lambda: f"invariant violated {c.last_invariant_error}")
            _need(c.policy.stats.mirror_errors == 0, "mirror drift")
            leaves = c.tree_core.evictable_device_leaves
            _need(isinstance(leaves, _LeafSet), f"leaf set replaced by {type(leaves).__name__}")
            _need(leaves.by_id == {n.id: n for n in leaves}, "leaf id index differs from the leaf set")
        self.check_pools()

    def _tree_values(self) -> tuple[list[int], list[int]]:
        """The KV indices and the state slots SGLang's tree holds (every node's device values)."""
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        kv: list[int] = []
        states: list[int] = []
        full, mamba = ComponentType.FULL, ComponentType.MAMBA
        stack = list(self.cache.tree_core.root_node.children.values())
        nodes = locked = 0
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            nodes += 1
            cd = n.component_data
            locked += cd[full].lock_ref > 0
            if cd[full].value is not None:
                kv += cd[full].value.tolist()
            if cd[mamba].value is not None:
                states += cd[mamba].value.reshape(-1).tolist()
        sh = self.shape
        sh["checks"] += 1
        for k, v in (("nodes", nodes), ("states", len(states)), ("locked", locked)):
            sh[k + "_sum"] += v
            sh[k + "_max"] = max(sh[k + "_max"], v)
        return kv, states

    def check_pools(self) -> None:
        """Every KV index in ``1..KV_TOKENS`` and every state slot in ``1..MAMBA_SLOTS`` is exactly
        one of: free, held by the tree, held by a live request; no request row points at a free
        KV index; the allocators' sizes equal their free lists."""
        tree, mtree = self._tree_values()
        free = self.alloc.free_pages.tolist() + self.alloc.release_pages.tolist()
        in_tree = set(tree)
        mine: list[int] = []
        free_set = set(free)
        for lv in self.live:
            kv = lv.req.kv
            if kv.req_pool_idx is None or not kv.holds_kv:
                continue
            row = self.rtp.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len].tolist()
            _need(not free_set.intersection(row), lambda r=lv.req: f"{r.rid}: its row holds a free KV index")
            mine += [i for i in row if i not in in_tree]
        _account("KV", KV_TOKENS, free=free, tree=tree, requests=mine)
        _need(self.alloc.available_size() == len(free), "KV available_size differs from the free list")
        mfree = self.malloc.free_slots.tolist()
        mreq = [int(lv.req.kv.mamba_pool_idx) for lv in self.live if lv.req.kv.holds_mamba]
        _account("state", MAMBA_SLOTS, free=mfree, tree=mtree, requests=mreq)

    # ------------------------------------------------------------------ end of run

    def drain(self) -> dict[str, int]:
        """Release every request and lock, evict everything: both pools must be entirely free."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        global _WHERE
        _WHERE = "drain"
        while self.live:
            self._op_advance(0)
            self.check()
        while self.pins:
            self._op_unpin(0)
            self.check()
        self.cache.evict(EvictParams(num_tokens=KV_TOKENS, mamba_num=MAMBA_SLOTS))
        self.check()
        return {"kv_free": int(self.alloc.available_size()), "mamba_free": int(self.malloc.available_size())}


def _account(what: str, size: int, **holders: list[int]) -> None:
    """Each of ``1..size`` held exactly once across ``holders`` (lists of indices; 0 never)."""
    counts = [0] * (size + 1)
    for idx in holders.values():
        for i in idx:
            counts[i] += 1
    bad = [i for i, c in enumerate(counts) if c != (i > 0)]
    if bad:
        raise CheckFailed(
            f"{what} accounting: "
            + ", ".join(
                f"index {i}: " + ", ".join(f"{k} x{v.count(i)}" for k, v in holders.items()) for i in bad[:8]
            )
        )


# ---------------------------------------------------------------------- building


_MODEL: Path | None = None


def build(config: str) -> Any:
    """A fresh cache of ``config`` (``native``: SGLang's own, Python tree core; else the sparse
    backend with ``SGLANG_SPARSE_POLICY=config``), ``ServerArgs`` re-published."""
    from benchmarks.scheduler_cache import build_cache

    for k in [k for k in os.environ if k.startswith("SGLANG_SPARSE_")]:
        del os.environ[k]
    if config == "native":
        os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
        backend = None
    else:
        os.environ.pop("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)
        os.environ.update(SPARSE_ENV, SGLANG_SPARSE_POLICY=config)
        backend = "sparse"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = build_cache(
            backend,
            model_dir=_MODEL,
            kv_tokens=KV_TOKENS,
            mamba_slots=MAMBA_SLOTS,
            max_reqs=MAX_REQS,
            context_len=512,
            chunk=CHUNK,
        )
    want = "UnifiedRadixCache" if config == "native" else "SparseRadixCache"
    if type(b.cache).__name__ != want or (config == "native" and b.core != "UnifiedTreeCore"):
        raise RuntimeError(f"{config}: built {type(b.cache).__name__} on {b.core}")
    return b


def close(b: Any) -> None:
    """Release what a built cache holds outside the process (the sparse policy's tuning worker)."""
    policy = getattr(b.cache, "policy", None)
    if policy is not None:
        policy.close()  # the alpha-tuning worker process, if one started


# ---------------------------------------------------------------------- regression (issue 20)


def insert_with_states(b: Any, seqs: list[list[int]]) -> None:
    """Insert each sequence with fresh KV indices and a fresh state slot (each a new node end)."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    for toks in seqs:
        kv = b.allocator.alloc(len(toks))
        slot = b.req_to_token_pool.mamba_allocator.alloc(1)
        r = b.cache.insert(InsertParams(key=RadixKey(toks, None), value=kv.to(torch.int64), mamba_value=slot))
        if r.mamba_exist:
            raise RuntimeError(f"{toks} already had a state")


def repro(config: str) -> dict[str, Any]:
    """Insert [1,2], [1,2,3], [1,2,4] with a state each; ``evict(mamba_num=4)``."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    b = build(config)
    try:
        c = b.cache
        insert_with_states(b, [[1, 2], [1, 2, 3], [1, 2, 4]])
        c.sanity_check()
        kv_before = int(b.allocator.available_size())
        try:
            r = c.evict(EvictParams(mamba_num=4))
            c.sanity_check()
            if hasattr(c, "check_policy_mirror"):
                c.check_policy_mirror()
                assert c.invariant_violations == 0, c.last_invariant_error
        except Exception as e:  # noqa: BLE001 - reported to the parent
            return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        d = Driver(b, sparse=config != "native")
        kv_held, states_held = d._tree_values()
        d.check_pools()
        return {
            "mamba_num_evicted": r.mamba_num_evicted,
            "num_tokens_evicted": r.num_tokens_evicted,
            "kv_free_before": kv_before,
            "kv_free": int(b.allocator.available_size()),
            "kv_held": len(kv_held),
            "mamba_free": int(b.req_to_token_pool.mamba_allocator.available_size()),
            "states_left": len(states_held),
        }
    finally:
        close(b)


def drift(config: str) -> dict[str, Any]:
    """The policy's mirror names a node (with a state) that SGLang does not hold, as after drift:
    both walks must skip it and still free everything SGLang holds."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    b = build(config)
    try:
        c = b.cache
        phantom = 1 << 40
        c.policy.on_node_added(phantom, c.tree_core.root_node.id, 3, 99)
        c.policy.on_state_set(phantom)
        out: dict[str, Any] = {}
        for label, params in (
            ("mamba", EvictParams(mamba_num=MAMBA_SLOTS)),
            ("kv", EvictParams(num_tokens=KV_TOKENS)),
        ):
            insert_with_states(b, [[1, 2], [1, 2, 3], [1, 2, 4], [5, 6]])
            try:
                c.evict(params)
                c.sanity_check()
            except Exception as e:  # noqa: BLE001 - reported to the parent
                return {"error": f"{label} walk: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
            out[label] = {
                "kv_free": int(b.allocator.available_size()),
                "mamba_free": int(b.req_to_token_pool.mamba_allocator.available_size()),
            }
        return out
    finally:
        close(b)


# ---------------------------------------------------------------------- randomized


def run_ops(config: str, ops: list[Op] | Iterator[Op], limit: int | None = None) -> dict[str, Any]:
    """Apply ``ops`` (until ``limit`` executed) to a fresh cache of ``config``, checking after each,
    then drain. Returns counters, or ``error`` (where, signature, traceback, the consumed ops)."""
    global _WHERE
    b = build(config)
    d = Driver(b, sparse=config != "native")
    consumed: list[Op] = []
    executed = 0
    try:
        d.check()
        for op in ops:
            if limit is not None and executed >= limit:
                break
            consumed.append(op)
            _WHERE = f"op {len(consumed) - 1} {op[0]}"
            if d.apply(op):
                executed += 1
                d.check()
        final = d.drain()
        _need(final == {"kv_free": KV_TOKENS, "mamba_free": MAMBA_SLOTS}, f"leak at the end: {final}")
    except Exception as e:  # noqa: BLE001 - reported to the parent (with a shrunk trace)
        return {
            "error": {
                "where": _WHERE,
                "signature": _signature(e),
                "traceback": traceback.format_exc(),
                "trace": consumed,
            },
            "executed": executed,
        }
    finally:
        close(b)
    out: dict[str, Any] = {
        "executed": executed,
        "consumed": len(consumed),
        "ops": dict(d.ops),
        "walks": dict(d.walks),
        "final": final,
        "states_evicted": d.states_evicted,
        "kv_evicted": d.kv_evicted,
        "tree": {
            **{k: v for k, v in d.shape.items() if k.endswith("_max")},
            **{
                k[:-4] + "_mean": round(v / max(1, d.shape["checks"]), 1)
                for k, v in d.shape.items()
                if k.endswith("_sum")
            },
        },
    }
    if d.sparse:
        out["sparse_stats"] = {
            k: v for k, v in b.cache.sparse_stats().items() if isinstance(v, int | float | bool)
        }
    return out


def _signature(e: BaseException) -> str:
    """What identifies a failure across shrinking: the exception type and the innermost frame."""
    tb = traceback.extract_tb(e.__traceback__)
    frame = f"{Path(tb[-1].filename).name}:{tb[-1].name}" if tb else "?"
    return f"{type(e).__name__} at {frame}"


def shrink(config: str, trace: list[Op], signature: str, budget_s: float) -> list[Op]:
    """A shorter operation list failing with the same signature: shortest failing suffix (x4
    steps), then chunk removal (halving chunk sizes), within ``budget_s`` seconds."""
    t_end = time.perf_counter() + budget_s

    def fails(ops: list[Op]) -> bool:
        r = run_ops(config, ops)
        return "error" in r and r["error"]["signature"] == signature

    best = trace
    n = 4
    while n < len(best) and time.perf_counter() < t_end:
        if fails(best[-n:]):
            best = best[-n:]
            break
        n *= 4
    chunk = max(1, len(best) // 2)
    while chunk >= 1 and time.perf_counter() < t_end:
        i = 0
        removed = False
        while i < len(best) and time.perf_counter() < t_end:
            cand = best[:i] + best[i + chunk :]
            if cand and fails(cand):
                best = cand
                removed = True
            else:
                i += chunk
        if not removed:
            chunk //= 2
    return best


def main(argv: list[str] | None = None) -> int:
    """The child: regression and drift scenarios, then the randomized run of every configuration;
    prints the JSON report on one line starting with ``PREFIX``."""
    global _MODEL
    ap = argparse.ArgumentParser(description="child of tests/serving/test_eviction_walks.py")
    ap.add_argument("--configs", default=",".join(["native", *serving_policies()]))
    ap.add_argument("--ops", type=int, default=OPS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--shrink-seconds", type=float, default=300.0, help="for all failures together")
    ap.add_argument("--skip-repro", action="store_true")
    args = ap.parse_args(argv)
    from benchmarks.scheduler_cache import make_model_dir

    configs = [c for c in args.configs.split(",") if c]
    report: dict[str, Any] = {"repro": {}, "drift": {}, "random": {}, "seed": args.seed, "ops": args.ops}
    with tempfile.TemporaryDirectory(prefix="eviction_walks_") as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODEL = make_model_dir(Path(tmp) / "model", context_len=1024)
        if not args.skip_repro:
            for c in configs:
                report["repro"][c] = repro(c)
                if c != "native":
                    report["drift"][c] = drift(c)
        shrink_until = None
        for c in configs:
            t0 = time.perf_counter()
            r = run_ops(c, gen_ops(args.seed), limit=args.ops)
            r["seconds"] = round(time.perf_counter() - t0, 1)
            e = r.get("error")
            if e:
                trace = e.pop("trace")
                e["trace_len"] = len(trace)
                e["seed"] = args.seed
                if shrink_until is None:
                    shrink_until = time.perf_counter() + args.shrink_seconds
                budget = min(120.0, shrink_until - time.perf_counter())
                e["minimal_trace"] = shrink(c, trace, e["signature"], budget) if budget > 0 else trace
            print(f"[{c}] {json.dumps({k: v for k, v in r.items() if k != 'error'})}", flush=True)
            if e:
                print(f"[{c}] FAILED {e['where']}: {e['signature']}", flush=True)
            report["random"][c] = r
    print(PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

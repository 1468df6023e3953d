"""``SGLANG_SPARSE_CAPTURE=forward`` (in-forward state capture) on the real SGLang 0.5.23 CPU server.

One module-scoped run of the sequential workload of ``test_sparse_backend.py`` (trace-like shared
prefixes, partial overlaps, a 3-turn session) on three servers, one at a time, and the session's
no-cache server: the native cache, the sparse cache on the chunk-cut path and on the forward-capture
path (both with
``SGLANG_SPARSE_MIN_CUT_GAIN=0``, so every planned position is captured, and
``SGLANG_SPARSE_TAIL_GRID=1``, so both plan the same positions). Then a concurrent storm
with aborts against a tiny state pool, and server-free unit tests of the publish/free logic
(fake allocator and policy). About 5 minutes on 2 cores.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sparse_testing.reference import NoCacheReference
from sparse_testing.storm import CAPTURE_OUTCOMES
from test_sparse_backend import (  # sibling test module (pytest puts tests/serving on sys.path)
    NEW,
    _start,
    assert_one_tree,
    session_turns,
    sparse_stats,
    toks,
    workload,
)

pytestmark = pytest.mark.serving

SPARSE = ["--radix-cache-backend", "sparse"]
#: the same plan on both paths: every planned position captured, and the tail prior's positions at
#: the predicted depths (auto would put them there only with capture=forward, on the grid with cut)
EXACT = {"SGLANG_SPARSE_MIN_CUT_GAIN": "0", "SGLANG_SPARSE_TAIL_GRID": "1"}


def prefill_forwards(srv) -> int:
    """Prefill forwards the scheduler ran (one ``Prefill batch`` log line each)."""
    return Path(srv.log_path).read_text(errors="replace").count("Prefill batch")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sglang_sparse.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next_capture"), arch="qwen3_next", seed=0)


@pytest.fixture(scope="module")
def runs(model_dir: Path, nocache: NoCacheReference) -> dict[str, dict]:
    configs = {
        "native": ([], {}),
        "cut": (SPARSE, {**EXACT, "SGLANG_SPARSE_CAPTURE": "cut"}),
        "forward": (SPARSE, {**EXACT, "SGLANG_SPARSE_CAPTURE": "forward"}),
    }
    out: dict[str, dict] = {}
    for name, (extra, env) in configs.items():
        srv = _start(model_dir, extra, env=env)
        try:
            res = [srv.generate(p, NEW) for p in workload()]
            sess, sess_cached = session_turns(srv)
            out[name] = {
                "outputs": [r.output_ids for r in res] + sess,
                "cached": [r.cached_tokens for r in res] + sess_cached,
                "forwards": prefill_forwards(srv),
                "stats": sparse_stats(srv) if extra == SPARSE else None,
            }
        finally:
            srv.stop()
    nocache.check_model(model_dir)  # the session's no-cache server (the same answers, memoized)
    out["nocache"] = {"outputs": nocache.outputs(workload(), NEW) + session_turns(nocache)[0]}
    return out


def test_forward_capture_tokens_identical_to_no_cache(runs) -> None:
    assert runs["forward"]["outputs"] == runs["nocache"]["outputs"]
    assert runs["cut"]["outputs"] == runs["nocache"]["outputs"]


def test_forward_capture_caches_at_least_the_cut_path(runs) -> None:
    fwd, cut = runs["forward"], runs["cut"]
    print("cached tokens: forward", fwd["cached"], "cut", cut["cached"], "native", runs["native"]["cached"])
    pairs = zip(fwd["cached"], cut["cached"], strict=True)
    assert all(f >= c for f, c in pairs), (fwd["cached"], cut["cached"])
    assert sum(fwd["cached"]) > 0


def test_forward_capture_makes_no_cut_and_no_extra_forward(runs) -> None:
    s, c = runs["forward"]["stats"], runs["cut"]["stats"]
    print("forwards:", {k: v["forwards"] for k, v in runs.items() if "forwards" in v})  # no cache: shared
    assert s["capture_mode"] == "forward" and s["cuts_applied"] == 0
    assert c["cuts_applied"] > 0, "the workload must plan interior positions (else this test is vacuous)"
    # Every planned position strictly inside an extend was captured in the forward and published
    # (no pool shortage here: nothing dropped; planned and probation positions are all admitted).
    assert s["captures_planned"] > 0 and s["captures_dropped"] == 0, s
    assert s["captures_published"] == s["captures_reserved"] == s["captures_planned"], s
    assert s["captures_incomplete"] == 0 and s["captures_pending"] == 0, s
    # SGLang's own track copies wrote them: h rows of the CPU stand-in of its Triton kernel, and
    # the page-exact tail-prior positions off the 64-token grid through the recurrent tails.
    assert s["capture_layout"] == "chunks" and s["capture_tails"] > 0, s
    assert s["capture_tails"] < s["captures_published"], s  # on-grid ones too
    assert runs["forward"]["forwards"] == runs["native"]["forwards"]
    # Each cut costs one forward at most; a cut can land on a boundary the chunked prefill makes
    # anyway, and the cut path's deeper hits can save a chunk elsewhere, so this is a bound.
    native_forwards = runs["native"]["forwards"]
    assert native_forwards < runs["cut"]["forwards"] <= native_forwards + c["cuts_applied"]
    assert_one_tree(s)


def test_capture_slot_lifecycle_storm_with_aborts(model_dir: Path) -> None:
    """Concurrent requests with shared prefixes, a third of them aborted mid-flight (some finishing
    at their prefill), against a 6-slot state pool: no crash, every reserved capture slot accounted
    for, and at idle every Mamba slot is free or held by the tree (also after a flush)."""
    slots = 6
    env = {**EXACT, "SGLANG_SPARSE_CAPTURE": "forward"}
    srv = _start(model_dir, SPARSE, env=env, state_slots=slots)
    try:
        import requests

        prefixes = [toks(150 + 40 * k, 800 + k) for k in range(4)]
        prompts = [prefixes[i % 4][: 100 + (i * 37) % 90] + toks(10 + i % 23, 900 + i) for i in range(90)]
        counter = itertools.count()
        stop = threading.Event()

        def one(p: list[int]):
            k = next(counter)
            try:
                # Every 4th request finishes at its prefill (1 token): its captures are published
                # by release_kv_cache of a finished request.
                return srv.generate(p, 1 if k % 4 == 0 else 3, timeout=600, rid=f"storm-{k}")
            except Exception as exc:  # noqa: BLE001 - aborted requests may answer with an error
                return exc

        def aborter() -> None:
            k = 0
            while not stop.is_set() and k < 90:
                requests.post(f"{srv.url}/abort_request", json={"rid": f"storm-{k}"}, timeout=30)
                k += 3
                time.sleep(0.05)

        t = threading.Thread(target=aborter)
        t.start()
        with ThreadPoolExecutor(max_workers=32) as pool:
            outs = list(pool.map(one, prompts))
        stop.set()
        t.join()
        assert srv.alive(), srv.log_tail()
        assert sum(1 for o in outs if not isinstance(o, Exception)) > 0
        deadline = time.monotonic() + 60
        while True:
            s = sparse_stats(srv)
            if s["kv_protected"] == 0 and s["mamba_protected"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print("storm capture stats:", {k: v for k, v in s.items() if k.startswith("capture")})
        assert s["captures_reserved"] > 0, s
        assert s["captures_pending"] == 0, s
        assert s["mamba_protected"] == 0 and s["kv_protected"] == 0, s
        assert s["mamba_available"] + s["states_held"] == s["mamba_pool_size"], s
        assert s["captures_reserved"] == sum(s[k] for k in CAPTURE_OUTCOMES), s
        assert_one_tree(s)
        # SGLang's idle invariant checker names leaked slots as ``leaked_mamba_pages={...}``.
        assert "leaked_mamba_pages={" not in Path(srv.log_path).read_text(errors="replace")
        assert srv.flush_cache()
        s2 = sparse_stats(srv)
        assert s2["mamba_available"] == s2["mamba_pool_size"] and s2["states_held"] == 0, s2
    finally:
        srv.stop()


def test_capture_option_validation() -> None:
    from sglang_sparse.sglang_adapter.config import SparseConfig, SparseConfigError

    assert SparseConfig.from_env({}).capture is None  # auto: resolve_capture
    assert SparseConfig.from_env({"SGLANG_SPARSE_CAPTURE": " Cut "}).capture == "cut"
    with pytest.raises(SparseConfigError, match=r"SGLANG_SPARSE_CAPTURE='kernel': unknown capture mode"):
        SparseConfig.from_env({"SGLANG_SPARSE_CAPTURE": "kernel"})


class _Alloc:
    """Stand-in for SGLang's Mamba allocator: records freed slot ids."""

    def __init__(self, free: int = 4) -> None:
        self.freed: list[int] = []
        self.free_n = free

    def free(self, slot) -> None:
        ids = [int(x) for x in slot.reshape(-1).tolist()]
        self.freed += ids
        self.free_n += len(ids)

    def available_size(self) -> int:
        return self.free_n

    schedulable_available_size = available_size


class _Policy:
    def __init__(self, reject: set[int]) -> None:
        self.reject = reject
        self.asked: list[tuple[int, bool]] = []

    def admit(self, rid: str, position: int, *, finished: bool, free_slots: int = 0) -> bool:
        self.asked.append((position, finished))
        return position not in self.reject


def _bare_capture_cache(reject: set[int] = frozenset()):
    """A CaptureRadixCache without SGLang's tree: only the fields the publish/free logic reads."""
    import types

    from sglang_sparse.sglang_adapter.capture import CaptureRadixCache

    cache = object.__new__(CaptureRadixCache)
    cache._capture_pending = {}
    cache._capture_publishing = None
    cache.capture_stats = dict.fromkeys(CAPTURE_OUTCOMES, 0)
    cache.req_to_token_pool = types.SimpleNamespace(mamba_allocator=_Alloc())
    cache.tree_core = types.SimpleNamespace(page_size=1)
    cache.policy = _Policy(set(reject))
    return cache


def _plan(positions: list[int], slots: list[int], *, started: bool, layers_done: int):
    """A 2-layer capture plan: attached to a forward (``started``) whose copies ran in
    ``layers_done`` layers (2: complete)."""
    import types

    from sglang_sparse.sglang_adapter.track_capture import CapturePlan

    plan = CapturePlan(
        rows=[0] * len(slots), offsets=list(positions), slots=list(slots), geometry={0: (0, 512)}, n_layers=2
    )
    if started:
        plan.lists = types.SimpleNamespace(metadata=object())
        plan.copies_done = layers_done
    return plan


def _pending(cache, rid: str, positions: list[int], slots: list[int], complete: bool = True, plan=None):
    """Pending captures of ``rid`` on ``plan`` (a new one by default: complete, or not started)."""
    import torch

    from sglang_sparse.sglang_adapter.capture import _Pending

    if plan is None:
        plan = _plan(positions, slots, started=complete, layers_done=2 if complete else 0)
    cache._capture_pending.setdefault(rid, []).extend(
        _Pending(p, torch.tensor([s]), plan) for p, s in zip(positions, slots, strict=True)
    )
    return plan


def test_publish_order_admission_and_frees_without_a_server() -> None:
    """Captured slots go to the tree in increasing position order, each through admit() and a
    mid-request insert (the insert sees the request as not finished; the request itself is left
    untouched); rejected, stale (<= protected) and not-reached (> up_to) slots are freed; nothing
    stays pending."""
    import types

    cache = _bare_capture_cache(reject={192})
    inserts: list[tuple[int, int, object]] = []

    def fake_insert(req, *, up_to: int) -> None:
        pub = cache._capture_publishing
        inserts.append((up_to, int(pub.slot), req.finished(), req.finished_reason))
        req.kv.cache_protected_len = up_to

    cache.checkpoint_into_tree = fake_insert
    kv = types.SimpleNamespace(cache_protected_len=64)
    # a finished request whose cache key (400 + 2 - 1 tokens) no published capture reaches
    req = types.SimpleNamespace(
        rid="r", finished_reason="done", kv=kv, origin_input_ids=[5] * 400, output_ids=[6, 7]
    )
    req.finished = lambda: req.finished_reason is not None
    _pending(cache, "r", [256, 128, 64, 192, 400], [11, 12, 13, 14, 15])
    cache.publish_captures(req, up_to=300)
    # each insert sees a mid-request checkpoint; the request's own finish reason is never touched
    assert inserts == [(128, 12, False, "done"), (256, 11, False, "done")]
    assert req.finished_reason == "done"
    assert sorted(cache.req_to_token_pool.mamba_allocator.freed) == [13, 14, 15]
    assert cache.policy.asked == [(128, False), (192, False), (256, False)]
    s = cache.capture_stats
    assert (s["captures_published"], s["captures_rejected"], s["captures_freed"]) == (2, 1, 2)
    assert cache._capture_pending == {} and cache._capture_publishing is None


def test_incomplete_plan_is_freed_never_published() -> None:
    import types

    cache = _bare_capture_cache()
    cache.checkpoint_into_tree = lambda req, *, up_to: pytest.fail("published a stale slot")
    kv = types.SimpleNamespace(cache_protected_len=0)
    req = types.SimpleNamespace(rid="r", finished_reason=None, kv=kv)
    _pending(cache, "r", [64, 128], [5, 6], complete=False)
    cache.publish_captures(req, up_to=200)
    assert sorted(cache.req_to_token_pool.mamba_allocator.freed) == [5, 6]
    assert cache.capture_stats["captures_incomplete"] == 2


def test_release_and_flush_free_pending_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Abort/retraction (``on_release`` with slots still pending) and a flush (``reset``) return
    every pending slot to the allocator before SGLang's own release/reset runs."""
    import types

    from sglang_sparse.sglang_adapter.cache import SparseRadixCache

    calls: list[str] = []
    monkeypatch.setattr(
        SparseRadixCache, "on_release", lambda self, req, *, checkpointed: calls.append("rel")
    )
    monkeypatch.setattr(SparseRadixCache, "reset", lambda self: calls.append("reset"))
    cache = _bare_capture_cache()
    alloc = cache.req_to_token_pool.mamba_allocator
    _pending(cache, "a", [64, 128], [3, 4])
    _pending(cache, "b", [64], [9])
    cache.on_release(types.SimpleNamespace(rid="a"), checkpointed=False)
    assert alloc.freed == [3, 4] and calls == ["rel"]
    cache.reset()
    assert alloc.freed == [3, 4, 9] and calls == ["rel", "reset"]
    assert cache._capture_pending == {} and cache.capture_stats["captures_freed"] == 3


def test_sglang_allocation_reclaims_pending_capture_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22: SGLang allocates a request's working and ping-pong slots (``alloc_req_slots``) with
    no admission check, trusting that every slot no request or locked tree node holds is free or
    evictable; pending capture slots are neither, and outlive their step. When SGLang's eviction
    for an allocation leaves the pool short, the pending capture slots go: deepest first, a plan
    whose forward has not begun loses the slot (its kernels will not write it), a started plan
    that did not complete is left to its checkpoint; never more than the shortfall."""
    import types

    from sglang_sparse.sglang_adapter import capture, track_capture
    from sglang_sparse.sglang_adapter.cache import SparseRadixCache

    tree_frees = [2, 0]  # what SGLang's own eviction frees, call by call

    def sglang_evict(self, params, **kw):
        self.req_to_token_pool.mamba_allocator.free_n += tree_frees.pop(0)

    monkeypatch.setattr(SparseRadixCache, "evict_for_alloc", sglang_evict)
    cache = _bare_capture_cache()
    alloc = cache.req_to_token_pool.mamba_allocator
    alloc.free_n = 1
    _pending(cache, "a", [64, 192], [3, 4])  # a forward that ran: complete
    unstarted = _pending(cache, "b", [128, 320], [7, 8], complete=False)  # its forward is next
    started = _plan([256], [9], started=True, layers_done=1)  # began, did not complete: freed at checkpoint
    _pending(cache, "c", [256], [9], plan=started)

    cache.evict_for_alloc(types.SimpleNamespace(mamba_num=2))  # the tree's eviction suffices
    assert alloc.free_n == 3 and alloc.freed == [] and cache.capture_stats["captures_reclaimed"] == 0

    alloc.free_n = 1
    cache.evict_for_alloc(types.SimpleNamespace(mamba_num=3))  # the tree frees nothing: 3 short
    assert alloc.freed == [8, 4, 7] and alloc.free_n == 4
    assert cache.capture_stats["captures_reclaimed"] == 3
    assert unstarted.slots == [] and unstarted.rows == [] and unstarted.offsets == []
    assert {rid: [e.position for e in es] for rid, es in cache._capture_pending.items()} == {
        "a": [64],
        "c": [256],
    }
    # a plan left without captures runs as no plan
    batch = types.SimpleNamespace(sparse_capture=unstarted)
    capture._init_new_hook(None, None, batch)
    assert track_capture.forward_plan() is None and not hasattr(batch, "sparse_capture")
    assert cache.reclaim_capture_slots(5) == 1 and alloc.freed[-1] == 3  # "c" stays
    assert list(cache._capture_pending) == ["c"]

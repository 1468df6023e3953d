"""Split a server's scheduler CPU by phase (measurement only, opt-in)::

    CPU_SPLIT_OUT=/tmp/c/split PYTHONPATH=tools/cpu_split python -m benchmarks.serving_load ...

In every process that imports SGLang's scheduler, a background thread patches (once the modules
are imported) ``ModelRunner.forward`` (split by forward mode: extend / decode / other), the CPU GDN
prefill op and the scheduler's ``get_next_batch_to_run`` / ``run_batch`` / ``process_batch_result``,
and times each call inclusively with ``time.process_time`` (the whole process: the torch intra-op
threads too) and ``time.thread_time`` (the calling thread). It counts calls, forward rows and
tokens, and writes ``<out>.<pid>.json`` every 10 s and at exit. Without ``CPU_SPLIT_OUT`` it does
nothing. Calls made before the patch lands (start-up) are not counted; read differences between two
dumps, or compare servers that ran the same requests. ``CPU_SPLIT_PROFILE=1`` adds a cProfile of
the scheduler steps outside the forward (below)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
import time
from typing import Any

OUT = os.environ.get("CPU_SPLIT_OUT")
STATS: dict[str, dict[str, float]] = {}


def _acc(name: str, cpu: float, thr: float, rows: int = 0, tokens: int = 0) -> None:
    s = STATS.setdefault(name, {"calls": 0, "cpu_s": 0.0, "thread_s": 0.0, "rows": 0, "tokens": 0})
    s["calls"] += 1
    s["cpu_s"] += cpu
    s["thread_s"] += thr
    s["rows"] += rows
    s["tokens"] += tokens


#: ``CPU_SPLIT_PROFILE=1``: also cProfile (thread CPU clock) the scheduler calls outside the
#: forward (``get_next_batch_to_run``, ``process_batch_result``), dumped to ``<out>.<pid>.prof`` by
#: the scheduler thread itself every 10 s (a dump from another thread would disable the profiler)
PROFILE = None
if OUT and os.environ.get("CPU_SPLIT_PROFILE") == "1":
    import cProfile

    PROFILE = cProfile.Profile(time.thread_time)
_PROF_DUE = [0.0]
PROFILED = ("Scheduler.get_next_batch_to_run", "Scheduler.process_batch_result")


def _timed(name: str, fn: Any, split: Any = None) -> Any:
    prof = PROFILE if name in PROFILED else None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = time.process_time(), time.thread_time()
        if prof is not None:
            prof.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            if prof is not None:
                prof.disable()
                if time.monotonic() > _PROF_DUE[0]:  # dumped here, by the profiled thread itself
                    _PROF_DUE[0] = time.monotonic() + 10.0
                    prof.dump_stats(f"{OUT}.{os.getpid()}.prof")
            label, rows, tokens = (name, 0, 0) if split is None else split(args, kwargs)
            _acc(label, time.process_time() - c0, time.thread_time() - t0, rows, tokens)

    wrapper.__cpu_split__ = True  # type: ignore[attr-defined]
    return wrapper


def _forward_split(args: tuple, kwargs: dict) -> tuple[str, int, int]:
    fb = args[1] if len(args) > 1 else kwargs.get("forward_batch")
    try:
        mode = fb.forward_mode
        kind = "extend" if mode.is_extend() else "decode" if mode.is_decode() else "other"
        rows = int(fb.batch_size)
        tokens = int(fb.input_ids.shape[0]) if fb.input_ids is not None else 0
    except Exception:  # noqa: BLE001 - a reading
        kind, rows, tokens = "other", 0, 0
    return f"forward_{kind}", rows, tokens


TARGETS = (
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward", _forward_split),
    ("sglang.srt.managers.scheduler", "Scheduler", "get_next_batch_to_run", None),
    ("sglang.srt.managers.scheduler", "Scheduler", "run_batch", None),
    ("sglang.srt.managers.scheduler", "Scheduler", "process_batch_result", None),
    ("sglang_sparse_kernels.sgl_kernel_cpu.delta_rule", None, "_chunk_gated_delta_rule", None),
)


def _patch_ready() -> bool:
    done = True
    for mod, cls, attr, split in TARGETS:
        m = sys.modules.get(mod)
        if m is None:
            done = False
            continue
        owner = getattr(m, cls, None) if cls else m
        if owner is None:
            done = False
            continue
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "__cpu_split__", False):
            continue
        setattr(owner, attr, _timed(f"{cls or 'op'}.{attr}", fn, split))
    return done


_GC_START: dict[int, tuple[float, float]] = {}


def _gc_callback(phase: str, info: dict[str, int]) -> None:
    """Time every cyclic garbage collection by generation (thread CPU of the collecting thread)."""
    tid = threading.get_ident()
    if phase == "start":
        _GC_START[tid] = (time.process_time(), time.thread_time())
    elif tid in _GC_START:
        c0, t0 = _GC_START.pop(tid)
        _acc(f"gc.gen{info.get('generation')}", time.process_time() - c0, time.thread_time() - t0)


def _install(out: str) -> None:
    import gc

    gc.callbacks.append(_gc_callback)

    def dump() -> None:
        if STATS:
            with open(f"{out}.{os.getpid()}.json", "w") as f:
                json.dump({"process_cpu_s": time.process_time(), "stats": STATS}, f)

    def loop() -> None:
        ticks = 0
        patched = False
        while True:
            time.sleep(0.2)
            if not patched:
                patched = _patch_ready()
            ticks += 1
            if ticks % 50 == 0:
                dump()

    atexit.register(dump)
    threading.Thread(target=loop, daemon=True, name="cpu-split").start()


if OUT:
    _install(OUT)

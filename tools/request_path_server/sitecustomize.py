"""Opt-in tracer of ``tools/request_path.py --server`` (measurement only; the tool sets it up)::

    REQUEST_PATH_OUT=/tmp/trace.json REQUEST_PATH_PKG=/repo/sglang_sparse/ \
        PYTHONPATH=tools/request_path_server:... python -m sglang.launch_server ...

In every process that imports SGLang's scheduler, a background thread wraps
``Scheduler.handle_generate_request`` as soon as the class exists (before the scheduler builds its
request dispatcher, which binds the method). When a generate request with rid ``REQUEST_PATH_RID``
arrives, the wrapper turns on ``sys.setprofile`` on the scheduler thread (and
``threading.setprofile`` for threads started meanwhile); when the next generate request arrives,
it turns it off and writes every Python call whose code file is under ``REQUEST_PATH_PKG`` (files in
first-call order, cross-file caller -> callee edges, calls per function and per thread) to
``REQUEST_PATH_OUT``. Without ``REQUEST_PATH_OUT`` it does nothing."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from typing import Any

OUT = os.environ.get("REQUEST_PATH_OUT")
PKG = os.environ.get("REQUEST_PATH_PKG", "/nonexistent/")
RID = os.environ.get("REQUEST_PATH_RID", "request-path-traced")
CUT = len(PKG) - len("sglang_sparse/")  # paths are reported from "sglang_sparse/"

STATE: dict[str, Any] = {"on": False, "done": False, "t0": 0.0}
FILES: dict[str, int] = {}
EDGES: set[tuple[str, str]] = set()
FUNCS: dict[str, int] = {}
THREADS: dict[str, int] = {}


def _prof(frame: Any, event: str, arg: Any) -> None:
    if event != "call":
        return
    code = frame.f_code
    if not code.co_filename.startswith(PKG):
        return
    if not STATE["on"]:  # a thread started during the window, still profiled
        sys.setprofile(None)
        return
    callee = code.co_filename[CUT:]
    FILES.setdefault(callee, len(FILES))
    key = f"{callee}:{code.co_qualname}"
    FUNCS[key] = FUNCS.get(key, 0) + 1
    name = threading.current_thread().name
    THREADS[name] = THREADS.get(name, 0) + 1
    back = frame.f_back
    if back is not None and back.f_code.co_filename.startswith(PKG):
        caller = back.f_code.co_filename[CUT:]
        if caller != callee:
            EDGES.add((caller, callee))


def _start() -> None:
    STATE.update(on=True, t0=time.monotonic(), threads_alive=sorted(t.name for t in threading.enumerate()))
    threading.setprofile(_prof)
    sys.setprofile(_prof)


def _stop_and_dump(out: str) -> None:
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    STATE.update(on=False, done=True)
    res = {
        "pid": os.getpid(),
        "window_s": time.monotonic() - STATE["t0"],
        "package_calls": sum(FUNCS.values()),
        "files": sorted(FILES, key=FILES.__getitem__),
        "cross_file_edges": sorted(EDGES),
        "calls_by_function": dict(sorted(FUNCS.items())),
        "calls_by_thread": THREADS,
        "threads_alive": STATE["threads_alive"],
    }
    with open(out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(out + ".tmp", out)


def _wrap(fn: Any, out: str) -> Any:
    @functools.wraps(fn)
    def handle_generate_request(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        if STATE["on"]:
            _stop_and_dump(out)
        elif not STATE["done"] and getattr(recv_req, "rid", None) == RID:
            _start()
        return fn(self, recv_req, *args, **kwargs)

    handle_generate_request.__request_path__ = True  # type: ignore[attr-defined]
    return handle_generate_request


def _patch_when_imported(out: str) -> None:
    while True:
        mod = sys.modules.get("sglang.srt.managers.scheduler")
        cls = getattr(mod, "Scheduler", None) if mod is not None else None
        fn = getattr(cls, "handle_generate_request", None)
        if fn is not None:
            if not getattr(fn, "__request_path__", False):
                cls.handle_generate_request = _wrap(fn, out)  # type: ignore[union-attr]
            return
        time.sleep(0.02)


if OUT:
    threading.Thread(target=_patch_when_imported, args=(OUT,), daemon=True, name="request-path").start()

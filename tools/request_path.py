"""Which ``sglang_sparse`` files does one request touch on its way through the SGLang adapter?

Drives the scheduler-side harness of ``benchmarks/scheduler_cache.py`` (SGLang's real pools,
``Req`` and ``create_tree_cache``; no model forward, so captures are chunk cuts,
``SGLANG_SPARSE_CAPTURE=cut``) with the ``sparse`` backend: a warm-up that fills the small pools
and makes them evict, then one traced request that matches a cached prefix, is planned, evicts,
checkpoints and is released. ``sys.setprofile`` records every Python call whose code lives in
``sglang_sparse/``; the report lists the distinct files in first-call order and the distinct
cross-file edges (caller file -> callee file, both in the package), the numbers
``docs/architecture.md`` quotes.

``--server`` measures the same on a real SGLang server process with the default sparse launch
(``--radix-cache-backend sparse`` on ``extra_buffer``, overlap schedule on, in-forward capture; the
tiny hybrid model of ``sglang_sparse.models.tiny``; 2,500 KV tokens, 24 state slots, 128-token
chunks, as the harness). ``tools/request_path_server/sitecustomize.py`` traces the scheduler
process from the arrival of the traced request (the same sequence as above, 4 decoded tokens each)
to the arrival of the next one: prefill with its captures, decode, finish, release, and whatever
the scheduler ran in the idle loop before the next request arrived. SGLang 0.5.23's overlap
schedule runs in the scheduler thread (no worker thread), so all calls land on one thread (the
report says which). The JSON adds calls per function and the eviction entry points that ran. About
2 minutes on 2 cores, mostly server start-up; the server is stopped (its process group killed) at
the end.

    .venv/bin/python tools/request_path.py [--server] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PKG = str(REPO / "sglang_sparse") + "/"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def request_sequence(vocab: int) -> tuple[list[list[int]], list[int]]:
    """Both modes' prompts (token ids in ``[4, vocab)``, seeded): a document with a question,
    10 distinct prompts (the small pools evict), the document with another question; then the
    traced query, the document with a third question."""
    rng = np.random.default_rng(7)

    def rand(n: int) -> list[int]:
        return rng.integers(4, vocab, size=n, dtype=np.int64).tolist()

    doc = rand(400)
    warm = [doc + rand(60), *(rand(300) for _ in range(10)), doc + rand(60)]
    return warm, doc + rand(60)


def trace_one_request() -> dict[str, Any]:
    """Files and cross-file edges of ``sglang_sparse`` touched by one warm request."""
    os.environ.update({"SGLANG_SPARSE_POLICY": "sparse", "SGLANG_SPARSE_CAPTURE": "cut"})
    from benchmarks.scheduler_cache import make_model_dir, output_ids, small_harness

    h = small_harness("sparse", make_model_dir(context_len=4096))
    warm, query_ids = request_sequence(2**30)
    for i, prompt in enumerate(warm):
        h.run(f"warm-{i}", array("q", prompt), output_ids(20 if i == len(warm) - 1 else i, 4))

    files: dict[str, int] = {}
    edges: set[tuple[str, str]] = set()
    calls = 0

    def rel(path: str) -> str | None:
        return path[len(PKG) - len("sglang_sparse/") :] if path.startswith(PKG) else None

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event != "call":
            return
        callee = rel(frame.f_code.co_filename)
        if callee is None:
            return
        calls += 1
        files.setdefault(callee, len(files))
        back = frame.f_back
        caller = rel(back.f_code.co_filename) if back is not None else None
        if caller is not None and caller != callee:
            edges.add((caller, callee))

    query = array("q", query_ids)
    sys.setprofile(prof)
    try:
        cached = h.run("traced", query, output_ids(30, 4))
    finally:
        sys.setprofile(None)
    return {
        "cached_tokens": cached,
        "prompt_tokens": len(query),
        "package_calls": calls,
        "files": sorted(files, key=files.__getitem__),
        "cross_file_edges": sorted(edges),
    }


def trace_server_request() -> dict[str, Any]:
    """:func:`trace_one_request` on a real server (``--server``); adds the tracer's own readings."""
    from sglang_sparse.models.tiny import make_tiny_model
    from sglang_sparse.testing.server import SGLangServer, strategy_setup

    model = make_tiny_model(Path(tempfile.gettempdir()) / "request_path_tiny", arch="qwen3_next", seed=0)
    base, env = strategy_setup("extra_buffer")
    rid = "request-path-traced"
    with tempfile.TemporaryDirectory(prefix="request_path_") as tmp:
        out = Path(tmp) / "trace.json"
        path = [str(REPO / "tools" / "request_path_server"), str(REPO), str(REPO / "kernels")]
        env.update(
            REQUEST_PATH_OUT=str(out),
            REQUEST_PATH_PKG=PKG,
            REQUEST_PATH_RID=rid,
            PYTHONPATH=os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]),
        )
        srv = SGLangServer(
            model,
            extra_args=["--radix-cache-backend", "sparse", "--chunked-prefill-size", "128"],
            env=env,
            base_args=base,
            context_length=1024,
            max_total_tokens=2500,
            max_mamba_cache_size=24,
            log_path=Path(tmp) / "server.log",
        )
        srv.start(timeout=600)
        try:
            warm, query = request_sequence(4096)  # the tiny model's vocabulary
            for prompt in warm:
                srv.generate(prompt, 4)
            traced = srv.generate(query, 4, rid=rid)
            srv.generate(warm[1][:8], 1)  # its arrival ends the traced window
            stats = srv.sparse_stats()
        finally:
            srv.stop()
        if not out.exists():
            raise RuntimeError(f"the scheduler wrote no trace; server log:\n{srv.log_tail()}")
        res = json.loads(out.read_text())
    res["cross_file_edges"] = [tuple(e) for e in res["cross_file_edges"]]
    evict = {  # the eviction entry points (not e.g. ``_sync_evictable``)
        f: n
        for f, n in res["calls_by_function"].items()
        if f.split(":")[1].rsplit(".", 1)[-1].lstrip("_").startswith("evict")
    }
    return {
        "cached_tokens": traced.cached_tokens,
        "prompt_tokens": len(query),
        **res,
        "evict_calls": evict,
        "sparse_stats_at_end": stats,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ap.add_argument("--server", action="store_true", help="trace a real SGLang server's scheduler")
    args = ap.parse_args(argv)
    res = trace_server_request() if args.server else trace_one_request()
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(
        f"one request ({res['cached_tokens']} of {res['prompt_tokens']} prompt tokens cached): "
        f"{len(res['files'])} files, {len(res['cross_file_edges'])} cross-file edges, "
        f"{res['package_calls']} calls into sglang_sparse"
    )
    for f in res["files"]:
        print(f"  {f}")
    if args.server:
        print(f"eviction on the path: {res['evict_calls'] or 'none'}; threads: {res['calls_by_thread']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

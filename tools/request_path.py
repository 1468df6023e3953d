"""Which ``sglang_sparse`` files does one request touch on its way through the SGLang adapter?

Drives the scheduler-side harness of ``benchmarks/scheduler_cache.py`` (SGLang's real pools,
``Req`` and ``create_tree_cache``; no model forward, so captures are chunk cuts,
``SGLANG_SPARSE_CAPTURE=cut``) with the ``sparse`` backend: a warm-up that fills the small pools
and makes them evict, then one traced request that matches a cached prefix, is planned, evicts,
checkpoints and is released. ``sys.setprofile`` records every Python call whose code lives in
``sglang_sparse/``; the report lists the distinct files in first-call order and the distinct
cross-file edges (caller file -> callee file, both in the package), the numbers
``docs/architecture.md`` quotes.

    .venv/bin/python tools/request_path.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from array import array
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PKG = str(REPO / "sglang_sparse") + "/"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def trace_one_request() -> dict[str, Any]:
    """Files and cross-file edges of ``sglang_sparse`` touched by one warm request."""
    import os

    os.environ.update({"SGLANG_SPARSE_POLICY": "sparse", "SGLANG_SPARSE_CAPTURE": "cut"})
    from benchmarks.scheduler_cache import make_model_dir, output_ids, small_harness

    rng = np.random.default_rng(7)

    def rand(n: int) -> array:
        return array("q", rng.integers(4, 2**30, size=n, dtype=np.int64).tobytes())

    h = small_harness("sparse", make_model_dir(context_len=4096))
    doc = rand(400)
    h.run("warm-0", doc + rand(60), output_ids(0, 4))
    for i in range(10):  # distinct prompts: the pools evict
        h.run(f"warm-{i + 1}", rand(300), output_ids(i + 1, 4))
    h.run("warm-doc", doc + rand(60), output_ids(20, 4))

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

    query = doc + rand(60)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = ap.parse_args(argv)
    res = trace_one_request()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A concurrent request storm with client aborts, against a running server (serving tests).

``storm_prompts`` builds requests over a few shared heads (prefix reuse under pressure);
``run_storm`` sends them from a thread pool while another thread aborts every ``abort_every``-th
request by id, and returns the outputs of the requests that completed (an aborted request may
still complete if it finished first). Token ids only; nothing here checks results.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: what becomes of a reserved in-forward capture slot (``CaptureRadixCache.capture_stats``; their
#: counts sum to ``captures_reserved`` at idle)
CAPTURE_OUTCOMES = (
    "captures_published",
    "captures_rejected",
    "captures_freed",
    "captures_incomplete",
    "captures_reclaimed",
)


def storm_prompts(n: int, toks: Callable[[int, int], list[int]], heads: int = 8) -> list[list[int]]:
    """``n`` prompts: a prefix (200-449 tokens) of one of ``heads`` shared heads + 8-36 own tokens.
    ``toks(length, seed)`` makes a deterministic token list."""
    hs = [toks(300 + 60 * k, 800 + k) for k in range(heads)]
    return [hs[i % heads][: 200 + (i * 37) % 250] + toks(8 + i % 29, 900 + i) for i in range(n)]


def new_tokens(k: int) -> int:
    """Output length of storm request ``k``: some finish at their prefill (1 token), most run 3."""
    return 1 if k % 7 == 0 else 3


def run_storm(
    srv: Any,
    prompts: list[list[int]],
    *,
    abort_every: int = 5,
    workers: int = 48,
    prefix: str = "storm",
    timeout: float = 600.0,
) -> dict[int, list[int]]:
    """Send every prompt (``new_tokens(k)`` greedy tokens, request id ``{prefix}-{k}``) with
    ``workers`` in flight while every ``abort_every``-th id is aborted (``/abort_request``, 20 ms
    apart); returns ``{k: output ids}`` of the requests that completed with output."""
    import requests

    stop = threading.Event()

    def one(k: int) -> Any:
        try:
            return srv.generate(prompts[k], new_tokens(k), timeout=timeout, rid=f"{prefix}-{k}")
        except Exception as exc:  # noqa: BLE001 - aborted requests may answer with an error
            return exc

    def aborter() -> None:
        k = 0
        while not stop.is_set() and k < len(prompts):
            requests.post(f"{srv.url}/abort_request", json={"rid": f"{prefix}-{k}"}, timeout=30)
            k += abort_every
            time.sleep(0.02)

    t = threading.Thread(target=aborter)
    t.start()
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            outs = list(pool.map(one, range(len(prompts))))
    finally:
        stop.set()
        t.join()
    return {k: o.output_ids for k, o in enumerate(outs) if not isinstance(o, Exception) and o.output_ids}

"""Run SGLang's router (PyPI ``sglang-router``) in front of CPU workers, and read a worker's counters.

Used by ``benchmarks/serving_router.py`` and ``tests/serving/test_router.py``::

    from sglang_sparse.testing.router import Router, worker_counters

    with Router([w1.url, w2.url], policy="cache_aware") as router:
        requests.post(f"{router.url}/generate", json={...})
    worker_counters(w1)  # {"requests": ..., "prompt_tokens": ..., "cached_tokens": ...}

The router is a Rust binary started with ``python -m sglang_router.launch_router`` in its own
process group on a free loopback port. Its ``/health`` answers before the workers are registered
(requests then fail with 503 ``no_available_workers``), so :meth:`Router.start` waits until
``/workers`` lists every worker as healthy.

Failure handling (the router's own flags): health checks every ``health_interval`` seconds; the
per-worker circuit breaker opens after 2 consecutive failures and half-opens after
``breaker_timeout`` seconds, so a restarted worker on the same URL rejoins without re-registration;
``request_timeout`` bounds every proxied request. What a dying worker does to requests:
``docs/sparse_backend.md``, "Behind SGLang's router".
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang_sparse.testing.orphan_guard import guarded
from sglang_sparse.testing.server import ServerError, _tail, free_port

#: routing policies of ``sglang_router`` that the project benchmarks (the router has more)
POLICIES = ("cache_aware", "round_robin")


class Router:
    """A ``sglang_router.launch_router`` subprocess routing over ``worker_urls`` (the workers' base
    URLs) with ``policy`` (:data:`POLICIES` or any the router accepts). ``health_interval``: seconds
    between health checks of each worker; ``breaker_timeout``: seconds an open circuit stays open
    before a trial request; ``request_timeout``: seconds the router waits on one proxied request;
    ``extra_args``: more router flags; ``log_path``: the router log (default: a temp file)."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str = "cache_aware",
        *,
        health_interval: int = 2,
        breaker_timeout: int = 5,
        request_timeout: int = 600,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        log_path: str | Path | None = None,
    ) -> None:
        if not worker_urls:
            raise ValueError("a router needs at least one worker URL")
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.port = free_port(host)
        #: the router's Prometheus port: its default (29000) is one per machine, taken by a 2nd router
        self.metrics_port = free_port(host)
        while self.metrics_port == self.port:
            self.metrics_port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", host,
            "--port", str(self.port),
            "--worker-urls", *self.worker_urls,
            "--policy", policy,
            "--health-check-interval-secs", str(health_interval),
            "--health-failure-threshold", "2",
            "--health-success-threshold", "1",
            "--cb-failure-threshold", "2",
            "--cb-timeout-duration-secs", str(breaker_timeout),
            "--request-timeout-secs", str(request_timeout),
            "--log-level", "warn",
            "--prometheus-host", host,
            "--prometheus-port", str(self.metrics_port),
            *extra_args,
        ]  # fmt: skip
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang_router_", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    def start(self, timeout: float = 120.0) -> Router:
        """Launch and wait until every worker is registered and healthy."""
        t0 = time.monotonic()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed in stop()
        self.proc = subprocess.Popen(
            guarded(self.cmd), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"router exited with code {self.proc.returncode}", _tail(self.log_path))
            if self.healthy_workers() == len(self.worker_urls):
                break
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServerError(
                    f"router: workers not all healthy after {timeout:.0f}s", _tail(self.log_path)
                )
            time.sleep(0.25)
        self.startup_seconds = time.monotonic() - t0
        return self

    def workers(self) -> list[dict[str, Any]]:
        """The router's ``/workers`` list (empty while it is not answering)."""
        import requests

        try:
            r = requests.get(f"{self.url}/workers", timeout=5)
            return list(r.json().get("workers", [])) if r.status_code == 200 else []
        except (requests.RequestException, ValueError):
            return []

    def healthy_workers(self) -> int:
        return sum(bool(w.get("is_healthy")) for w in self.workers())

    def wait_healthy(self, n: int, timeout: float = 120.0) -> bool:
        """Wait until ``n`` workers are healthy; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy_workers() >= n:
                return True
            time.sleep(0.5)
        return False

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()

    def __enter__(self) -> Router:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: SGLang's Prometheus counters read by :func:`worker_counters` (summed over their labels)
COUNTERS = {
    "requests": "sglang:num_requests_total",
    "prompt_tokens": "sglang:prompt_tokens_total",
    "cached_tokens": "sglang:cached_tokens_total",
}
_SAMPLE = re.compile(r"^(sglang:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def parse_counters(text: str) -> dict[str, float]:
    """:data:`COUNTERS` from a Prometheus text page, each summed over its label sets."""
    want = {v: k for k, v in COUNTERS.items()}
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and m.group(1) in want:
            out[want[m.group(1)]] += float(m.group(2))
    return out


def worker_counters(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Requests, prompt tokens and cached prompt tokens a worker (started with
    ``--enable-metrics``) has served so far, from its ``/metrics``. Raises ``ServerError`` when the
    page is unavailable (worker down or metrics off)."""
    import requests

    try:
        r = requests.get(f"{url}/metrics", timeout=timeout)
    except requests.RequestException as exc:
        raise ServerError(f"{url}/metrics unreachable: {exc}") from exc
    if r.status_code != 200:
        raise ServerError(f"{url}/metrics returned HTTP {r.status_code}")
    return parse_counters(r.text)

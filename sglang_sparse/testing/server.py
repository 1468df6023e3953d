"""Run a real SGLang server on the CPU (the serving tests' and benchmarks' launcher)::

    from sglang_sparse.testing.server import SGLangServer

    with SGLangServer(model_dir, extra_args=["--radix-cache-backend", "sparse"]) as srv:
        out = srv.generate([5, 6, 7], max_new_tokens=8)
        out.output_ids, out.cached_tokens

The server runs in its own process group on a free loopback port; :meth:`SGLangServer.stop` kills
the whole group, and :mod:`~sglang_sparse.testing.orphan_guard` kills it when the launching process
dies without stopping it (pytest killed mid-test). Start-up failures raise :class:`ServerError`
carrying the tail of the server log.
Why not SGLang's test helpers: ``docs/sparse_backend.md``, "Test harness".
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_sparse.testing.orphan_guard import guarded
from sglang_sparse.testing.process_group import kill_group_but_tracker, live_group

#: Flags that make SGLang 0.5.23 serve a hybrid GDN model on a CPU without AMX, up to the Mamba
#: radix-cache strategy's name (:data:`CPU_SERVER_ARGS`, :data:`CPU_EXTRA_BUFFER_SERVER_ARGS`).
#: ``--sleep-on-idle``: an idle scheduler otherwise busy-polls a whole core, so on a 2-core machine
#: every live idle server halved what the others (the server under test, the reference) got.
_CPU_ARGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--skip-tokenizer-init",
    "--disable-cuda-graph",
    "--sleep-on-idle",
    "--dtype",
    "float32",
    "--mem-fraction-static",
    "0.05",
    "--mamba-radix-cache-strategy",
)
#: The CPU server on ``no_buffer`` with the overlap schedule off (SGLang's in-tree CPU platform).
CPU_SERVER_ARGS: tuple[str, ...] = (*_CPU_ARGS, "no_buffer", "--disable-overlap-schedule")

#: Environment for SGLang on the CPU (merged over os.environ; callers may add more).
#: SGLANG_MAMBA_CONV_DTYPE: SGLang keeps GDN conv states in bfloat16 by default, which makes decode
#: drift ~1e-4 from an fp32 reference (prefill is unaffected); fp32 keeps greedy tokens HF-exact.
CPU_ENV: dict[str, str] = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_MAMBA_CONV_DTYPE": "float32"}

#: Environment (merged over :data:`CPU_ENV`) selecting the project's opt-in SGLang platform
#: ``sglang_sparse_cpu`` (kernels/sglang_sparse_kernels/sgl_kernel_cpu/sglang_platform.py): SGLang's
#: in-tree CPU platform plus Mamba ``extra_buffer`` support.
CPU_EXTRA_BUFFER_ENV: dict[str, str] = {"SGLANG_PLATFORM": "sglang_sparse_cpu"}

#: :data:`CPU_SERVER_ARGS` for SGLang's ``extra_buffer`` Mamba radix-cache strategy with the overlap
#: schedule on; pass ``env=CPU_EXTRA_BUFFER_ENV`` (:func:`strategy_setup`) and, if wanted,
#: ``--page-size N`` in ``extra_args``.
CPU_EXTRA_BUFFER_SERVER_ARGS: tuple[str, ...] = (*_CPU_ARGS, "extra_buffer")

#: The state strategies a benchmark config can run on (``extra_buffer``: SGLang's GPU default).
STRATEGIES = ("no_buffer", "extra_buffer")


def strategy_setup(strategy: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(base_args, env)`` of a CPU server on ``strategy`` (see :data:`STRATEGIES`)."""
    if strategy == "no_buffer":
        return CPU_SERVER_ARGS, {}
    if strategy == "extra_buffer":
        return CPU_EXTRA_BUFFER_SERVER_ARGS, dict(CPU_EXTRA_BUFFER_ENV)
    raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")


class ServerError(RuntimeError):
    """The server failed to start or died; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(f"{message}\n--- server log (tail) ---\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail


@dataclass
class GenerateResult:
    """One ``/generate`` answer: greedy output ids plus SGLang's ``meta_info``."""

    output_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return int(self.meta.get("cached_tokens") or 0)

    @property
    def prompt_tokens(self) -> int:
        return int(self.meta.get("prompt_tokens") or 0)


def _generate_payload(
    input_ids: Sequence[int],
    max_new_tokens: int,
    sampling_params: Mapping[str, Any] | None,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """A greedy ``/generate`` body from token ids (``ignore_eos``; ``sampling_params`` override)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    params.update(sampling_params or {})
    return {"input_ids": list(input_ids), "sampling_params": params, **extra}


def _ephemeral_low(default: int = 32768) -> int:
    """The lowest port of the kernel's ephemeral range (``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


#: lowest port SGLang 0.5.23 picks for its own internal use (``get_free_port_below_ephemeral``)
SGLANG_INTERNAL_PORTS_LOW = 22000


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` below the kernel's ephemeral range (never a client's
    source port: a ``/health`` poll whose source port equals the server's port self-connects and
    holds it) and below :data:`SGLANG_INTERNAL_PORTS_LOW` (SGLang servers starting at the same time
    pick their internal ports at random in ``[22000, 29999]``). Not SGLang's
    ``get_free_port_below_ephemeral``: it falls back to an ephemeral port."""
    low = min(_ephemeral_low(), 32768, SGLANG_INTERNAL_PORTS_LOW)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free TCP port below {low} on {host}")


def _tail(path: Path, n_chars: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n_chars:]


def _mapped_shm(pids: Sequence[int]) -> set[str]:
    """The ``/dev/shm`` files mapped by ``pids``."""
    out: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                    out.add(path)
    return out


class SGLangServer:
    """A ``python -m sglang.launch_server`` subprocess on the CPU serving ``model_path`` (checkpoint
    directory) with :data:`CPU_SERVER_ARGS` (or ``base_args``), the sizing knobs
    ``max_total_tokens``, ``max_mamba_cache_size``, ``context_length`` (``None``: omitted) and then
    ``extra_args`` (later flags win in argparse). ``env`` is merged over ``os.environ`` and
    :data:`CPU_ENV`; stdout/stderr go to ``log_path`` (default: a temp file); ``python``: the
    interpreter (default: the current one)."""

    def __init__(
        self,
        model_path: str | Path,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        max_total_tokens: int | None = 4096,
        max_mamba_cache_size: int | None = 16,
        context_length: int | None = None,
        base_args: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        python: str | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        args = list(CPU_SERVER_ARGS if base_args is None else base_args)
        if max_total_tokens is not None:
            args += ["--max-total-tokens", str(max_total_tokens)]
        if max_mamba_cache_size is not None:
            args += ["--max-mamba-cache-size", str(max_mamba_cache_size)]
        if context_length is not None:
            args += ["--context-length", str(context_length)]
        self.cmd = [
            python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            host,
            "--port",
            str(self.port),
            *args,
            *extra_args,
        ]
        self.env = {**os.environ, **CPU_ENV, **(env or {})}
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang_server_", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 240.0) -> SGLangServer:
        """Launch and wait until ``/health`` answers 200 (and a tiny generate succeeds)."""
        import requests

        t0 = time.monotonic()
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            guarded(self.cmd), stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode}", _tail(self.log_path))
            try:
                r = requests.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"server not healthy after {timeout:.0f}s", _tail(self.log_path))
            time.sleep(0.5)
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """SIGKILL the server's processes (launcher, scheduler, detokenizer) but multiprocessing's
        resource tracker, which then unlinks what they registered, and unlink the ``/dev/shm`` files
        they mapped (only this server's). Not SIGTERM (``docs/sparse_backend.md``, "Test harness").
        Nothing a caller reads is written at shutdown: read :meth:`log_tail` and the statistics
        before stopping."""
        proc, self.proc = self.proc, None
        if proc is not None:
            shm = _mapped_shm(list(live_group(proc.pid))) if proc.poll() is None else set()
            kill_group_but_tracker(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            for path in shm:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()

    def __enter__(self) -> SGLangServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n_chars: int = 6000) -> str:
        return _tail(self.log_path, n_chars)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- requests ----------------------------------------------------------------------------
    def post(self, path: str, payload: Mapping[str, Any], timeout: float = 300.0) -> Any:
        """POST JSON and return the ``requests.Response`` (no status check)."""
        import requests

        return requests.post(f"{self.url}{path}", json=dict(payload), timeout=timeout)

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int = 8,
        *,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        **extra: Any,
    ) -> GenerateResult:
        """Greedy ``/generate`` from token ids; raises ``ServerError`` on a non-200 answer."""
        r = self.post(
            "/generate", _generate_payload(input_ids, max_new_tokens, sampling_params, extra), timeout=timeout
        )
        if r.status_code != 200:
            raise ServerError(f"/generate returned HTTP {r.status_code}: {r.text[:2000]}")
        body = r.json()
        return GenerateResult(output_ids=list(body["output_ids"]), meta=dict(body.get("meta_info", {})))

    def generate_streaming(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int = 8,
        *,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float = 300.0,
    ) -> tuple[float, GenerateResult]:
        """:meth:`generate` with ``stream``: ``(ttft_seconds, result)``. TTFT runs from sending the
        request to the first streamed chunk that carries output, measured in this process; the
        result holds the last chunk's output ids (cumulative: SGLang's default streaming) and
        ``meta_info``. Raises ``ServerError`` on a non-200 answer or a stream without output."""
        import json

        import requests

        payload = _generate_payload(input_ids, max_new_tokens, sampling_params, {"stream": True})
        t0 = time.perf_counter()
        ttft: float | None = None
        last: dict[str, Any] = {}
        with requests.post(f"{self.url}/generate", json=payload, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                raise ServerError(f"/generate returned HTTP {r.status_code}: {r.text[:2000]}")
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if ttft is None and (chunk.get("output_ids") or chunk.get("text")):
                    ttft = time.perf_counter() - t0
                last = chunk
        if ttft is None:
            raise ServerError("the /generate stream ended without output")
        return ttft, GenerateResult(list(last.get("output_ids") or []), dict(last.get("meta_info", {})))

    def sparse_stats(self, timeout: float = 120.0) -> dict[str, Any]:
        """The ``sparse_cache`` statistics of TP rank 0 (``/server_info`` internal states).
        Raises :class:`ServerError` if the per-rank list is missing, does not start with rank 0's
        statistics or reports ranks that disagree."""
        ranks = self.sparse_rank_stats(timeout)
        return ranks[0]

    def sparse_rank_stats(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Every TP rank's ``sparse_cache`` statistics, in rank order (``sparse_cache_ranks``)."""
        import requests

        state = requests.get(f"{self.url}/server_info", timeout=timeout).json()["internal_states"][0]
        ranks = state.get("sparse_cache_ranks")
        if not ranks or ranks[0] != state["sparse_cache"]:
            raise ServerError(f"/server_info has no per-rank sparse statistics: {sorted(state)}")
        if not state.get("sparse_cache_ranks_agree"):
            raise ServerError(f"TP ranks disagree: {ranks}")
        return ranks

    def wait_sparse_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll :meth:`sparse_stats` until nothing is protected (no request holds KV or a state)
        or ``timeout`` seconds pass; return the last statistics."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.sparse_stats()
            if (s["kv_protected"] == 0 and s["mamba_protected"] == 0) or time.monotonic() > deadline:
                return s
            time.sleep(0.5)

    def flush_cache(self) -> bool:
        """Drop the prefix cache (``/flush_cache``); True on success."""
        import requests

        return requests.post(f"{self.url}/flush_cache", timeout=60).status_code == 200

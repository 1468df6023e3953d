"""Alpha-tuning replays in a worker process, off the caller's CPU time.

Inside SGLang the scheduler's CPU time is what the GPU waits on (with the overlap schedule it
prepares batch N+1 while N runs), so the backend replays its tuning window in a child process:
:class:`ReplayWorker` starts ``python -m sglang_sparse.sim.replay_worker`` (no SGLang import,
lowered CPU priority) and feeds it flat jobs (a :class:`~sglang_sparse.policy.CacheSnapshot`, the
window's ``(input, input + output)`` token arrays, the cost model, the alpha grid); the child answers
the FLOPs-saved score of every alpha (:func:`~sglang_sparse.sim.simulator.warm_replay_score`), in
grid order. The decision (:meth:`AlphaTuner.choose`) and the moment it takes effect stay with the
caller, so the outcome is a pure function of the request stream whatever the worker's speed.

Protocol: length-prefixed pickle frames (8-byte little-endian length) on the child's stdin (jobs:
``(job_id, snapshot, window, cost, grid)``) and stdout (answers: ``(job_id, True, scores)`` or
``(job_id, False, traceback)``), answered in order. The child writes nothing else to stdout (its
``print`` and C-level writes go to stderr, i.e. the parent's log) and exits at EOF on stdin.
A dead child fails every pending and later job with :class:`ReplayWorkerError` (never hangs).
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from concurrent.futures import Future
from typing import IO, Any

_HEADER = struct.Struct("<Q")
#: CPU priority increment of the worker (``nice``), used where the idle scheduling class is not
#: available: it never competes with the scheduler on equal terms
WORKER_NICE = 10


class ReplayWorkerError(RuntimeError):
    """The replay worker died, or a replay raised (the message carries its traceback)."""


def _write_frame(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = stream.read(n - got)
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_frame(stream: IO[bytes]) -> Any | None:
    head = _read_exact(stream, _HEADER.size)
    if head is None:
        return None
    body = _read_exact(stream, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def replay_scores(snapshot: Any, window: Sequence[Any], cost: Any, grid: Sequence[float]) -> list[float]:
    """FLOPs saved replaying ``window`` from ``snapshot`` at every alpha of ``grid`` (grid order)."""
    from .simulator import warm_replay_score

    return [warm_replay_score(snapshot, window, cost, float(a)) for a in grid]


class ReplayWorker:
    """One child process answering :func:`replay_scores` jobs; :meth:`submit` returns a Future.
    Thread-safe; the child starts on the first job and is reused."""

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._dead: str | None = None
        self.jobs = 0

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) the child has used so far: 0.0 before it starts, ``None``
        when it cannot be read (no psutil, or the child is gone). Reported, never decided on."""
        pid = self.pid
        if pid is None:
            return 0.0
        try:
            import psutil

            t = psutil.Process(pid).cpu_times()
        except Exception:  # noqa: BLE001 - a reading, not a decision
            return None
        return float(t.user + t.system)

    def _start(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [self.python, "-m", "sglang_sparse.sim.replay_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        reader = threading.Thread(
            target=self._read_loop, args=(proc,), name="sparse-replay-reader", daemon=True
        )
        reader.start()
        return proc

    def _read_loop(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        while True:
            try:
                msg = _read_frame(proc.stdout)
            except Exception as e:  # noqa: BLE001 - a corrupt frame is a dead worker
                msg = None
                why = f"unreadable answer ({e})"
            else:
                why = None
            if msg is None:
                code = proc.wait()
                self._fail_all(why or f"replay worker exited with code {code}")
                return
            job_id, ok, payload = msg
            with self._lock:
                fut = self._pending.pop(job_id, None)
            if fut is None:
                continue
            if ok:
                fut.set_result(payload)
            else:
                fut.set_exception(ReplayWorkerError(f"replay failed in the worker:\n{payload}"))

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._dead = why
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(ReplayWorkerError(why))

    def submit(self, snapshot: Any, window: Sequence[Any], cost: Any, grid: Sequence[float]) -> Future:
        """Queue one job; the Future yields the scores of ``grid`` (or raises ReplayWorkerError)."""
        fut: Future = Future()
        with self._lock:
            if self._dead is not None:
                fut.set_exception(ReplayWorkerError(self._dead))
                return fut
            if self._proc is None:
                self._proc = self._start()
            job_id = self._next
            self._next += 1
            self._pending[job_id] = fut
            self.jobs += 1
            proc = self._proc
        try:
            assert proc.stdin is not None
            _write_frame(proc.stdin, (job_id, snapshot, list(window), cost, tuple(grid)))
        except (OSError, ValueError) as e:  # broken pipe: the child is gone
            with self._lock:
                self._pending.pop(job_id, None)
            if not fut.done():
                fut.set_exception(ReplayWorkerError(f"replay worker unreachable ({e})"))
        return fut

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (EOF, then kill after ``timeout`` seconds); pending jobs fail."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    while True:
        job = _read_frame(inp)
        if job is None:
            return
        job_id, snapshot, window, cost, grid = job
        try:
            answer = (job_id, True, replay_scores(snapshot, window, cost, grid))
        except Exception:  # noqa: BLE001 - reported to the caller, the worker keeps serving
            answer = (job_id, False, traceback.format_exc())
        _write_frame(out, answer)


def lower_priority() -> str:
    """Put this process in Linux's idle scheduling class (it runs only on a core no other process
    wants), else raise its ``nice`` by :data:`WORKER_NICE`. Returns which took effect
    (``"idle"``, ``"nice"`` or ``"none"``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(WORKER_NICE)
        return "nice"
    except OSError:
        return "none"


def main() -> None:
    """Child entry point: answer jobs from stdin until EOF."""
    lower_priority()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray writes (print, C libraries) go to stderr, never into the answer stream
    sys.stdout = sys.stderr
    _serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()

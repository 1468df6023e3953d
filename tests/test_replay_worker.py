"""The alpha-tuning replay worker (``sglang_sparse.sim.replay_worker``): answers equal to in-process
replays, errors reported without killing it, a dead worker fails its jobs instead of hanging, and the
tuner's decision from worker scores equals :meth:`AlphaTuner.tune`."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from sglang_sparse.policy import AlphaTuner, HybridCache
from sglang_sparse.sim.models import cost_model
from sglang_sparse.sim.replay_worker import ReplayWorker, ReplayWorkerError, replay_scores
from sglang_sparse.sim.simulator import warm_replay_score


def _setup():
    cost = cost_model("qwen3-next-80b-a3b")
    rng = np.random.default_rng(3)
    heads = [rng.integers(0, 5000, 300 + 50 * k, dtype=np.int32) for k in range(4)]
    window = []
    for i in range(24):
        inp = np.concatenate([heads[i % 4], rng.integers(0, 5000, 40, dtype=np.int32)])
        window.append((inp, np.concatenate([inp, rng.integers(0, 5000, 8, dtype=np.int32)])))
    budget = cost.state_bytes * 3 + cost.kv_bytes_per_token * 900
    cache = HybridCache("sparse", budget_bytes=budget, cost=cost)
    return cache.snapshot(), window, cost


def test_worker_scores_equal_in_process_replays() -> None:
    snap, window, cost = _setup()
    grid = (0.0, 0.5, 2.0, 8.0)
    worker = ReplayWorker()
    try:
        got = worker.submit(snap, window, cost, grid).result(timeout=120)
        again = worker.submit(snap, window, cost, grid).result(timeout=120)  # the child is reused
        assert worker.jobs == 2
    finally:
        worker.close()
    want = [warm_replay_score(snap, window, cost, a) for a in grid]
    assert got == want == again == replay_scores(snap, window, cost, grid)
    tuner_a, tuner_b = AlphaTuner(grid, workers=1), AlphaTuner(grid, workers=1)
    assert tuner_a.choose(got, current=0.5) == tuner_b.tune(
        lambda a: warm_replay_score(snap, window, cost, a), current=0.5
    )


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes only")
def test_worker_runs_in_the_idle_class_and_reports_its_cpu() -> None:
    snap, window, cost = _setup()
    worker = ReplayWorker()
    try:
        assert worker.cpu_seconds() == 0.0  # not started yet
        before = os.sched_getscheduler(0)
        worker.submit(snap, window, cost, (0.0, 0.5, 2.0, 8.0)).result(timeout=120)
        assert os.sched_getscheduler(worker.pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) == before  # the caller's class is untouched
        first = worker.cpu_seconds()
        assert first is not None and first > 0
        worker.submit(snap, window, cost, (0.0, 0.5, 2.0, 8.0)).result(timeout=120)
        assert worker.cpu_seconds() > first
    finally:
        worker.close()


def test_worker_reports_errors_and_keeps_serving() -> None:
    snap, window, cost = _setup()
    worker = ReplayWorker()
    try:
        bad = worker.submit(snap, [("not", "tokens")], cost, (0.0,))
        with pytest.raises(ReplayWorkerError, match="replay failed in the worker"):
            bad.result(timeout=120)
        ok = worker.submit(snap, window[:4], cost, (0.0,)).result(timeout=120)
        assert len(ok) == 1 and ok[0] >= 0
    finally:
        worker.close()


def test_dead_worker_fails_jobs_instead_of_hanging() -> None:
    snap, window, cost = _setup()
    worker = ReplayWorker()
    try:
        worker.submit(snap, window[:2], cost, (0.0,)).result(timeout=120)
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(ReplayWorkerError):
            # Either the write fails (broken pipe) or the reader sees the exit: never a hang.
            worker.submit(snap, window, cost, (0.0, 1.0)).result(timeout=60)
        with pytest.raises(ReplayWorkerError):
            worker.submit(snap, window, cost, (0.0,)).result(timeout=5)
    finally:
        worker.close()


def test_choose_breaks_ties_like_tune() -> None:
    t = AlphaTuner((0.0, 1.0, 2.0), workers=1)
    assert t.choose([3.0, 5.0, 5.0]) == 1.0  # first best
    assert t.choose([3.0, 5.0, 5.0], current=2.0) == 2.0  # a tie keeps the alpha in use
    assert t.choose([6.0, 5.0, 5.0], current=2.0) == 0.0
    assert [h[1] for h in t.history] == [1.0, 2.0, 0.0]
    with pytest.raises(ValueError):
        t.choose([1.0])

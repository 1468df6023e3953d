"""``/server_info`` shows every TP rank's sparse-cache statistics: the hook gathers them over the
CPU group of the ranks that process the request (``gather_rank_stats``; checked here with two real
gloo processes) and flags ranks whose cache decisions diverged (``ranks_disagree``)."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch not installed; run tools/setup_env.sh", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sglang_sparse.sglang_adapter.plugin import (  # noqa: E402
    RANK_AGREEMENT_KEYS,
    gather_rank_stats,
    ranks_disagree,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)), backend="gloo")
        stats = {"rank": rank, "states_held": 10 + rank % 2, "alpha": 0.5}
        out[rank] = gather_rank_stats(stats, group)
    finally:
        dist.destroy_process_group()


def test_gather_over_two_gloo_ranks_in_rank_order() -> None:
    world = 2
    with mp.Manager() as m:
        out = m.dict()
        mp.start_processes(_worker, args=(world, _free_port(), out), nprocs=world, start_method="spawn")
        got = dict(out)
    want = [{"rank": r, "states_held": 10 + r % 2, "alpha": 0.5} for r in range(world)]
    assert got[0] == want and got[1] == want  # every rank sees every rank, in rank order
    assert ranks_disagree(got[0]) == ["states_held"]


def test_single_rank_needs_no_group() -> None:
    s = {"states_held": 3}
    assert gather_rank_stats(s, None) == [s]
    assert ranks_disagree([s]) == []


def test_agreement_keys_exist_in_the_statistics() -> None:
    from sglang_sparse.sglang_adapter.tree_policy import PolicyStats

    have = {f for f in PolicyStats.__dataclass_fields__} | {"states_held", "alpha"}
    assert set(RANK_AGREEMENT_KEYS) <= have

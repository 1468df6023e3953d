"""``free_port`` hands out ports a client's ephemeral source port can never take (no TCP
self-connect while a test polls a server that is not listening yet)."""

from __future__ import annotations

import inspect
import socket

import pytest

from sglang_sparse.testing.server import SGLANG_INTERNAL_PORTS_LOW, _ephemeral_low, free_port


def test_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    low = _ephemeral_low()
    for _ in range(50):
        port = free_port()
        assert 1024 <= port < min(low, SGLANG_INTERNAL_PORTS_LOW)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_returned() -> None:
    taken = []
    try:
        for _ in range(20):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert all(free_port() not in held for _ in range(200))
    finally:
        for s in taken:
            s.close()


def test_ports_are_below_the_range_sglang_picks_its_internal_ports_from() -> None:
    """A server starting beside ours picks ``nccl_port`` and its TCPStore port at random from
    SGLang's own range; ours must not overlap it (EADDRINUSE on two concurrent starts)."""
    network = pytest.importorskip("sglang.srt.utils.network")
    low = inspect.signature(network.get_free_port_below_ephemeral).parameters["low"].default
    assert low == SGLANG_INTERNAL_PORTS_LOW
    assert all(free_port() < low for _ in range(200))

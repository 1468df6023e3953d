"""The router launcher's command line (no router is started)."""

from __future__ import annotations

from sglang_sparse.testing.router import Router


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_each_router_gets_its_own_metrics_port() -> None:
    """sglang-router's Prometheus exporter binds 29000 unless told otherwise: a second router on
    the machine (the test suite beside a router benchmark) panicked with EADDRINUSE."""
    a = Router(["http://127.0.0.1:1"])
    b = Router(["http://127.0.0.1:2"])
    pa, pb = int(_arg(a.cmd, "--prometheus-port")), int(_arg(b.cmd, "--prometheus-port"))
    assert 29000 not in (pa, pb) and pa != a.port and pb != b.port
    assert _arg(a.cmd, "--prometheus-host") == "127.0.0.1"

"""A server launched by the test harness dies with the process that launched it: pytest killed by
SIGKILL mid-test (no fixture finaliser runs) leaves no server process behind, and a server that
exits on its own reports its own return code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from sglang_sparse.testing.orphan_guard import POLL_S, guarded
from sglang_sparse.testing.process_group import live_group

#: a stand-in server: answers /health on the port in argv[1] and keeps a child of its own alive
#: (SGLang's scheduler and detokenizer are the launcher's children)
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)

#: an owner process (pytest's role): starts the fake server through SGLangServer, prints the
#: server's process group, then waits to be killed
OWNER = textwrap.dedent(
    """
    import sys, time
    from sglang_sparse.testing.server import SGLangServer
    srv = SGLangServer("unused")
    srv.cmd = [sys.executable, sys.argv[1], str(srv.port)]
    srv.start(timeout=60)
    print(srv.proc.pid, flush=True)
    time.sleep(600)
    """
)


def _wait_gone(pgid: int, timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while (left := live_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_sigkilled_owner_leaves_no_server_behind(tmp_path: Path) -> None:
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(fake)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pgid = int(owner.stdout.readline())
        deadline = time.monotonic() + 30
        while len(live_group(pgid)) < 3 and time.monotonic() < deadline:  # guard, server, its child
            time.sleep(0.1)
        assert len(live_group(pgid)) >= 3, live_group(pgid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        left = _wait_gone(pgid, timeout=10 * POLL_S + 5)
        assert not left, f"orphaned after the owner was killed: {left}"
    finally:
        owner.kill()
        owner.wait()


def test_guard_returns_the_commands_code_and_sigterm_kills_the_group() -> None:
    rc = subprocess.run(guarded([sys.executable, "-c", "raise SystemExit(3)"]), timeout=60).returncode
    assert rc == 3
    proc = subprocess.Popen(
        guarded([sys.executable, "-c", "import time; time.sleep(600)"]), start_new_session=True
    )
    deadline = time.monotonic() + 30
    while len(live_group(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(live_group(proc.pid)) == 2
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=10) == 137
    assert not _wait_gone(proc.pid, timeout=5)


def test_owner_is_this_process_by_default() -> None:
    cmd = guarded(["true"])
    assert cmd[:3] == [sys.executable, "-m", "sglang_sparse.testing.orphan_guard"]
    assert cmd[3:] == [str(os.getpid()), "--", "true"]

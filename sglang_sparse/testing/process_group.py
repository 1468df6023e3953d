"""The live processes of a process group, and killing them all but multiprocessing's resource
tracker (Linux ``/proc``). Shared by :class:`~sglang_sparse.testing.server.SGLangServer` and
:mod:`~sglang_sparse.testing.orphan_guard`; imports nothing of the project."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def live_group(pgid: int) -> dict[int, str]:
    """pid -> command line of the live processes in group ``pgid`` (Linux ``/proc``; zombies, which
    wait for init to reap them, are not live)."""
    out: dict[int, str] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (
                os.getpgid(int(proc.name)) == pgid
                and (proc / "stat").read_text().split(")")[-1].split()[0] != "Z"
            ):
                out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    return out


def kill_group_but_tracker(pgid: int, grace_s: float = 5.0) -> None:
    """SIGKILL the live processes of group ``pgid`` except multiprocessing's resource tracker (which
    then unlinks what they registered) and the calling process, then give the tracker up to
    ``grace_s`` seconds to clean up and exit."""
    me = os.getpid()
    for pid, cmd in live_group(pgid).items():
        if pid != me and "multiprocessing.resource_tracker" not in cmd:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while set(live_group(pgid)) - {me} and time.monotonic() < deadline:
        time.sleep(0.05)

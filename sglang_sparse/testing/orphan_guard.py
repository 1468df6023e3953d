"""Run a command so that it dies with the process that launched it::

    python -m sglang_sparse.testing.orphan_guard <owner_pid> -- <command ...>

The guard starts ``command`` as its child, in the guard's own process group (the launcher passes
``start_new_session=True``), and then waits. When the owner process dies (pytest or a benchmark
killed by Ctrl-C, SIGTERM or SIGKILL, so that no ``finally`` ran) the guard is re-parented, sees
``os.getppid() != owner_pid`` within :data:`POLL_S` seconds and SIGKILLs every live process of its
group but multiprocessing's resource tracker (which then unlinks the shared memory the server
registered), then itself. SIGTERM or SIGINT to the guard does the same. When the command exits on
its own the guard exits with its return code.

Why not ``prctl(PR_SET_PDEATHSIG)``: Linux sends it when the *thread* that forked the child exits,
and the benchmarks start servers from thread pools, so a pool's shutdown would kill live servers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from sglang_sparse.testing.process_group import kill_group_but_tracker

#: Seconds between checks of the owner (the longest an orphaned server lives).
POLL_S = 0.5


def guarded(cmd: Sequence[str], owner_pid: int | None = None) -> list[str]:
    """``cmd`` wrapped by the guard, owned by ``owner_pid`` (default: this process)."""
    owner = os.getpid() if owner_pid is None else owner_pid
    return [sys.executable, "-m", "sglang_sparse.testing.orphan_guard", str(owner), "--", *cmd]


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m sglang_sparse.testing.orphan_guard <owner_pid> -- <command ...>",
            file=sys.stderr,
        )
        return 2
    owner = int(argv[0])
    child = subprocess.Popen(list(argv[2:]))
    stop = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    while True:
        rc = child.poll()
        if rc is not None:
            return rc
        if stop or os.getppid() != owner:
            kill_group_but_tracker(os.getpgid(0))
            return 137
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

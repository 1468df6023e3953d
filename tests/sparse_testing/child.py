"""Run a Python child process that reports one JSON object on a tagged stdout line.

Serving tests that need their own published SGLang ``ServerArgs`` (fresh node ids, clocks and
environment) run their body in a child::

    result = run_tagged_child(["-c", CHILD, "on"], tag="HINT", drop_env=("SGLANG_SPARSE_",))

The child prints ``"<TAG> " + json.dumps(obj)``; the last such line is parsed and returned. A child
that exits non-zero or prints no tagged line raises ``AssertionError`` carrying the tails of its
stdout and stderr, so a pytest failure shows why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def child_env(drop_env: Iterable[str] = (), extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without variables starting with any of ``drop_env``, with the
    repository first on ``PYTHONPATH`` and ``extra`` on top."""
    prefixes = tuple(drop_env)  # str.startswith(()) is False: nothing dropped
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def run_tagged_child(
    args: Sequence[str],
    tag: str,
    *,
    drop_env: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
) -> Any:
    """Run ``python <args>`` in the repository and return the JSON of its last ``<tag> `` line.

    ``drop_env``: prefixes of variables not passed on (e.g. ``SGLANG_SPARSE_`` so a developer's
    shell settings do not change the test); ``env``: variables set on top. ``timeout`` in seconds.
    """
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=child_env(drop_env, env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    prefix = tag + " "
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    assert proc.returncode == 0 and lines, (
        f"child exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len(prefix) :])

"""Every benchmark with a command line runs both ways the docs show: ``python benchmarks/X.py`` (a
script: ``benchmarks`` is not installed, so the script puts the repo on ``sys.path`` itself) and
``python -m benchmarks.X``. Checked with ``--help`` (imports and the parser, nothing run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.stem for p in (REPO / "benchmarks").glob("[!_]*.py") if 'if __name__ == "__main__"' in p.read_text()
)
#: (argv after the interpreter, cwd): each script as a script from outside the repo (the script must
#: not rely on the cwd) and as a module, and the package runner ``python -m benchmarks``
CASES = [
    *[([str(REPO / "benchmarks" / f"{n}.py")], REPO.parent) for n in SCRIPTS],
    *[(["-m", f"benchmarks.{n}"], REPO) for n in SCRIPTS],
    (["-m", "benchmarks"], REPO),
]


def test_the_benchmarks_with_a_command_line_are_found() -> None:
    assert {"sim_compare", "placement", "serving_load", "long_sessions", "prefill_cpu"} <= set(SCRIPTS)


@pytest.mark.parametrize(("argv", "cwd"), CASES, ids=[a[-1].split("/")[-1] for a, _ in CASES])
def test_benchmark_help_runs(argv: list[str], cwd: Path) -> None:
    cmd = [sys.executable, *argv, "--help"]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]

"""The main job (``python -m benchmarks``) writes to a git-ignored folder unless told to write the
committed results, names what it wrote at the end, and its progress bars are throttled in a log."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import __main__ as main_job  # noqa: E402
from benchmarks import _common  # noqa: E402
from sglang_sparse.progress import LOG_BAR_INTERVAL_S, bar_options  # noqa: E402


@pytest.fixture
def fake_stages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Path]:
    """Stages that write one JSON and one PNG through ``results_dir``; both roots under tmp."""
    roots = {"local": tmp_path / "local", "committed": tmp_path / "committed"}
    monkeypatch.setattr(main_job, "LOCAL_RESULTS", roots["local"])
    monkeypatch.setattr(main_job, "RESULTS", roots["committed"])

    def run_stage(name: str, quick: bool) -> None:
        out = _common.results_dir(quick)
        (out / f"{name}.json").write_text("{}")
        (out / f"{name}.png").write_bytes(b"png")

    monkeypatch.setattr(main_job, "run_stage", run_stage)
    return roots


def test_main_job_writes_the_ignored_folder_by_default(fake_stages: dict[str, Path], capsys) -> None:
    assert main_job.main(["--only", "placement", "sim"]) == 0
    assert sorted(p.name for p in fake_stages["local"].iterdir()) == [
        "placement.json",
        "placement.png",
        "sim.json",
        "sim.png",
    ]
    assert not fake_stages["committed"].exists()
    assert _common.results_root() == _common.RESULTS  # the process default is back
    out = capsys.readouterr().out
    tail = out[out.index("[benchmarks] summary") :]
    assert "plots (2):" in tail and "results (2):" in tail
    assert str(fake_stages["local"] / "sim.png") in tail and len(tail.splitlines()) < 25


def test_commit_results_writes_the_committed_folder(fake_stages: dict[str, Path]) -> None:
    assert main_job.main(["--only", "sim", "--commit-results", "--quick"]) == 0
    assert (fake_stages["committed"] / "quick" / "sim.json").exists()
    assert not fake_stages["local"].exists()


def test_written_since_lists_only_new_json_and_png(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 100, time.time() - 100))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "new.png").write_bytes(b"")
    (tmp_path / "server.log").write_text("")
    t0 = time.time() - 10
    assert main_job.written_since(tmp_path, t0) == [tmp_path / "a" / "new.png"]
    assert main_job.written_since(tmp_path / "missing", t0) == []


def test_the_local_folder_is_git_ignored() -> None:
    probe = _common.LOCAL_RESULTS / "quick" / "x.json"
    rc = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=REPO, check=False).returncode
    assert rc == 0, f"{probe} is not git-ignored"


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_bars_are_live_in_a_terminal_and_throttled_in_a_log() -> None:
    assert bar_options(_Stream(True)).get("mininterval") is None
    opts = bar_options(_Stream(False))
    assert opts["mininterval"] == LOG_BAR_INTERVAL_S and opts["ascii"] is True
    from tqdm import tqdm

    log = _Stream(False)
    for _ in tqdm(range(5000), desc="x", **bar_options(log)):
        pass
    # a fast loop in a log: the first line and the final count, not one line per redraw
    assert log.getvalue().count("\r") <= 3, log.getvalue()[:500]

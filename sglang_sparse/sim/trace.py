"""Trace loading for the simulator (delegates to :mod:`sglang_sparse.traces` when available)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimRequest:
    """What the simulator needs from one trace row (token ids as tuples)."""

    session_id: str
    turn_id: int
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]


def _read_jsonl(path: str | os.PathLike[str]) -> list[SimRequest]:
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                out.append(
                    SimRequest(
                        str(o["session_id"]),
                        int(o["turn_id"]),
                        tuple(o["input_tokens"]),
                        tuple(o["output_tokens"]),
                    )
                )
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{i}: malformed trace line ({e})") from None
    return out


def load_trace(path: str | os.PathLike[str]) -> list[SimRequest]:
    """Read a JSONL trace (see :mod:`sglang_sparse.traces.schema` for the format)."""
    try:
        from sglang_sparse.traces.schema import read_trace
    except ImportError:  # the traces package is optional for the simulator
        return _read_jsonl(path)
    return [SimRequest(r.session_id, r.turn_id, r.input_tokens, r.output_tokens) for r in read_trace(path)]

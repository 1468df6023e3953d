"""Trace loading for the simulator (delegates to :mod:`sglang_sparse.traces`)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimRequest:
    """What the simulator needs from one trace row (token ids as tuples)."""

    session_id: str
    turn_id: int
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]


def load_trace(path: str | os.PathLike[str]) -> list[SimRequest]:
    """Read a JSONL trace (see :mod:`sglang_sparse.traces.schema` for the format)."""
    from sglang_sparse.traces.schema import read_trace  # lazy: ``import sglang_sparse.sim`` stays light

    return [SimRequest(r.session_id, r.turn_id, r.input_tokens, r.output_tokens) for r in read_trace(path)]

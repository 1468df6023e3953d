"""Shared helpers for the trace builders: popularity, arrival times, corpus tokenization.

Times are logical seconds (floats rounded to microseconds); lengths are tokens.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .data import SYSTEM_PROMPTS_TAR, data_file, load_system_prompts
from .schema import Request
from .textgen import synthetic_answer_tokens
from .tokenizer import get_tokenizer


@dataclass
class BuiltTrace:
    """A builder's result: requests sorted by ``ts`` plus builder-specific ``info`` for the metadata."""

    requests: list[Request]
    info: dict[str, Any] = field(default_factory=dict)


def zipf_probabilities(n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Probabilities ``p[i]`` of ``n`` items with Zipf-like popularity over a random permutation.

    The item at popularity rank ``r`` (1-based, rank order = ``rng.permutation(n)``) gets weight
    ``r ** -exponent``; ``exponent = 0`` is uniform. Returns float64 summing to 1."""
    if n <= 0:
        raise ValueError(f"need at least one item, got n={n}")
    if exponent < 0:
        raise ValueError(f"zipf exponent must be >= 0, got {exponent}")
    ranks = np.empty(n, dtype=np.float64)
    ranks[rng.permutation(n)] = np.arange(1, n + 1, dtype=np.float64)
    w = ranks**-exponent
    return w / w.sum()


def poisson_arrivals(rng: np.random.Generator, n: int, mean_gap_s: float, start_s: float = 0.0) -> np.ndarray:
    """``n`` arrival times (seconds) of a Poisson process: ``start_s + cumsum(Exp(mean_gap_s))``."""
    if mean_gap_s < 0:
        raise ValueError(f"mean gap must be >= 0 seconds, got {mean_gap_s}")
    if n <= 0:
        return np.zeros(0)
    gaps = rng.exponential(mean_gap_s, size=n) if mean_gap_s > 0 else np.zeros(n)
    return start_s + np.cumsum(gaps)


def round_ts(ts: float) -> float:
    """Timestamps are stored rounded to microseconds so that files are byte-stable."""
    return round(float(ts), 6)


def single_turn(
    rng: np.random.Generator, session_id: str, ts: float, inp: list[int], out_min: int, out_max: int
) -> Request:
    """Turn 0 of ``session_id`` at ``ts`` (rounded): ``inp`` and a synthetic answer of ``out_min`` to
    ``out_max`` tokens (drawn from ``rng`` after the input)."""
    return Request.make(session_id, 0, round_ts(ts), inp, synthetic_answer_tokens(rng, out_min, out_max))


def sort_requests(requests: list[Request]) -> list[Request]:
    """Stable order by (ts, session_id, turn_id)."""
    return sorted(requests, key=lambda r: (r.ts, r.session_id, r.turn_id))


@functools.lru_cache(maxsize=4)
def _prompt_tokens(path: Path) -> tuple[tuple[str, tuple[int, ...]], ...]:
    tok = get_tokenizer()
    return tuple((name, tuple(tok.encode(text))) for name, text in load_system_prompts(path.parent))


def system_prompt_tokens(data_dir: str | os.PathLike[str] | None) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(name, token ids)`` of every system prompt (sorted by name), tokenized once per process."""
    return _prompt_tokens(data_file(data_dir, SYSTEM_PROMPTS_TAR))


def check_range(name: str, lo: float, hi: float, minimum: float = 0) -> None:
    """Raise ValueError unless ``minimum <= lo <= hi`` (parameter pairs like min/max tokens)."""
    if not minimum <= lo <= hi:
        raise ValueError(f"{name}: need {minimum} <= min <= max, got min={lo}, max={hi}")


def check_positive(**values: float) -> None:
    """Raise ValueError naming the first parameter that is not > 0."""
    for k, v in values.items():
        if not v > 0:
            raise ValueError(f"parameter {k} must be > 0, got {v}")

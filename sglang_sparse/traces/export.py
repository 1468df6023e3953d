"""Export project traces to the dataset formats ``python -m sglang.bench_serving`` reads.

Two formats (see ``sglang/benchmark/datasets/custom.py`` and ``agentic_trace.py``):

* ``custom`` (``--dataset-name custom``): JSONL, one request a line,
  ``{"conversations": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": OUT}]}``.
  Used for doc_qa, system_prompts and rag (single-turn requests sharing prefixes).
* ``agentic`` (``--dataset-name agentic-trace``, chat backend): one JSON object
  ``{"metadata": {...}, "conversations": [[{"messages": [...], "prompt_tokens": N}, ...], ...]}``;
  each turn holds only the *new* tokens of its prompt (the part after the previous turn's prompt
  and output), so the client replays a session turn by turn, each prompt extending the last.

Token ids become text the tiny test models' word-level tokenizer (``sglang_sparse/models/tiny.py``:
``w{id}`` words split on whitespace) maps back to exactly those ids, after the deterministic vocab
remap of ``benchmarks/serving.py`` (ids 0-3 are reserved special tokens). With a real tokenizer pass
``decode=`` instead (e.g. ``tokenizer.decode``); the round trip is then only approximate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .schema import Request

FORMATS: tuple[str, ...] = ("custom", "agentic")
"""Supported output formats (bench_serving ``--dataset-name`` ``custom`` / ``agentic-trace``)."""


def remap_token(token: int, vocab: int) -> int:
    """Map a trace token id into ``[4, vocab)`` (the multiplicative hash of ``benchmarks/serving.py``)."""
    if vocab <= 4:
        raise ValueError(f"vocab must be > 4, got {vocab}")
    return 4 + (int(token) * 2654435761 + 97) % (vocab - 4)


def word_text(tokens: Sequence[int], vocab: int | None = None) -> str:
    """Text the tiny word-level tokenizer encodes to ``tokens`` (remapped first when ``vocab`` is set)."""
    ids = [remap_token(t, vocab) for t in tokens] if vocab else [int(t) for t in tokens]
    return " ".join(f"w{i}" for i in ids)


def _decoder(
    vocab: int | None, decode: Callable[[Sequence[int]], str] | None
) -> Callable[[Sequence[int]], str]:
    """``decode`` when given, else the word-level text of :func:`word_text`."""
    if decode is not None:
        return decode
    return lambda toks: word_text(toks, vocab)


def to_custom_rows(
    requests: Iterable[Request],
    *,
    vocab: int | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> list[dict[str, Any]]:
    """One ``custom``-format row per request, in trace order.

    Note that bench_serving's custom loader shuffles rows (seeded by ``--seed``); order does not
    change which prefixes are shared, only the arrival order."""
    dec = _decoder(vocab, decode)
    rows = []
    for r in requests:
        out = r.output_tokens if len(r.output_tokens) >= 2 else tuple(r.output_tokens) * 2 or (0, 0)
        rows.append(
            {
                "conversations": [
                    {"role": "user", "content": dec(r.input_tokens)},
                    {"role": "assistant", "content": dec(out)},
                ],
                "session_id": r.session_id,
                "turn_id": r.turn_id,
                "ts": r.ts,
            }
        )
    return rows


def _sessions(requests: Iterable[Request]) -> list[list[Request]]:
    """Requests grouped by session (sessions in order of first arrival, turns by ``turn_id``)."""
    groups: dict[str, list[Request]] = {}
    for r in requests:
        groups.setdefault(r.session_id, []).append(r)
    return [sorted(g, key=lambda r: r.turn_id) for g in groups.values()]


def turn_deltas(session: Sequence[Request]) -> list[tuple[int, ...]]:
    """New prompt tokens of each turn: the part after ``prompt(i-1) + output(i-1)``.

    Raises ``ValueError`` when a turn's prompt does not extend the previous turn's prompt and output
    (the agentic replay would then not reproduce the trace's prefix sharing)."""
    deltas: list[tuple[int, ...]] = []
    prev: tuple[int, ...] = ()
    for r in session:
        if r.input_tokens[: len(prev)] != prev:
            raise ValueError(
                f"session {r.session_id!r} turn {r.turn_id}: prompt does not extend the previous turn"
            )
        deltas.append(tuple(r.input_tokens[len(prev) :]))
        prev = tuple(r.input_tokens) + tuple(r.output_tokens)
    return deltas


def to_agentic(
    requests: Iterable[Request],
    *,
    vocab: int | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    name: str = "trace",
) -> dict[str, Any]:
    """The ``agentic-trace`` JSON object: one conversation per session, one entry per turn."""
    dec = _decoder(vocab, decode)
    convs = []
    for session in _sessions(requests):
        turns = []
        for r, delta in zip(session, turn_deltas(session), strict=True):
            turns.append(
                {
                    "messages": [{"role": "user", "content": dec(delta)}] if delta else [],
                    "prompt_tokens": r.num_input_tokens,
                    "output_tokens": r.num_output_tokens,
                }
            )
        convs.append(turns)
    return {"metadata": {"source": name, "sessions": len(convs), "vocab": vocab}, "conversations": convs}


def export_trace(
    requests: Sequence[Request],
    out: str | os.PathLike[str],
    fmt: str,
    *,
    vocab: int | None = None,
    name: str = "trace",
    decode: Callable[[Sequence[int]], str] | None = None,
) -> Path:
    """Write ``requests`` to ``out`` in ``fmt`` (``custom`` JSONL or ``agentic`` JSON); returns the path.
    ``decode``: token ids -> text (default: the tiny models' word text, see :func:`word_text`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "custom":
        with path.open("w", encoding="utf-8") as f:
            for row in to_custom_rows(requests, vocab=vocab, decode=decode):
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
    else:
        agentic = to_agentic(requests, vocab=vocab, name=name, decode=decode)
        path.write_text(json.dumps(agentic), encoding="utf-8")
    return path


def default_format(requests: Sequence[Request]) -> str:
    """``agentic`` when any session has more than one turn, else ``custom``."""
    return "agentic" if any(r.turn_id > 0 for r in requests) else "custom"

"""Small seeded synthetic traces for development and tests (not the benchmark traces).

Three shapes mimicking the real workloads: ``doc_qa`` (shared system prompt + one of a few long
documents + a question, some follow-up turns), ``system_prompts`` (a few long system prompts,
then short user messages, multi-turn) and ``agent`` (long multi-turn sessions whose context grows
by tool outputs). Token ids are drawn so unrelated text never shares a prefix by accident.
"""

from __future__ import annotations

import numpy as np

from .trace import SimRequest

SHAPES = ("doc_qa", "system_prompts", "agent")


def _text(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(1000, 150_000, size=n))


def synthetic_trace(shape: str, n_requests: int = 300, seed: int = 0, scale: float = 1.0) -> list[SimRequest]:
    """A deterministic synthetic trace of ``n_requests`` requests (``scale`` multiplies lengths)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; valid: {', '.join(SHAPES)}")
    rng = np.random.default_rng(seed)

    def L(lo: int, hi: int) -> int:
        return max(1, int(rng.integers(lo, hi) * scale))

    sys_prompt = _text(rng, L(300, 800))
    out: list[SimRequest] = []
    sessions: list[tuple[str, tuple[int, ...], int]] = []  # (id, context, turn)
    if shape == "doc_qa":
        docs = [_text(rng, L(2000, 8000)) for _ in range(12)]
        pop = rng.zipf(1.5, size=10_000) % len(docs)
    elif shape == "system_prompts":
        docs = [_text(rng, L(1000, 4000)) for _ in range(8)]
        pop = rng.zipf(1.3, size=10_000) % len(docs)
    else:
        docs = [_text(rng, L(1500, 3000)) for _ in range(3)]  # tool schemas
        pop = rng.integers(0, len(docs), size=10_000)
    k = 0
    while len(out) < n_requests:
        cont = sessions and rng.random() < (0.7 if shape == "agent" else 0.35)
        if cont:
            i = int(rng.integers(0, len(sessions)))
            sid, ctx, turn = sessions[i]
            new = _text(rng, L(200, 1500) if shape == "agent" else L(20, 120))
            inp = ctx + new
        else:
            sid, turn = f"s{k}", 0
            k += 1
            doc = docs[int(pop[k % len(pop)])]
            inp = sys_prompt + doc + _text(rng, L(20, 200))
            i = len(sessions)
            sessions.append((sid, (), 0))
        outp = _text(rng, L(30, 300))
        out.append(SimRequest(sid, turn, inp, outp))
        sessions[i] = (sid, inp + outp, turn + 1)
        if len(sessions) > 40:
            sessions.pop(0)
    return out

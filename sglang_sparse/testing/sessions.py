"""Long multi-turn sessions against a running server: the soak workload of the serving tests.

A session is a chain of turns: turn ``k``'s prompt is turn ``k-1``'s prompt + its output + ``user``
new token ids, so a session of ``T`` turns builds a radix-tree chain ``T`` nodes deep. ``sessions``
sessions are interleaved round by round; the turns of one round are sent concurrently. Token ids
are deterministic (seeded). Greedy decoding; outputs are recorded for a token-equality check against
another server (e.g. ``--disable-radix-cache``) on the same prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SessionRun:
    """What a soak run produced: per session, the prompt and output of every turn."""

    prompts: list[list[list[int]]] = field(default_factory=list)  # [session][turn] -> token ids
    outputs: list[list[list[int]]] = field(default_factory=list)
    cached: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def turns(self) -> int:
        return sum(len(p) for p in self.prompts)


def _user_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(4, vocab, size=n).tolist()


def run_sessions(
    generate: Callable[[Sequence[int], int], Any],
    *,
    sessions: int,
    turns: int,
    user: int = 8,
    new: int = 2,
    first: int = 32,
    vocab: int = 4096,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> SessionRun:
    """Run ``sessions`` interleaved sessions of ``turns`` turns (``first`` prompt tokens, then
    ``user`` new tokens + the ``new`` output tokens per turn). ``generate(ids, max_new)`` returns an
    object with ``output_ids`` and ``cached_tokens``. ``progress(k)`` is called after each round."""
    rngs = [np.random.default_rng([seed, s]) for s in range(sessions)]
    run = SessionRun(
        prompts=[[] for _ in range(sessions)],
        outputs=[[] for _ in range(sessions)],
        cached=[[] for _ in range(sessions)],
    )
    prompts = [_user_tokens(rngs[s], first, vocab) for s in range(sessions)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, sessions)) as pool:
        for k in range(turns):
            results = list(pool.map(lambda p: generate(p, new), prompts))
            for s, r in enumerate(results):
                run.prompts[s].append(prompts[s])
                run.outputs[s].append(list(r.output_ids))
                run.cached[s].append(int(r.cached_tokens))
                prompts[s] = prompts[s] + list(r.output_ids) + _user_tokens(rngs[s], user, vocab)
            if progress is not None:
                progress(k + 1)
    run.seconds = time.perf_counter() - t0
    return run


def sample_turns(turns: int, head: int = 8, every: int = 100) -> list[int]:
    """Turn indices to re-check on a reference server: the first ``head``, every ``every``-th, the last."""
    idx = set(range(min(head, turns)))
    idx.update(range(every - 1, turns, every))
    idx.add(turns - 1)
    return sorted(i for i in idx if 0 <= i < turns)


def mismatches(
    run: SessionRun,
    generate: Callable[[Sequence[int], int], Any],
    turns: Sequence[int],
    sessions: Sequence[int],
    new: int = 2,
) -> list[tuple[int, int]]:
    """``(session, turn)`` pairs whose output differs when the same prompt is sent to ``generate``."""
    bad = []
    for s in sessions:
        for k in turns:
            if list(generate(run.prompts[s][k], new).output_ids) != run.outputs[s][k]:
                bad.append((s, k))
    return bad

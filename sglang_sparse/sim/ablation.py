"""What the ``offline`` reference's future knowledge is worth, piece by piece (simulator only).

:class:`KnowledgeAblation` is :class:`~.offline.OfflineCache` with part of the future hidden, so
the gap between an online policy and ``offline`` can be split into what is predictable online and
what is not. Same tree, bytes and budget; only the eviction order (and optionally admission)
changes.

Eviction ``knowledge`` (the rank of a servable state; lowest evicted first):

* ``exact``: ``offline`` itself: no next use first, then ``benefit / (bytes * (next use - now))``.
* ``reuse``: knows *whether* a later request resumes at the state, not *when*: a state nobody
  resumes at again goes first, the others by ``benefit / (bytes * age)``, ``age`` = requests since
  the state was captured or last resumed from (+1): recency stands in for the next use.
* ``superseded``: knows only what the cache's own structure shows: a state that later requests
  pass but resume deeper (a multi-turn session's older turn once the next turn holds a deeper
  state) goes first; everything else by ``benefit / (bytes * age)``. (Online: "a deeper state
  below it on its only chain", the same unless a later request leaves the chain between the two.)
* ``recency``: no future knowledge in eviction: everything by ``benefit / (bytes * age)``.
* ``predicted``: online only: ``superseded`` states first, then ``benefit / (bytes * wait)`` with
  ``wait`` the *predicted* requests until the state's session returns: its last request plus the
  mean gap (requests) between its requests so far (all sessions' mean until it has one gap, 5
  before any), and once overdue ``1 +`` the requests it is overdue by (a session that stops
  coming back ages out). Needs the requests' session ids.

``admission``: ``future`` (``offline``'s: states only at depths later requests resume at) or
``finish`` (also the last-token state of every request, as the online policies capture it, so
admission does not reveal which sequence has no continuation).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_sparse.policy import ModelCostModel

from .future import FutureIndex
from .offline import FINISH, OfflineCache, Served, StateInfo, simulate_offline
from .simulator import Observer
from .trace import SimRequest

KNOWLEDGE = ("exact", "reuse", "superseded", "recency", "predicted")
#: ``predicted``: the gap assumed before any session has returned (requests)
PRIOR_GAP = 5.0
ADMISSION = ("future", "finish")


class KnowledgeAblation(OfflineCache):
    """:class:`OfflineCache` knowing only part of the future (module docstring)."""

    def __init__(
        self,
        future: FutureIndex,
        budget_bytes: int,
        kv_bytes_per_token: int,
        state_bytes: int,
        *,
        grid: int | None = None,
        knowledge: str = "exact",
        admission: str = "future",
        sessions: Sequence[str] | None = None,
    ) -> None:
        if knowledge not in KNOWLEDGE:
            raise ValueError(f"knowledge must be one of {', '.join(KNOWLEDGE)}, got {knowledge!r}")
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION)}, got {admission!r}")
        if knowledge == "predicted" and sessions is None:
            raise ValueError("knowledge='predicted' needs the requests' session ids")
        super().__init__(future, budget_bytes, kv_bytes_per_token, state_bytes, grid=grid)
        self.knowledge, self.admission = knowledge, admission
        self.sessions = sessions
        self._last: dict[str, int] = {}  # session -> its latest request so far
        self._gaps: dict[str, tuple[int, int]] = {}  # session -> (sum of its gaps, count)
        self._all = [0, 0]  # every session's gaps: sum, count

    def serve(self, inp: np.ndarray, full: np.ndarray, observer: Observer | None = None) -> Served:
        if self.sessions is not None:  # arrivals seen so far (online knowledge)
            i, s = self._next, self.sessions[self._next]
            if s in self._last:
                g = i - self._last[s]
                tot, n = self._gaps.get(s, (0, 0))
                self._gaps[s] = (tot + g, n + 1)
                self._all[0] += g
                self._all[1] += 1
            self._last[s] = i
        return super().serve(inp, full, observer)

    def _predicted_wait(self, handle: int, now: int) -> float:
        """Requests until the state's session is predicted back (``predicted``, module docstring)."""
        assert self.sessions is not None
        s = self.sessions[self.info[handle].request]
        tot, n = self._gaps.get(s, (0, 0))
        gap = tot / n if n else (self._all[0] / self._all[1] if self._all[1] else PRIOR_GAP)
        due = self._last[s] + gap - now
        return due if due >= 1 else 2 - due

    def capture_positions(
        self, i: int, full: np.ndarray, input_len: int, resume: int
    ) -> dict[int, StateInfo]:
        out = super().capture_positions(i, full, input_len, resume)
        total = len(full)
        if self.admission == "finish" and total > resume:
            p = total
            if p * self.kvb + self.sb > self.budget_bytes:  # the fit state stands in, as offline's
                p = self._floor(min(self.fit_tokens, total), total)
            if p > resume and p not in out:
                out[p] = StateInfo(self.future.prefix_mask(full, p), i, p, FINISH)
        return out

    def _rank(
        self, handle: int, nxt: int | None, passed: bool, now: int, benefit: int, nbytes: int
    ) -> tuple[int, float]:
        k = self.knowledge
        if k == "exact":
            return super()._rank(handle, nxt, passed, now, benefit, nbytes)
        known_dead = (k == "reuse" and nxt is None) or (
            k in ("superseded", "predicted") and nxt is None and passed
        )
        if known_dead:
            return 1, 0.0
        if k == "predicted":
            return 2, benefit / (nbytes * self._predicted_wait(handle, now))
        age = now - self.last_use.get(handle, self.info[handle].request) + 1
        return 2, benefit / (nbytes * age)


def knowledge_table(
    requests: Sequence[SimRequest],
    sizes: Sequence[int],
    cost: ModelCostModel,
    variants: Sequence[tuple[str, str]] = (
        ("future", "exact"),
        ("future", "reuse"),
        ("finish", "reuse"),
        ("finish", "superseded"),
        ("finish", "recency"),
        ("finish", "predicted"),
    ),
) -> dict[str, list[float]]:
    """Token hit rate of each ``(admission, knowledge)`` variant at each cache size (bytes), keyed
    ``"admission/knowledge"``."""
    future = FutureIndex(requests)
    sessions = [r.session_id for r in requests]
    out: dict[str, list[float]] = {}
    for adm, know in variants:

        def factory(*a: object, adm: str = adm, know: str = know, **kw: object) -> KnowledgeAblation:
            return KnowledgeAblation(*a, knowledge=know, admission=adm, sessions=sessions, **kw)  # type: ignore[arg-type]

        out[f"{adm}/{know}"] = [
            simulate_offline(
                requests, size, cost, future=future, keep_records=False, cache_factory=factory
            ).token_hit_rate
            for size in sizes
        ]
    return out

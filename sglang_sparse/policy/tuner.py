"""Alpha tuner for FLOP-aware eviction (Marconi sec. 4.2).

The tuner replays a bootstrap window of recent requests once per alpha of a grid, in parallel with a
:class:`concurrent.futures.ProcessPoolExecutor`, and keeps the alpha with the best score (FLOPs
saved by default). Ties keep the alpha in use (``current``) when it is on the grid, otherwise they
go to the earlier grid entry: on a window where several alphas evict the same items the replay says
nothing about them, and switching would only lose what the current alpha was chosen for. Results are
collected in grid order (``Executor.map``), so the choice never depends on process completion order.
By default it tunes **once**, on the first window (as Marconi does); with ``retune=True`` it asks to
re-tune whenever the hit rate of a window drifts from the one measured right after the last tuning
(opt-in: docs/sparse_backend.md, ``SGLANG_SPARSE_RETUNE``).

The replay itself is supplied by the caller as a picklable ``evaluate(alpha) -> score`` (the
simulator provides one; an engine adapter can pass the same function over its logged requests), so
the policy layer does not depend on the simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

DEFAULT_ALPHA_GRID: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


class AlphaTuner:
    """Chooses alpha by replay; tracks windowed hit-rate drift. Deterministic."""

    def __init__(
        self,
        grid: Sequence[float] = DEFAULT_ALPHA_GRID,
        *,
        window: int = 200,
        drift: float = 0.05,
        workers: int = 2,
        retune: bool = False,
    ) -> None:
        if not grid or any(a < 0 for a in grid):
            raise ValueError(f"alpha grid must be non-empty and >= 0, got {grid!r}")
        if window < 1 or workers < 1 or drift <= 0:
            raise ValueError("window and workers must be >= 1 and drift > 0")
        self.grid = tuple(float(a) for a in grid)
        self.window, self.drift, self.workers = int(window), float(drift), int(workers)
        self.retune = bool(retune)
        self.reference_hit_rate: float | None = None
        self.history: list[tuple[int, float, tuple[float, ...]]] = []

    def tune(
        self, evaluate: Callable[[float], float], at_request: int = 0, current: float | None = None
    ) -> float:
        """Score every alpha of the grid with ``evaluate`` and return the best (ties: module docstring)."""
        if self.workers == 1 or len(self.grid) == 1:
            scores = [evaluate(a) for a in self.grid]
        else:
            with ProcessPoolExecutor(max_workers=min(self.workers, len(self.grid))) as pool:
                scores = list(pool.map(evaluate, self.grid))
        return self.choose(scores, at_request=at_request, current=current)

    def choose(self, scores: Sequence[float], at_request: int = 0, current: float | None = None) -> float:
        """The decision of :meth:`tune` from the grid's ``scores`` (in grid order) computed elsewhere
        (e.g. a worker process); recorded in :attr:`history`."""
        if len(scores) != len(self.grid):
            raise ValueError(f"{len(scores)} scores for a grid of {len(self.grid)} alphas")
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        if current is not None and float(current) in self.grid:
            i = self.grid.index(float(current))
            if scores[i] >= scores[best]:
                best = i
        self.history.append((at_request, self.grid[best], tuple(float(x) for x in scores)))
        self.reference_hit_rate = None
        return self.grid[best]

    def should_retune(self, window_hit_rate: float) -> bool:
        """True when re-tuning is on and ``window_hit_rate`` moved more than ``drift`` from the first
        window after tuning (always False with ``retune=False``: the first tuning stays)."""
        if not self.retune:
            return False
        if self.reference_hit_rate is None:
            self.reference_hit_rate = window_hit_rate
            return False
        return abs(window_hit_rate - self.reference_hit_rate) > self.drift

"""Where to put recurrent-state checkpoints along a cached prefix (pure math, numpy only).

* :class:`DepthLaw` - an overlap-depth distribution binned onto candidate positions.
* :func:`solve_dp` - the exact O(N·M) placement (monotone convex-hull trick);
  :func:`solve_dp_reference` - the textbook O(N²·M) DP it is tested against.
* Baselines with one interface: :data:`BASELINES` (block, balanced, log, sqrt, last).
* :class:`DepthHistogram` - exponentially weighted depth histogram with a refresh period.
* :func:`evaluate_placement` - expected / worst-case recompute of any checkpoint set.
* :class:`OnlinePlanner` - online targets of one cache entry (own law + global :class:`DepthPrior`
  + uniform hedge, DP, balanced fill); :func:`passed_positions` / :func:`admit` - capture rules.
"""

from .baselines import (
    BASELINES,
    balanced_placement,
    block_budget_placement,
    block_placement,
    last_only_placement,
    log_placement,
    sqrt_placement,
)
from .dp import (
    DEFAULT_GRID,
    HAVE_NATIVE,
    DepthHistogram,
    DepthLaw,
    Placement,
    grid_candidates,
    solve_dp,
    solve_dp_native,
    solve_dp_python,
    solve_dp_reference,
)
from .evaluate import RecomputeStats, evaluate_placement, resume_points
from .online import (
    PRIOR_WEIGHT,
    REL_RESOLUTION,
    DepthPrior,
    OnlinePlanner,
    admit,
    balanced_fill,
    passed_positions,
)

__all__ = [
    "BASELINES",
    "DEFAULT_GRID",
    "HAVE_NATIVE",
    "PRIOR_WEIGHT",
    "REL_RESOLUTION",
    "DepthHistogram",
    "DepthLaw",
    "DepthPrior",
    "OnlinePlanner",
    "Placement",
    "RecomputeStats",
    "admit",
    "balanced_fill",
    "balanced_placement",
    "block_budget_placement",
    "block_placement",
    "evaluate_placement",
    "grid_candidates",
    "last_only_placement",
    "log_placement",
    "passed_positions",
    "resume_points",
    "solve_dp",
    "solve_dp_native",
    "solve_dp_python",
    "solve_dp_reference",
    "sqrt_placement",
]

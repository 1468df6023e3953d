"""Per-process hand-offs of an in-forward capture plan (no SGLang import; the plugin's thin hook
wrappers consult them on every call).

* The *forward plan*: set by the ``ForwardBatch.init_new`` hook for the forward being built (cleared
  by the next ``init_new`` without a plan, or once every GDN layer wrote it). It cannot ride on the
  ForwardBatch: SGLang's eager runner (``EagerRunner.load_batch``) copies the live batch into its
  static buffers, a new object without our attribute. A batch's ``init_new`` is followed by its own
  forward before the next ``init_new``, with or without the overlap schedule: SGLang's overlap loop
  is single-threaded (``run_batch`` builds the ForwardBatch and launches every layer of forward N,
  then processes the result of N-1), so the plan of forward N is never seen by N+1.
* :class:`Active`: layers run one at a time in the scheduler's forward thread, so one slot suffices:
  the conv hook of layer ``L`` sets it, the kernel hook of the same layer consumes it.
* The *decode grid* (``extra_buffer`` only): set once by the backend factory in the scheduler
  process; SGLang's ``mamba_track_grid`` returns it instead of ``lcm(grid, --mamba-track-interval)``
  so decode states can be tracked on the policy's grid (which rows track is the policy's choice).
"""

from __future__ import annotations

from typing import Any


class Active:
    """``layer_id``: GDN layer whose kernel call must capture; ``plan``: its ``CapturePlan``;
    ``n_seq``: sequences (rows) of the forward."""

    layer_id: int | None = None
    plan: Any = None
    n_seq: int = 0


_forward_plan: list[Any] = [None]


def set_forward_plan(plan: Any) -> None:
    _forward_plan[0] = plan


def forward_plan() -> Any:
    return _forward_plan[0]


def active() -> bool:
    return Active.plan is not None


def clear() -> None:
    Active.layer_id, Active.plan, Active.n_seq = None, None, 0


_decode_grid: list[int | None] = [None]


def set_decode_grid(grid: int | None) -> None:
    _decode_grid[0] = None if grid is None else int(grid)


def decode_grid() -> int | None:
    return _decode_grid[0]

"""Per-process hand-offs of an in-forward capture plan (no SGLang import; the plugin's thin hook
wrappers consult them on every call).

* The *forward plan*: set by the ``ForwardBatch.init_new`` hook for the forward being built (cleared
  by the next ``init_new`` without a plan, or once every GDN layer wrote it). It cannot ride on the
  ForwardBatch: SGLang's eager runner (``EagerRunner.load_batch``) copies the live batch into its
  static buffers, a new object without our attribute. No overlap schedule (no_buffer): a batch's
  ``init_new`` is followed by its own forward before the next ``init_new``.
* :class:`Active`: layers run one at a time in the scheduler's forward thread, so one slot suffices:
  the conv hook of layer ``L`` sets it, the kernel hook of the same layer consumes it.
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

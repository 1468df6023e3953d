"""Decode-time state tracks of the ``sparse`` backend on SGLang's ``extra_buffer`` strategy.

SGLang snapshots a decoding request's recurrent state into its ping-pong buffer whenever its length
crosses ``mamba_track_grid`` (``lcm(state grid, --mamba-track-interval)``, 256 tokens by default),
for every request, and at finish inserts the latest snapshot that fits the key. With the sparse
backend the grid is the policy's (the plugin's hook on ``mamba_track_grid``), and after
``ScheduleBatch.prepare_for_decode`` built the per-row masks, :func:`refine_decode_tracks` clears
them for the requests whose plan wants no state past the prompt (no copy is made for them). The
others get a snapshot at every grid point, so their finish state lies within one grid step of the
end instead of one track interval.

Invariant: a row's mask (this step) and next-mask (the step after, read by the overlap scheduler
when it processes a result one step late) are both cleared or both left as SGLang set them, and a
request's choice never changes while it decodes (its plan is fixed at admission), so the result
processor's view of a boundary always matches what the forward did.
"""

from __future__ import annotations

from typing import Any


def refine_decode_tracks(batch: Any) -> int:
    """Clear the decode-track masks of ``batch`` rows whose request wants no decode state; returns
    the number of rows cleared. Cheap: only rows at (or one before) a grid point are looked up."""
    mask = batch.mamba_track_mask_cpu
    if not mask:
        return 0
    nxt = batch.mamba_track_mask_next_cpu
    wants = batch.tree_cache.wants_decode_state
    cleared = 0
    for i, req in enumerate(batch.reqs):
        if (mask[i] or (nxt is not None and nxt[i])) and not wants(req.rid):
            if mask[i]:
                mask[i] = False
                cleared += 1
            if nxt is not None:
                nxt[i] = False
    if cleared:
        import torch

        batch.mamba_track_mask = torch.tensor(mask, dtype=torch.bool).to(batch.device, non_blocking=True)
    return cleared

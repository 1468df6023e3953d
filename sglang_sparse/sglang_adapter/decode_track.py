"""Decode-time state tracks of the ``sparse`` backend on SGLang's ``extra_buffer`` strategy.

SGLang snapshots a decoding request's recurrent state into its ping-pong buffer whenever its length
crosses ``mamba_track_grid`` (``lcm(state grid, --mamba-track-interval)``, 256 tokens by default),
for every request, and at finish inserts the latest snapshot that fits the key. With the sparse
backend the grid is the policy's (the plugin's hook on ``mamba_track_grid``), and after
``ScheduleBatch.prepare_for_decode`` built the per-row masks, :func:`refine_decode_tracks`

* clears them for the requests whose plan wants no state past the prompt (no copy is made);
* for the others keeps every grid point, and for those whose plan holds a *normal* (not probation)
  state past the prompt (a session's next turn is expected: ``TreePolicy.wants_exact_finish``)
  adds one **exact finish track**: the step whose state covers ``final_track_depth`` tokens, the
  deepest page-aligned depth of the key SGLang inserts when the request finishes at
  ``max_new_tokens`` (``prompt + max_new_tokens - 1``: the last sampled token is never fed). A
  request that runs to its length (every benchmark client's default, ``ignore_eos``) then leaves
  the state at the end of its key instead of up to one grid step (64 tokens) below it, so the next
  turn of a conversation resumes where this one ended. One state copy per request, in the forward
  SGLang runs anyway. A request that stops earlier (EOS, stop string, abort) never reaches that
  step and finishes on its last grid point, as before. A request whose only state past the prompt
  is the unplanned last token (on probation) gets no exact copy: its grid finish is often dominated
  by a prompt state and not inserted at all, while an exact one would be, and under pool pressure
  it would push out other requests' first-sight states (``test_interleaved_groups.py``).

Off-grid tracks reuse SGLang's ping-pong bookkeeping unchanged (the result processor names the
snapshot ``mamba_last_track_seqlen = kv_committed_len - lookahead`` from the mask); the one place
that assumes grid alignment, the assertion in ``_mamba_prefix_cache_update``'s known-boundary
branch, is bypassed for off-grid depths by :func:`prefix_cache_update_hook`, which performs the
same slot flip.

Invariant: a row's mask (this step) and next-mask (the step after, read by the overlap scheduler
when it processes a result one step late) agree: the next-mask at depth ``d - 1`` is set exactly
when the mask at ``d`` will be, and a request's choice never changes while it decodes (its plan and
``max_new_tokens`` are fixed at admission), so the result processor's view of a boundary always
matches what the forward did.
"""

from __future__ import annotations

from typing import Any

from . import capture_state


def final_track_depth(input_len: int, max_new_tokens: int | None, page_size: int) -> int | None:
    """Depth (tokens) of the exact finish state of a request that runs to ``max_new_tokens``: the
    key SGLang inserts at finish (prompt + output - 1 tokens; the last sampled token is never
    fed), page-aligned down; ``None`` without a length limit (no depth to track)."""
    if not max_new_tokens:
        return None
    return (int(input_len) + int(max_new_tokens) - 1) // page_size * page_size


def refine_decode_tracks(batch: Any) -> int:
    """Adjust the decode-track masks of ``batch`` (see the module docstring); returns the number of
    rows whose mask changed. Cost per row: one dict lookup (finish depths are computed at planning,
    ``cache.finish_tracks``); the policy is asked only about rows at (or one before) a grid point."""
    mask = batch.mamba_track_mask_cpu
    if not mask:
        return 0
    nxt = batch.mamba_track_mask_next_cpu
    cache = batch.tree_cache
    wants = cache.wants_decode_state
    finals = cache.finish_tracks
    seq_lens = batch.seq_lens_cpu.tolist() if finals else None
    changed = 0
    for i, req in enumerate(batch.reqs):
        final = finals.get(req.rid) if finals else None
        at_final = final is not None and seq_lens[i] == final
        before_final = final is not None and nxt is not None and seq_lens[i] == final - 1
        grid_row = mask[i] or (nxt is not None and nxt[i])
        if not (grid_row or at_final or before_final):
            continue
        if grid_row and not wants(req.rid):
            if mask[i]:
                mask[i] = False
                changed += 1
            if nxt is not None:
                nxt[i] = False
        if at_final or before_final:  # a finish track implies wants(): nothing was cleared
            if at_final and not mask[i]:
                mask[i] = True
                changed += 1
            if before_final:
                nxt[i] = True
    if changed:
        import torch

        batch.mamba_track_mask = torch.tensor(mask, dtype=torch.bool).to(batch.device, non_blocking=True)
    return changed


def prefix_cache_update_hook(original, self, req, batch, result, i, known_boundary: bool = False):
    """AROUND ``SchedulerBatchResultProcessor._mamba_prefix_cache_update``: for a known boundary off
    SGLang's track grid (only an exact finish track is; the sparse backend is the only one that sets
    such a mask) flip the ping-pong slot the next track writes, as SGLang's non-lazy branch does,
    without its grid assertion. Everything else is SGLang's own code."""
    grid = capture_state.decode_grid()  # what SGLang's mamba_track_grid returns in this process
    if (
        known_boundary
        and grid
        and getattr(self.tree_cache, "decode_tracking", False)
        and req.kv.mamba_ping_pong_track_buffer is not None
        and req.kv.kv_committed_len % grid
    ):
        pool = batch.req_to_token_pool
        req.kv.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(req.kv.mamba_next_track_idx)
        return None
    return original(self, req, batch, result, i, known_boundary=known_boundary)

"""Torch versions of SGLang's Mamba decode-state tracking copies (extra_buffer strategy).

SGLang 0.5.23's ``HybridLinearAttnBackend._track_mamba_state_decode``
(``srt/layers/attention/hybrid_linear_attn_backend.py``) snapshots the running conv/SSM state of a
decoding request into its track slot whenever ``seq_len % mamba_track_interval == 0``, through
``track_mamba_states_if_needed`` / ``track_mamba_states_all_layers`` from
``sglang/kernels/ops/mamba/mamba_state_scatter_triton.py``: Triton kernels with no CPU backend.
These functions do the same row copies with torch indexing and keep the Triton signatures, so they
can replace the names the backend module imported.

Semantics (both): for every batch row ``i < batch_size`` with ``mamba_track_mask[i]`` set, copy the
state rows ``cache_indices[i] -> mamba_track_indices[i]`` of the conv and the SSM pool; with
``check_freed_slots``, rows whose source or destination is negative (freed) are skipped. Sources
are read before any destination is written (a gather, then a scatter), like the Triton kernel when
no destination is also a source, which SGLang guarantees (track slots are never working slots).
"""

from __future__ import annotations

import torch


def _tracked_rows(
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` int64 slot ids of the rows to copy (possibly empty)."""
    rows = mamba_track_mask[:batch_size].nonzero().squeeze(1)
    src = cache_indices[rows].to(torch.long)
    dst = mamba_track_indices[rows].to(torch.long)
    if check_freed_slots:
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    return src, dst


def track_mamba_states_if_needed(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    """One layer: ``conv_states [S, ...]``, ``ssm_states [S, ...]`` (slot-major), updated in place."""
    if batch_size == 0:
        return
    src, dst = _tracked_rows(
        cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots
    )
    if src.numel():
        conv_states[dst] = conv_states[src]
        ssm_states[dst] = ssm_states[src]


def track_mamba_states_all_layers(
    conv_states_pool: torch.Tensor,
    ssm_states_pool: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    """All layers at once: ``conv_states_pool [L, S, ...]``, ``ssm_states_pool [L, S, ...]``."""
    if batch_size == 0:
        return
    src, dst = _tracked_rows(
        cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots
    )
    if src.numel():
        conv_states_pool[:, dst] = conv_states_pool[:, src]
        ssm_states_pool[:, dst] = ssm_states_pool[:, src]

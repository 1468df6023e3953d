"""Causal depthwise conv1d over packed variable-length sequences, with a slot-indexed state pool.

Notation: ``D`` channels, ``W`` kernel width, ``T`` packed tokens, ``B`` sequences, ``S`` pool slots.
The conv state of a sequence is its last ``W - 1`` inputs (oldest first), ``[D, W - 1]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(y: torch.Tensor, silu: bool) -> torch.Tensor:
    return F.silu(y) if silu else y


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu_activation: bool,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Prefill conv: ``out[:, t] = act(bias + sum_j weight[:, j] * xpad[:, t + j])``.

    Args:
        x: ``[D, T]`` packed inputs (may be a transposed, non-contiguous view of ``[T, D]``).
        weight: ``[D, W]``; bias: ``[D]`` or None.
        conv_states: ``[S, D, W - 1]`` pool, updated in place: slot ``cache_indices[b]`` receives the
            last ``W - 1`` inputs of sequence ``b`` (reaching into its initial state if it is short).
        query_start_loc: ``[B + 1]`` cumulative token offsets (None: one sequence of length ``T``).
        cache_indices: ``[B]`` pool slots (None: ``arange(B)``); ``pad_slot_id`` entries are skipped.
        has_initial_state: ``[B]`` bool; when False the sequence starts from zeros, not the pool.
        silu_activation: apply SiLU.

    Returns:
        ``[D, T]`` outputs in ``x.dtype`` (padding-slot sequences are left at zero).
    """
    dim, total = x.shape
    width = weight.shape[1]
    state_len = width - 1
    starts = [0, total] if query_start_loc is None else [int(v) for v in query_start_loc.tolist()]
    n_seq = len(starts) - 1
    slots = list(range(n_seq)) if cache_indices is None else [int(v) for v in cache_indices.tolist()]
    has_init = [False] * n_seq if has_initial_state is None else [bool(v) for v in has_initial_state.tolist()]
    compute_dtype = weight.dtype if weight.dtype != torch.bfloat16 else torch.float32
    w = weight.to(compute_dtype).unsqueeze(1)  # [D, 1, W] for a grouped conv
    b = None if bias is None else bias.to(compute_dtype)
    out = torch.zeros(dim, total, dtype=x.dtype, device=x.device)
    for i in range(n_seq):
        lo, hi = starts[i], starts[i + 1]
        slot = slots[i]
        if hi <= lo or slot == pad_slot_id:
            continue
        seq = x[:, lo:hi].to(compute_dtype)
        if conv_states is not None and has_init[i]:
            init = conv_states[slot].to(compute_dtype)
        else:
            init = seq.new_zeros(dim, state_len)
        padded = torch.cat([init, seq], dim=1)  # [D, W - 1 + L]
        y = F.conv1d(padded.unsqueeze(0), w, b, groups=dim).squeeze(0)  # [D, L]
        out[:, lo:hi] = _activate(y, silu_activation).to(x.dtype)
        if conv_states is not None and state_len > 0:
            conv_states[slot] = padded[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_activation: bool,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Decode conv: append ``L`` new inputs per sequence to its state window and convolve.

    Args:
        x: ``[B, D]`` (one token each) or ``[B, D, L]`` (``L`` consecutive tokens each).
        conv_state: ``[S, D, W - 1]`` pool (or ``[B, D, W - 1]`` when ``conv_state_indices`` is None),
            updated in place with the last ``W - 1`` inputs of each sequence.
        weight: ``[D, W]``; bias: ``[D]`` or None.
        conv_state_indices: ``[B]`` pool slots; ``pad_slot_id`` rows are skipped (output zero).
        cache_seqlens: circular-buffer positions; not supported (must be None).

    Returns:
        Same shape and dtype as ``x``.
    """
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update (CPU shim): circular conv state not supported")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x  # [B, D, L]
    n, dim, steps = xs.shape
    state_len = weight.shape[1] - 1
    compute_dtype = weight.dtype if weight.dtype != torch.bfloat16 else torch.float32
    if conv_state_indices is None:
        idx = torch.arange(n, device=x.device)
    else:
        idx = conv_state_indices.to(torch.long)
    valid = idx != pad_slot_id
    out = torch.zeros(n, dim, steps, dtype=x.dtype, device=x.device)
    if not bool(valid.any()):
        return out.squeeze(-1) if squeeze else out
    vidx = idx[valid]
    window = torch.cat([conv_state[vidx].to(compute_dtype), xs[valid].to(compute_dtype)], dim=-1)
    y = F.conv1d(
        window,
        weight.to(compute_dtype).unsqueeze(1),
        None if bias is None else bias.to(compute_dtype),
        groups=dim,
    )  # [b, D, L]
    out[valid] = _activate(y, silu_activation).to(x.dtype)
    if state_len > 0:
        conv_state[vidx] = window[..., -state_len:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out

"""Token-by-token reference for the gated delta rule (GatedDeltaNet) with state capture.

Conventions (identical to ``fla.ops.gated_delta_rule``, Qwen3-Next):

* ``q, k``: ``[B, T, H, K]``; ``v``: ``[B, T, HV, V]``; ``g, beta``: ``[B, T, HV]``.
  ``HV`` is a multiple of ``H`` (grouped value attention, GVA): value head ``j`` reads query/key head
  ``j // (HV // H)``.
* ``g`` is the per-token decay **in natural-log space** (``alpha_t = exp(g_t)``, usually ``g_t <= 0``).
* The state of one value head is ``S in R^{K x V}`` (FLA's key-first layout), so states are stored as
  ``[N, HV, K, V]`` float32, ``N`` = number of sequences.
* Per token ``t`` (all in float32)::

      S   = exp(g_t) * S
      S   = S + beta_t * k_t (v_t - S^T k_t)^T        # delta rule, uses the already-decayed S
      o_t = scale * S^T q_t                            # scale defaults to K ** -0.5

* Optional ``use_qk_l2norm`` normalises ``q`` and ``k`` over the last dim first, as FLA's
  ``use_qk_l2norm_in_kernel`` does (``x / sqrt(sum(x^2) + 1e-6)``).

Capture: ``capture_positions`` are token counts ``p`` (``0 <= p <= T_n``, strictly increasing); the
captured state for ``p`` is ``S`` after the first ``p`` tokens of the sequence (``p = 0`` is the
initial state, ``p = T_n`` the final state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .chunk_torch import (
    CaptureSpec,
    check_inputs,
    l2norm,
    normalize_capture,
    seq_bounds,
)

__all__ = ["naive_recurrent_gdn"]


def naive_recurrent_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    capture_positions: CaptureSpec | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    """Recurrent (one token at a time) gated-delta-rule forward that also returns intermediate states.

    Args:
        q, k: ``[B, T, H, K]`` queries / keys.
        v: ``[B, T, HV, V]`` values, ``HV % H == 0``.
        g: ``[B, T, HV]`` log-space decay (natural log).
        beta: ``[B, T, HV]`` delta-rule step sizes.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` state before the first token of each sequence (zeros if None).
        capture_positions: token counts at which to snapshot the state, either one strictly increasing
            sequence shared by all sequences, or (with ``N`` sequences) a list of ``N`` such sequences.
        cu_seqlens: optional ``[N + 1]`` cumulative lengths for variable-length packing (then ``B == 1``
            and sequence ``n`` is ``[:, cu[n]:cu[n+1]]``).
        use_qk_l2norm: l2-normalise ``q`` and ``k`` before use.

    Returns:
        ``(o, final_state, captured)``: ``o`` is ``[B, T, HV, V]`` in ``q.dtype``; ``final_state`` is
        ``[N, HV, K, V]`` float32; ``captured`` is ``[N, P, HV, K, V]`` float32 for a shared list of
        ``P`` positions, or a list of ``N`` tensors ``[P_n, HV, K, V]`` for per-sequence lists.
    """
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    bounds = seq_bounds(B, T, cu_seqlens)
    N = len(bounds)
    lengths = [end - start for _, start, end in bounds]
    positions, shared = normalize_capture(capture_positions, lengths, unit=1, name="capture_positions")
    if scale is None:
        scale = K**-0.5
    G = HV // H

    qf, kf, vf, gf, bf = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    o = torch.zeros(B, T, HV, V, dtype=torch.float32, device=q.device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    captured: list[torch.Tensor] = []

    for n, (b, start, end) in enumerate(bounds):
        if initial_state is None:
            S = torch.zeros(HV, K, V, dtype=torch.float32, device=q.device)
        else:
            S = initial_state[n].float().clone()
        want = positions[n]
        snaps: list[torch.Tensor] = []
        wi = 0
        for t in range(start, end + 1):
            p = t - start
            while wi < len(want) and want[wi] == p:
                snaps.append(S.clone())
                wi += 1
            if t == end:
                break
            q_t = qf[b, t].repeat_interleave(G, dim=0)  # [HV, K]
            k_t = kf[b, t].repeat_interleave(G, dim=0)  # [HV, K]
            S = S * gf[b, t].exp()[:, None, None]
            pred = torch.einsum("hkv,hk->hv", S, k_t)  # S^T k
            delta = bf[b, t][:, None] * (vf[b, t] - pred)  # [HV, V]
            S = S + k_t[:, :, None] * delta[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q_t)
        final[n] = S
        empty = torch.empty(0, HV, K, V, dtype=torch.float32, device=q.device)
        captured.append(torch.stack(snaps) if snaps else empty)

    states: torch.Tensor | list[torch.Tensor] = torch.stack(captured) if shared else captured
    return o.to(q.dtype), final, states

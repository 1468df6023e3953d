"""fp64 token-by-token GatedDeltaNet reference with states at chosen positions (test-only).

Same convention as SGLang's GDN kernels and the project's CPU stand-in: ``q, k: [T, H, K]``,
``v: [T, HV, V]``, ``g`` (natural-log decay), ``beta: [T, HV]``; value head ``j`` reads qk head
``j // (HV // H)``; ``q, k`` L2-normalised (``x / sqrt(sum x^2 + 1e-6)``); states in the pool's
V-first layout ``[HV, V, K]``. Per token: ``S = e^g S; S += beta (v - S k) k^T``.
"""

from __future__ import annotations

import torch


def gdn_states_fp64(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    positions: list[int],
) -> dict[int, torch.Tensor]:
    """``{p: state after the first p tokens}`` (fp64, ``[HV, V, K]``) of one sequence from
    ``initial`` (``[HV, V, K]``); ``0 <= p <= T``."""
    kd = k.double()
    kd = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    hv = v.shape[-2]
    rep = hv // kd.shape[-2]
    kd = kd.repeat_interleave(rep, dim=-2)  # [T, HV, K]
    vd, gd, bd = v.double(), g.double(), beta.double()
    s = initial.double().clone()
    want = set(positions)
    out = {0: s.clone()} if 0 in want else {}
    for t in range(k.shape[0]):
        s = s * torch.exp(gd[t])[:, None, None]
        kv = (s @ kd[t].unsqueeze(-1)).squeeze(-1)  # [HV, V]
        u = bd[t][:, None] * (vd[t] - kv)
        s = s + u.unsqueeze(-1) * kd[t].unsqueeze(-2)
        if t + 1 in want:
            out[t + 1] = s.clone()
    return out

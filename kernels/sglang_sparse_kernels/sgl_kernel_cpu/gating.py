"""GatedDeltaNet gates: log-space decay ``g`` and write strength ``beta``.

``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus with ``beta``/``threshold`` as in torch) and
``beta = sigmoid(b)``; computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gates(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise gates for ``a, b: [..., HV]`` with per-head ``A_log, dt_bias: [HV]``.

    Returns ``(g, beta)`` in fp32 with the shape of ``a``; ``beta`` is rounded through ``b.dtype``
    (as the fused GPU kernel stores it) before widening to fp32.
    """
    x = a.float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    beta = torch.sigmoid(b.float()).to(b.dtype).float()
    return g, beta


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_gdn_gating_cpu``: ``a, b: [T, HV]`` -> ``(g, beta)``, each ``[1, T, HV]`` fp32."""
    g, beta = gdn_gates(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.unsqueeze(0)

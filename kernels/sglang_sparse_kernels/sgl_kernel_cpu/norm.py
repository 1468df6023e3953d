"""Gated RMSNorm (Qwen3-Next / Qwen3.5 GDN output norm) and Gemma-style RMSNorm.

``fused_rmsnorm_gated(x, w, z) = (x * rsqrt(mean(x^2) + eps)) * w * silu(z)``, normalising over the
last dim in fp32 and rounding the normalised value to ``x.dtype`` before the weight, as HF does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_rmsnorm_gated(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x, gate: [N, D]``, ``weight: [D]`` -> ``[N, D]`` in ``x.dtype``."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * normed
    y = y.float() * F.silu(gate.float())
    return y.to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Plain RMSNorm ``x * rsqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim.

    ``offset=1.0`` gives the Gemma / Qwen3-Next ``(1 + w)`` variant.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(x.dtype)

"""Small fused ops SGLang 0.5.23 calls unconditionally on the CPU for Qwen3.5 (``qwen3_5.py``).

* ``fused_qkvzba_split_reshape_cat_contiguous``: split the contiguous GDN input projections
  ``qkvz = [q | k | v | z]``, ``ba = [b | a]`` (per token) into ``mixed_qkv = [q | k | v]``,
  ``z [T, HV, V]``, ``b, a [T, HV]``.
* ``fused_qk_gemma_rmsnorm(_with_gate)``: per-head Gemma RMSNorm (``x * rsqrt(mean x^2 + eps) * (1 + w)``,
  fp32) of the attention queries and keys; the gated variant first splits each query head's
  ``[q | gate]`` pair.
* ``fused_sigmoid_mul``: ``x *= sigmoid(gate)`` in place (attention output gate).
"""

from __future__ import annotations

import torch

from .norm import rmsnorm


def fused_qkvzba_split_reshape_cat_contiguous(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mixed_qkvz: [T, 2*Hq*Dq + 2*Hv*Dv]``, ``mixed_ba: [T, 2*Hv]`` -> (qkv, z, b, a)."""
    qk = num_heads_qk * head_qk
    vd = num_heads_v * head_v
    t = mixed_qkvz.shape[0]
    mixed_qkv = mixed_qkvz[:, : 2 * qk + vd].contiguous()
    z = mixed_qkvz[:, 2 * qk + vd : 2 * qk + 2 * vd].reshape(t, num_heads_v, head_v).contiguous()
    b = mixed_ba[:, :num_heads_v].contiguous()
    a = mixed_ba[:, num_heads_v : 2 * num_heads_v].contiguous()
    return mixed_qkv, z, b, a


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q: [T, Hq*D]``, ``k: [T, Hk*D]`` -> per-head normalised ``([T*Hq, D], [T*Hk, D])``."""
    qn = rmsnorm(q.reshape(-1, head_dim), q_weight, eps, offset=1.0)
    kn = rmsnorm(k.reshape(-1, head_dim), k_weight, eps, offset=1.0)
    return qn, kn


def fused_qk_gemma_rmsnorm_with_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q_gate: [T, Hq*2*D]`` (per head ``[q | gate]``), ``k: [T, Hk*D]`` ->
    ``(q [T*Hq, D] normalised, k [T*Hk, D] normalised, gate [T, Hq*D])``."""
    t = q_gate.shape[0]
    pairs = q_gate.reshape(t, num_heads, 2 * head_dim)
    q = pairs[..., :head_dim].reshape(-1, head_dim)
    gate = pairs[..., head_dim:].reshape(t, num_heads * head_dim).contiguous()
    qn = rmsnorm(q, q_weight, eps, offset=1.0)
    kn = rmsnorm(k.reshape(-1, head_dim), k_weight, eps, offset=1.0)
    return qn, kn, gate


def fused_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    """``x *= sigmoid(gate)`` in place (``gate`` broadcast to ``x``), computed in fp32."""
    x.copy_((x.float() * torch.sigmoid(gate.float())).to(x.dtype))

"""Registers the pure-torch ops as ``torch.ops.sgl_kernel.*`` (CPU dispatch key) via ``torch.library``.

SGLang calls some CPU kernels through ``torch.ops.sgl_kernel.<name>`` (with positional or keyword
arguments, so the schema argument names below follow SGLang's call sites) and others as Python
functions from ``sgl_kernel`` / ``sgl_kernel.mamba``; the shim package provides the latter and calls
:func:`register` for the former. Registration is idempotent and never replaces an op that already
exists (e.g. from a real ``sgl_kernel``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import conv, delta_rule, gating, norm, qwen3_5_ops

NAMESPACE = "sgl_kernel"

# name -> (schema without the name, implementation)
_OPS: dict[str, tuple[str, Callable[..., object]]] = {
    "causal_conv1d_fwd_cpu": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, Tensor? query_start_loc, "
        "Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation, int pad_slot_id, "
        "bool is_vnni=False) -> Tensor",
        lambda x, weight, bias, conv_states, qsl, ci, his, silu, pad, is_vnni=False: conv.causal_conv1d_fwd(
            x, weight, bias, conv_states, qsl, ci, his, silu, pad
        ),
    ),
    "causal_conv1d_update_cpu": (
        "(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, bool silu_activation, "
        "Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, bool is_vnni=False) -> Tensor",
        lambda x, cs, weight, bias, silu, seqlens, idx, pad, is_vnni=False: conv.causal_conv1d_update(
            x, cs, weight, bias, silu, seqlens, idx, pad
        ),
    ),
    "fused_gdn_gating_cpu": (
        "(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
        gating.fused_gdn_gating,
    ),
    "chunk_gated_delta_rule_cpu": (
        "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!)? initial_state, "
        "bool output_final_state, Tensor? cu_seqlens, bool head_first, bool use_qk_l2norm_in_kernel, "
        "Tensor? initial_state_indices=None) -> (Tensor, Tensor)",
        lambda *args, **kw: _chunk_op(*args, **kw),
    ),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
        "Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor? cu_seqlens, "
        "bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor",
        delta_rule.fused_sigmoid_gating_delta_rule_update,
    ),
    # Qwen3.5 (called unconditionally on the CPU by sglang/srt/models/qwen3_5.py)
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
        qwen3_5_ops.fused_qkvzba_split_reshape_cat_contiguous,
    ),
    "fused_qk_gemma_rmsnorm_cpu": (
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
        qwen3_5_ops.fused_qk_gemma_rmsnorm,
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_heads)"
        " -> (Tensor, Tensor, Tensor)",
        qwen3_5_ops.fused_qk_gemma_rmsnorm_with_gate,
    ),
    "fused_sigmoid_mul_cpu": (
        "(Tensor(a!) x, Tensor gate) -> ()",
        qwen3_5_ops.fused_sigmoid_mul,
    ),
    "fused_rmsnorm_gated_cpu": (
        "(Tensor x, Tensor weight, Tensor g, float eps) -> Tensor",
        norm.fused_rmsnorm_gated,
    ),
}


def _chunk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    head_first: bool,
    use_qk_l2norm_in_kernel: bool,
    initial_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = delta_rule.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        True,
        cu_seqlens,
        head_first,
        use_qk_l2norm_in_kernel,
        initial_state_indices,
    )
    assert final is not None
    return o, final


_LIB: torch.library.Library | None = None


def _has_op(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> list[str]:
    """Define and implement every op not yet present; returns the names registered by this call."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    added = []
    for name, (schema, fn) in _OPS.items():
        if _has_op(name):
            continue
        _LIB.define(name + schema)
        _LIB.impl(name, fn, "CPU")
        added.append(name)
    return added


def op_names() -> list[str]:
    """Names of the ops this module provides under ``torch.ops.sgl_kernel``."""
    return list(_OPS)

"""``sgl_kernel.mamba`` as SGLang 0.5.23's GDN backend calls it on the CPU (pure-torch shim).

Signatures follow SGLang's call sites in ``srt/layers/attention/linear/gdn_backend.py`` and
``.../kernels/gdn_triton.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang_sparse_kernels.sgl_kernel_cpu import conv, delta_rule


def causal_conv1d_fn_cpu(
    mixed_qkv_transposed: torch.Tensor,
    conv_weights: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    conv_states: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    seq_lens_cpu: Any = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill conv on ``[D, T]`` packed input; updates ``conv_states [S, D, W-1]`` in place."""
    if block_table is not None:
        raise NotImplementedError("sgl_kernel CPU shim: conv block tables are not supported")
    return conv.causal_conv1d_fwd(
        mixed_qkv_transposed,
        conv_weights,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        activation in ("silu", "swish"),
        -1,
    )


def causal_conv1d_update_cpu(
    mixed_qkv: torch.Tensor,
    conv_states: torch.Tensor,
    conv_weights: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    conv_state_indices: torch.Tensor | None,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode conv on ``[B, D]`` (or ``[B, D, L]``); speculative verify is not supported."""
    if intermediate_conv_window is not None:
        raise NotImplementedError("sgl_kernel CPU shim: speculative target-verify conv is not supported")
    return conv.causal_conv1d_update(
        mixed_qkv,
        conv_states,
        conv_weights,
        bias,
        activation in ("silu", "swish"),
        None,
        conv_state_indices,
        -1,
    )


def chunk_gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Prefill delta rule; returns ``(o, final_states, h)`` like SGLang's Triton kernel, ``h`` the
    per-chunk states SGLang's prefill track copies index (layout and row convention:
    :func:`sglang_sparse_kernels.sgl_kernel_cpu.delta_rule.chunk_gated_delta_rule`)."""
    return delta_rule.chunk_gated_delta_rule(
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
        scale=scale,
    )


def fused_recurrent_gated_delta_rule_update_cpu(**kwargs: Any) -> torch.Tensor:
    """SGLang's ``fused_recurrent_gated_delta_rule_update`` (keyword arguments) on the CPU; the
    speculative-decoding arguments are not supported."""
    for extra in ("intermediate_states_buffer", "intermediate_state_indices", "retrieve_parent_token"):
        if kwargs.pop(extra, None) is not None:
            raise NotImplementedError(f"sgl_kernel CPU shim: {extra} is not supported")
    kwargs.pop("cache_steps", None)
    return delta_rule.fused_recurrent_gated_delta_rule_update(**kwargs)


def fused_sigmoid_gating_delta_rule_update_cpu(**kwargs: Any) -> torch.Tensor:
    """Keyword-only wrapper of ``delta_rule.fused_sigmoid_gating_delta_rule_update``."""
    if kwargs.get("intermediate_states_buffer") is not None:
        raise NotImplementedError("sgl_kernel CPU shim: speculative target-verify is not supported")
    for extra in (
        "is_kda",
        "disable_state_update",
        "intermediate_states_buffer",
        "intermediate_state_indices",
        "cache_steps",
        "retrieve_parent_token",
    ):
        kwargs.pop(extra, None)
    return delta_rule.fused_sigmoid_gating_delta_rule_update(**kwargs)

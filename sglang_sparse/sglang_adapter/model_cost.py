"""The served model's FLOP formulas' inputs, read from SGLang's own config object of the model.

SGLang parses ``config.json`` into its config classes (``sglang.srt.configs``: ``Qwen3NextConfig``,
``Qwen3_5Config`` / ``Qwen3_5TextConfig``, ``NemotronHConfig``, ``FalconH1Config``,
``GraniteMoeHybridConfig``) and builds the model from them, so the layer layout read here is the one
it runs: ``full_attention_layer_ids`` next to ``linear_layer_ids`` (GatedDeltaNet) or
``mamba_layer_ids`` (Mamba2); Falcon-H1's lists both hold every layer (a parallel hybrid: see
:mod:`sglang_sparse.policy.cost_model`). The one fact a config object does not hold is whether an
architecture's MLPs are mixture-of-experts: that is the model class's, in :data:`ARCHITECTURES`.
FLOP-neutral scalars (Falcon-H1's muP ``*_multiplier`` fields, Granite's ``embedding_multiplier`` /
``residual_multiplier`` / ``attention_multiplier``) are not read. Bytes are not read here: the
policy's are SGLang's pools' (see :func:`~sglang_sparse.sglang_adapter.plugin.engine_state_bytes`),
so the cost model's dtype fields keep their defaults and only its FLOPs are used.
"""

from __future__ import annotations

from typing import Any

from sglang_sparse.policy.cost_model import (
    NEMOTRON_H_LAYER_KINDS,
    AttentionSpec,
    GatedDeltaNetSpec,
    Mamba2Spec,
    MLPSpec,
    ModelCostModel,
)

#: MLP block of each supported architecture (HF ``architectures[0]``): ``moe`` (Qwen3-Next's rule:
#: a routed-experts block unless the layer is in ``mlp_only_layers``, off the
#: ``decoder_sparse_step`` or ``num_experts`` is 0; else a SwiGLU of ``intermediate_size``),
#: ``dense`` (a SwiGLU of ``intermediate_size`` in every layer), ``pattern`` (Nemotron-H: the
#: ``hybrid_override_pattern``'s ``-`` is a relu2 MLP, ``E`` relu2 experts, each its own layer),
#: ``parallel`` (Falcon-H1: every layer attention + Mamba2 side by side, then a SwiGLU of
#: ``intermediate_size``), ``granite`` (Granite-4.0-H: ``layer_types``' ``mamba`` / ``attention``
#: mixer, then in every layer SwiGLU experts of ``intermediate_size`` when ``num_local_experts`` > 0
#: plus a shared SwiGLU of ``shared_intermediate_size`` when it is not 0)
ARCHITECTURES: dict[str, str] = {
    "Qwen3NextForCausalLM": "moe",
    "Qwen3_5ForCausalLM": "dense",
    "Qwen3_5ForConditionalGeneration": "dense",
    "Qwen3_5MoeForCausalLM": "moe",
    "Qwen3_5MoeForConditionalGeneration": "moe",
    "NemotronHForCausalLM": "pattern",
    "FalconH1ForCausalLM": "parallel",
    "GraniteMoeHybridForCausalLM": "granite",
}


def model_cost(hf_config: Any) -> ModelCostModel:
    """The cost model of the model SGLang serves (``model_config.hf_config``). Raises ValueError naming
    the architecture when it is not in :data:`ARCHITECTURES`."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"no cost model for architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kind = ARCHITECTURES[arch]
    if kind == "pattern":
        return _nemotron_h(cfg)
    if kind == "parallel":
        return _falcon_h1(cfg)
    if kind == "granite":
        return _granite_h(cfg)
    return _qwen_gdn(cfg, moe=kind == "moe")


def _attention(
    cfg: Any, n_layers: int, *, output_gate: bool, head_dim: int | None = None
) -> AttentionSpec | None:
    """``n_layers`` attention blocks; ``head_dim`` defaults to the config's, else ``hidden / heads``."""
    if not n_layers:
        return None
    heads = cfg.num_attention_heads
    head_dim = head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionSpec(n_layers, heads, cfg.num_key_value_heads, head_dim, output_gate=output_gate)


def _mamba2(cfg: Any, n_layers: int) -> Mamba2Spec | None:
    """``n_layers`` Mamba2 mixers from the ``mamba_*`` fields Falcon-H1 and Granite-4.0-H share
    (their configs check ``mamba_n_heads * mamba_d_head`` == the mixer's inner size)."""
    if not n_layers:
        return None
    return Mamba2Spec(
        n_layers, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_d_conv
    )


def _qwen_gdn(cfg: Any, *, moe: bool) -> ModelCostModel:
    n = cfg.num_hidden_layers
    attn, rec = set(cfg.full_attention_layer_ids), cfg.linear_layer_ids
    recurrent = None
    if rec:
        recurrent = GatedDeltaNetSpec(
            len(rec),
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        )
    experts = cfg.num_experts if moe else 0
    mlp_only, step = set(getattr(cfg, "mlp_only_layers", None) or ()), cfg.decoder_sparse_step
    n_moe = sum(1 for i in range(n) if experts > 0 and i not in mlp_only and (i + 1) % step == 0)
    mlps = []
    if n - n_moe:
        mlps.append(MLPSpec(n - n_moe, gated=True, intermediate_size=cfg.intermediate_size))
    if n_moe:
        mlps.append(
            MLPSpec(
                n_moe,
                gated=True,
                num_experts=experts,
                experts_per_token=cfg.num_experts_per_tok,
                expert_intermediate_size=cfg.moe_intermediate_size,
                shared_expert_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                shared_expert_gate=True,
            )
        )
    return ModelCostModel(
        model_type=cfg.model_type,
        hidden_size=cfg.hidden_size,
        layer_kinds=tuple("attention" if i in attn else "recurrent" for i in range(n)),
        # Qwen3-Next / Qwen3.5 attention always has its sigmoid output gate (SGLang logs "using
        # attn output gate!"); a config may say so with attn_output_gate
        attention=_attention(cfg, len(attn), output_gate=getattr(cfg, "attn_output_gate", None) is not False),
        recurrent=recurrent,
        mlps=tuple(mlps),
    )


def _nemotron_h(cfg: Any) -> ModelCostModel:
    pattern: str = cfg.hybrid_override_pattern
    recurrent = None
    if "M" in pattern:
        recurrent = Mamba2Spec(
            pattern.count("M"),
            cfg.mamba_num_heads,
            cfg.mamba_head_dim,
            cfg.ssm_state_size,
            cfg.n_groups,
            cfg.conv_kernel,
        )
    mlps = []
    if "-" in pattern:  # relu2 MLP: up + down, not gated
        mlps.append(MLPSpec(pattern.count("-"), gated=False, intermediate_size=cfg.intermediate_size))
    if "E" in pattern:  # relu2 experts, no shared-expert gate
        mlps.append(
            MLPSpec(
                pattern.count("E"),
                gated=False,
                num_experts=cfg.n_routed_experts,
                experts_per_token=cfg.num_experts_per_tok,
                expert_intermediate_size=cfg.moe_intermediate_size,
                shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or 0,
            )
        )
    return ModelCostModel(
        model_type=cfg.model_type,
        hidden_size=cfg.hidden_size,
        layer_kinds=tuple(NEMOTRON_H_LAYER_KINDS[c] for c in pattern),
        attention=_attention(cfg, pattern.count("*"), output_gate=False),
        recurrent=recurrent,
        mlps=tuple(mlps),
    )


def _falcon_h1(cfg: Any) -> ModelCostModel:
    """Falcon-H1: every layer runs attention and a Mamba2 mixer on the same input and sums them
    (SGLang's ``FalconH1HybridAttentionDecoderLayer``), then a SwiGLU MLP; so each block spec covers
    all ``num_hidden_layers`` layers. Attention has no output gate; ``head_dim`` is the config's, else
    ``hidden / heads``, as SGLang reads it."""
    n = cfg.num_hidden_layers
    return ModelCostModel(
        model_type=cfg.model_type,
        hidden_size=cfg.hidden_size,
        layer_kinds=("parallel",) * n,
        attention=_attention(cfg, n, output_gate=False),
        recurrent=_mamba2(cfg, n),
        mlps=(MLPSpec(n, gated=True, intermediate_size=cfg.intermediate_size),) if n else (),
    )


def _granite_h(cfg: Any) -> ModelCostModel:
    """Granite-4.0-H (``GraniteMoeHybridForCausalLM``): each layer one mixer, ``layer_types``' ``mamba``
    (Mamba2) or ``attention`` (no output gate, head dim ``hidden / heads`` whatever the config says,
    as SGLang builds it), then the same FFN in every layer: a router over ``num_local_experts`` SwiGLU
    experts of ``intermediate_size`` (top ``num_experts_per_tok``) when there are experts, plus a
    shared SwiGLU of ``shared_intermediate_size`` (no gate) when that is not 0."""
    n = cfg.num_hidden_layers
    n_attn, n_mamba = len(cfg.full_attention_layer_ids), len(cfg.mamba_layer_ids)
    experts = getattr(cfg, "num_local_experts", 0) or 0
    shared = getattr(cfg, "shared_intermediate_size", 0) or 0
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mlps: tuple[MLPSpec, ...] = ()
    if experts > 0:
        mlps = (
            MLPSpec(
                n,
                gated=True,
                num_experts=experts,
                experts_per_token=cfg.num_experts_per_tok,
                expert_intermediate_size=cfg.intermediate_size,
                shared_expert_intermediate_size=shared,
            ),
        )
    elif shared > 0:
        mlps = (MLPSpec(n, gated=True, intermediate_size=shared),)
    return ModelCostModel(
        model_type=cfg.model_type,
        hidden_size=cfg.hidden_size,
        layer_kinds=tuple("attention" if t == "attention" else "recurrent" for t in cfg.layer_types),
        attention=_attention(cfg, n_attn, output_gate=False, head_dim=head_dim),
        recurrent=_mamba2(cfg, n_mamba),
        mlps=mlps,
    )

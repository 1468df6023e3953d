"""Model configs (HF ``config.json`` dicts) the simulator and benchmarks use by name."""

from __future__ import annotations

from typing import Any

from sglang_sparse.policy.cost_model import ModelCostModel

QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 5120,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "torch_dtype": "bfloat16",
}

MODEL_CONFIGS: dict[str, dict[str, Any]] = {"qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B}


def cost_model(name_or_config: str | dict[str, Any]) -> ModelCostModel:
    """Cost model of a named config (see :data:`MODEL_CONFIGS`) or of an HF config dict."""
    if isinstance(name_or_config, dict):
        return ModelCostModel.from_hf_config(name_or_config)
    if name_or_config not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name_or_config!r}; known: {', '.join(MODEL_CONFIGS)}")
    return ModelCostModel.from_hf_config(MODEL_CONFIGS[name_or_config])

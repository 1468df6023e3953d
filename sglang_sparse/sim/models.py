"""The models the simulator and benchmarks cost by name: a small table of block specs.

Values from the public ``config.json`` files. A served model is costed from SGLang's own config
object instead (:mod:`sglang_sparse.sglang_adapter.model_cost`).
"""

from __future__ import annotations

from sglang_sparse.policy.cost_model import (
    NEMOTRON_H_LAYER_KINDS,
    AttentionSpec,
    GatedDeltaNetSpec,
    Mamba2Spec,
    MLPSpec,
    ModelCostModel,
)

#: Qwen/Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (16 q / 2 kv heads x 256, output
#: gate), the rest GatedDeltaNet (16 key / 32 value heads x 128, conv 4); MoE in every layer
#: (512 experts, 10 per token, 512 wide, one 512-wide shared expert with its gate); bfloat16
QWEN3_NEXT_80B_A3B = ModelCostModel(
    model_type="qwen3_next",
    hidden_size=2048,
    layer_kinds=("recurrent", "recurrent", "recurrent", "attention") * 12,
    attention=AttentionSpec(12, 16, 2, 256, output_gate=True),
    recurrent=GatedDeltaNetSpec(36, 16, 32, 128, 128, 4),
    mlps=(
        MLPSpec(
            48,
            gated=True,
            num_experts=512,
            experts_per_token=10,
            expert_intermediate_size=512,
            shared_expert_intermediate_size=512,
            shared_expert_gate=True,
        ),
    ),
)

#: nvidia/Nemotron-H-8B-Base-8K: 52 layers (pattern below: 24 Mamba2, 4 attention, 24 relu2 MLP);
#: attention 32 q / 8 kv heads x 128, no gate; Mamba2 128 heads x 64, state 128, 8 groups, conv 4
NEMOTRON_H_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B = ModelCostModel(
    model_type="nemotron_h",
    hidden_size=4096,
    layer_kinds=tuple(NEMOTRON_H_LAYER_KINDS[c] for c in NEMOTRON_H_PATTERN),
    attention=AttentionSpec(4, 32, 8, 128, output_gate=False),
    recurrent=Mamba2Spec(24, 128, 64, 128, 8, 4),
    mlps=(MLPSpec(24, gated=False, intermediate_size=21504),),
)

#: tiiuae/Falcon-H1-7B-Instruct, a parallel hybrid: each of its 44 layers runs attention (12 q / 2 kv
#: heads x 128, no gate) AND a Mamba2 mixer (24 heads x 128 = mamba_d_ssm 3072, state 256, 1 group,
#: conv 4) on the same input, then a SwiGLU MLP of 12288. Depth / width / heads / kv / Mamba heads /
#: head dims 128 / 128 / state 256: the model table of transformers' FalconH1 docs
#: (huggingface.co/docs/transformers/model_doc/falcon_h1); intermediate 12288, 1 group, conv 4, 24 x 128:
#: Megatron-Bridge's FalconH1ModelProvider7B ("from config.json", NVIDIA-NeMo/Megatron-Bridge
#: src/megatron/bridge/models/falcon_h1/falconh1_provider.py); mamba_d_ssm 3072 and head_dim 128 also in
#: third-party copies of the config.json (mlx-community 4-bit's)
FALCON_H1_7B = ModelCostModel(
    model_type="falcon_h1",
    hidden_size=3072,
    layer_kinds=("parallel",) * 44,
    attention=AttentionSpec(44, 12, 2, 128, output_gate=False),
    recurrent=Mamba2Spec(44, 24, 128, 256, 1, 4),
    mlps=(MLPSpec(44, gated=True, intermediate_size=12288),),
)

#: ibm-granite/granite-4.0-h-tiny: 40 layers, 4 attention (12 q / 4 kv heads x 128 = 1536 / 12, no
#: gate, NoPE) at layers 5, 15, 25, 35, the other 36 Mamba2 (48 heads x 64 = 2 x 1536, state 128, 1
#: group, conv 4); every layer a MoE of 64 SwiGLU experts x 512, 6 per token, plus a 1024-wide shared
#: SwiGLU. Hidden, 4 / 36 layers, head size, heads, kv heads, state, Mamba heads, experts, active
#: experts, expert and shared sizes: the model card's architecture table (a copy in
#: DocDBrown/IBMGranite4Tiny README.md); Mamba head dim 64, 1 group, conv 4, the layer_types order:
#: third-party copies of the config.json (the head dim is also forced by SGLang's config check)
GRANITE_4_H_TINY_LAYER_KINDS = (
    ("recurrent",) * 5 + ("attention",) + (("recurrent",) * 9 + ("attention",)) * 3 + ("recurrent",) * 4
)
GRANITE_4_H_TINY = ModelCostModel(
    model_type="granitemoehybrid",
    hidden_size=1536,
    layer_kinds=GRANITE_4_H_TINY_LAYER_KINDS,
    attention=AttentionSpec(4, 12, 4, 128, output_gate=False),
    recurrent=Mamba2Spec(36, 48, 64, 128, 1, 4),
    mlps=(
        MLPSpec(
            40,
            gated=True,
            num_experts=64,
            experts_per_token=6,
            expert_intermediate_size=512,
            shared_expert_intermediate_size=1024,
        ),
    ),
)

#: named models (``--model`` of the benchmarks)
MODELS: dict[str, ModelCostModel] = {
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "nemotron-h-8b": NEMOTRON_H_8B,
    "falcon-h1-7b": FALCON_H1_7B,
    "granite-4.0-h-tiny": GRANITE_4_H_TINY,
}


def cost_model(name: str) -> ModelCostModel:
    """The cost model of a named model (see :data:`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]

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

#: named models (``--model`` of the benchmarks)
MODELS: dict[str, ModelCostModel] = {
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "nemotron-h-8b": NEMOTRON_H_8B,
}


def cost_model(name: str) -> ModelCostModel:
    """The cost model of a named model (see :data:`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]

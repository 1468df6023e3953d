"""Tests for sglang_sparse.policy.cost_model (hand computations, monotonicity, additivity), the
simulator's model table (sglang_sparse.sim.models) and the adapter's reading of SGLang's config
objects (sglang_sparse.sglang_adapter.model_cost)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.configs.falcon_h1 import FalconH1Config
from sglang.srt.configs.granitemoehybrid import GraniteMoeHybridConfig
from sglang.srt.configs.nemotron_h import NemotronHConfig
from sglang.srt.configs.qwen3_5 import Qwen3_5Config
from sglang.srt.configs.qwen3_next import Qwen3NextConfig

from sglang_sparse.policy import ModelCostModel
from sglang_sparse.sglang_adapter.model_cost import ARCHITECTURES, model_cost
from sglang_sparse.sim.models import MODELS, cost_model

# --------------------------------------------------------------------------------------------------
# Public-config-shaped dicts (trimmed to the keys the cost model reads plus a few neighbours).
# --------------------------------------------------------------------------------------------------

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (values from the public file, from memory).
QWEN3_NEXT_80B_A3B = {
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
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# Qwen/Qwen3.5-0.8B config.json (multimodal wrapper, text config nested). UNSURE: written from memory
# of the public file; hidden 1024 / 24 layers / GDN 16x128 heads / attention 8q-2kv x 256 /
# intermediate 3584 are my best recollection. The tests below recompute every number from this dict,
# so they check the formulas, not these exact values.
QWEN3_5_0_8B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        "full_attention_interval": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "intermediate_size": 3584,
        "vocab_size": 248320,
        "mamba_ssm_dtype": "float32",
        "dtype": "bfloat16",
    },
    "vision_config": {"model_type": "qwen3_5"},
}

# nvidia/Nemotron-H-8B-Base-8K config.json (public values).
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attention_head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 128,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "vocab_size": 131072,
    "torch_dtype": "bfloat16",
}


# tiiuae/Falcon-H1-7B-Instruct config.json, the keys SGLang's FalconH1Config / model read (values as
# cited in sglang_sparse/sim/models.py); the muP multipliers are left at SGLang's defaults: no FLOPs.
FALCON_H1_7B = {
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "hidden_size": 3072,
    "num_hidden_layers": 44,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 12288,
    "mamba_d_ssm": 3072,
    "mamba_n_heads": 24,
    "mamba_d_head": 128,
    "mamba_d_state": 256,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "attn_layer_indices": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# ibm-granite/granite-4.0-h-tiny config.json, the keys SGLang's GraniteMoeHybridConfig / model read
# (values as cited in sglang_sparse/sim/models.py).
GRANITE_4_H_TINY = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "hidden_size": 1536,
    "num_hidden_layers": 40,
    "layer_types": ["mamba"] * 5 + (["attention"] + ["mamba"] * 9) * 3 + ["attention"] + ["mamba"] * 4,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "shared_intermediate_size": 1024,
    "num_local_experts": 64,
    "num_experts_per_tok": 6,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "position_embedding_type": "nope",
    "vocab_size": 100352,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def served(cfg: dict) -> ModelCostModel:
    """The cost model the adapter builds for ``cfg`` as SGLang parses it (its config class)."""
    cls = {
        "qwen3_next": Qwen3NextConfig,
        "qwen3_5": Qwen3_5Config,
        "nemotron_h": NemotronHConfig,
        "falcon_h1": FalconH1Config,
        "granitemoehybrid": GraniteMoeHybridConfig,
    }
    return model_cost(cls[cfg["model_type"]](**cfg))


@pytest.fixture(scope="module")
def qnext() -> ModelCostModel:
    return cost_model("qwen3-next-80b-a3b")


@pytest.fixture(scope="module")
def q35() -> ModelCostModel:
    return Q35


@pytest.fixture(scope="module")
def nemh() -> ModelCostModel:
    return cost_model("nemotron-h-8b")


@pytest.fixture(scope="module")
def falcon() -> ModelCostModel:
    return cost_model("falcon-h1-7b")


@pytest.fixture(scope="module")
def granite() -> ModelCostModel:
    return cost_model("granite-4.0-h-tiny")


ALL = ("qnext", "q35", "nemh", "falcon", "granite")
Q35 = served(QWEN3_5_0_8B)


def ctx_sum(n: int, past: int) -> int:
    """sum over the n new tokens of their causal context length (past + i + 1), by brute force."""
    return sum(past + i + 1 for i in range(n))


# --------------------------------------------------------------------------------------------------
# Hand computations: Qwen3-Next-80B-A3B
# --------------------------------------------------------------------------------------------------


def qnext_hand_flops(n: int, past: int) -> dict[str, int]:
    h = 2048
    # layers: 48, every 4th full attention -> 12 attention, 36 GatedDeltaNet; MoE on all 48.
    # attention: q_proj 2048 -> 16*256*2 (query + output gate), k/v 2048 -> 2*256 each, o 4096 -> 2048
    attn_params = h * (16 * 256 * 2) + h * (2 * 256) * 2 + (16 * 256) * h
    assert attn_params == 16_777_216 + 2_097_152 + 8_388_608
    attn = 12 * (2 * attn_params * n + 4 * 16 * 256 * ctx_sum(n, past))
    # GDN: key_dim 16*128=2048, value_dim 32*128=4096; in_proj_qkvz -> 2*2048+2*4096, in_proj_ba -> 64
    gdn_params = h * (2 * 2048 + 2 * 4096 + 2 * 32) + 4096 * h
    conv_dim = 2 * 2048 + 4096  # 8192
    gdn_other = 2 * conv_dim * 4 + 7 * 32 * 128 * 128
    rec = 36 * n * (2 * gdn_params + gdn_other)
    # MoE: router 2048*512, 10 experts x SwiGLU(2048, 512), shared SwiGLU(2048, 512), shared gate 2048x1
    moe_params = h * 512 + 10 * 3 * h * 512 + 3 * h * 512 + h
    mlp = 48 * n * 2 * moe_params
    return {"attention": attn, "recurrent": rec, "mlp": mlp}


def test_qwen3_next_structure_and_bytes(qnext: ModelCostModel) -> None:
    assert qnext.num_layers == 48
    assert qnext.num_attention_layers == 12
    assert qnext.num_recurrent_layers == 36
    assert qnext.layer_kinds[3] == "attention" and qnext.layer_kinds[0] == "recurrent"
    # KV: 2 (K,V) * 2 kv heads * 256 head_dim * 2 B (bf16) * 12 layers
    assert qnext.kv_bytes_per_token == 2 * 2 * 256 * 2 * 12 == 24_576
    # state per GDN layer: SSM 32*128*128 fp32 + conv (2*2048 + 4096) * (4-1) bf16
    ssm = 32 * 128 * 128 * 4
    conv = 8192 * 3 * 2
    assert (ssm, conv) == (2_097_152, 49_152)
    assert qnext.ssm_state_bytes == 36 * ssm
    assert qnext.conv_state_bytes == 36 * conv
    assert qnext.state_bytes == 36 * (ssm + conv) == 77_266_944


@pytest.mark.parametrize("n,past", [(1, 0), (7, 0), (1000, 0), (1024, 3000), (32768, 0), (5, 123_456)])
def test_qwen3_next_flops_by_hand(qnext: ModelCostModel, n: int, past: int) -> None:
    hand = qnext_hand_flops(n, past)
    got = qnext.prefill_flops_by_kind(n, past)
    assert got == {k: float(v) for k, v in hand.items()}
    assert qnext.prefill_flops(n, past) == float(sum(hand.values()))


def test_qwen3_next_active_params_about_3b(qnext: ModelCostModel) -> None:
    # Sanity: FLOPs per token / 2 ~ active non-embedding params. "A3B": MoE 48 x 35.7M = 1.71B,
    # GDN 36 x 33.6M = 1.21B, attention 12 x 27.3M = 0.33B (+ small conv/core terms) ~ 3.3B.
    per_token = qnext.prefill_flops(1, 0)
    assert 3.0e9 < per_token / 2 < 3.6e9


# --------------------------------------------------------------------------------------------------
# Hand computations: Qwen3.5-0.8B (dense MLP, nested text_config)
# --------------------------------------------------------------------------------------------------


def q35_hand_flops(n: int, past: int) -> dict[str, int]:
    h = 1024
    # 24 layers: 6 attention, 18 GDN; dense SwiGLU MLP (3584) on all 24.
    attn_params = h * (8 * 256 * 2) + h * (2 * 256) * 2 + (8 * 256) * h
    attn = 6 * (2 * attn_params * n + 4 * 8 * 256 * ctx_sum(n, past))
    key_dim, value_dim = 16 * 128, 16 * 128
    gdn_params = h * (2 * key_dim + 2 * value_dim + 2 * 16) + value_dim * h
    gdn_other = 2 * (2 * key_dim + value_dim) * 4 + 7 * 16 * 128 * 128
    rec = 18 * n * (2 * gdn_params + gdn_other)
    mlp = 24 * n * 2 * (3 * h * 3584)
    return {"attention": attn, "recurrent": rec, "mlp": mlp}


def test_qwen3_5_structure_and_bytes(q35: ModelCostModel) -> None:
    assert q35.model_type == "qwen3_5_text"
    assert (q35.num_attention_layers, q35.num_recurrent_layers) == (6, 18)
    assert q35.kv_bytes_per_token == 2 * 2 * 256 * 2 * 6 == 12_288
    ssm = 16 * 128 * 128 * 4  # mamba_ssm_dtype float32
    conv = (2 * 2048 + 2048) * 3 * 2
    assert q35.state_bytes == 18 * (ssm + conv) == 18 * (1_048_576 + 36_864)
    assert all(not m.is_moe for m in q35.mlps)


@pytest.mark.parametrize("n,past", [(1, 0), (1000, 0), (1024, 3000), (32768, 0), (3, 77)])
def test_qwen3_5_flops_by_hand(q35: ModelCostModel, n: int, past: int) -> None:
    hand = q35_hand_flops(n, past)
    assert q35.prefill_flops_by_kind(n, past) == {k: float(v) for k, v in hand.items()}
    assert q35.prefill_flops(n, past) == float(sum(hand.values()))


def test_qwen3_5_is_dense_although_sglangs_config_defaults_to_512_experts(q35: ModelCostModel) -> None:
    # SGLang's Qwen3_5TextConfig inherits Qwen3NextConfig's num_experts=512; the model class is dense
    assert Qwen3_5Config(**QWEN3_5_0_8B).get_text_config().num_experts == 512
    assert [m.is_moe for m in q35.mlps] == [False]
    moe = model_cost(
        Qwen3_5Config(**dict(QWEN3_5_0_8B, architectures=["Qwen3_5MoeForConditionalGeneration"]))
    )
    assert [m.num_experts for m in moe.mlps] == [512]


# --------------------------------------------------------------------------------------------------
# Hand computations: Nemotron-H-8B
# --------------------------------------------------------------------------------------------------


def nemh_hand_flops(n: int, past: int) -> dict[str, int]:
    h = 4096
    # pattern: 24 M (Mamba2), 4 * (attention), 24 - (relu2 MLP); each layer is ONE block.
    attn_params = h * (32 * 128) + h * (8 * 128) * 2 + (32 * 128) * h  # no output gate
    attn = 4 * (2 * attn_params * n + 4 * 32 * 128 * ctx_sum(n, past))
    inner = 128 * 64  # 8192 == expand * hidden
    mamba_params = h * (2 * inner + 2 * 8 * 128 + 128) + inner * h
    conv_dim = inner + 2 * 8 * 128  # 10240
    mamba_other = 2 * conv_dim * 4 + 5 * 128 * 64 * 128
    rec = 24 * n * (2 * mamba_params + mamba_other)
    mlp = 24 * n * 2 * (2 * h * 21504)  # up + down, not gated
    return {"attention": attn, "recurrent": rec, "mlp": mlp}


def test_nemotron_h_structure_and_bytes(nemh: ModelCostModel) -> None:
    assert (nemh.num_attention_layers, nemh.num_recurrent_layers) == (4, 24)
    assert nemh.layer_kinds.count("mlp") == 24
    assert nemh.kv_bytes_per_token == 2 * 8 * 128 * 2 * 4 == 16_384
    ssm = 128 * 64 * 128 * 4  # SGLang default fp32 SSM state
    conv = (8192 + 2 * 8 * 128) * 3 * 2
    assert nemh.state_bytes == 24 * (ssm + conv) == 102_137_856


@pytest.mark.parametrize("n,past", [(1, 0), (1000, 0), (1024, 3000), (32768, 0), (9, 8000)])
def test_nemotron_h_flops_by_hand(nemh: ModelCostModel, n: int, past: int) -> None:
    hand = nemh_hand_flops(n, past)
    assert nemh.prefill_flops_by_kind(n, past) == {k: float(v) for k, v in hand.items()}
    assert nemh.prefill_flops(n, past) == float(sum(hand.values()))


def test_nemotron_h_params_about_8b(nemh: ModelCostModel) -> None:
    per_token = nemh.prefill_flops(1, 0) - nemh.prefill_flops_by_kind(1, 0)["attention"]
    # recurrent + MLP params (~7.5B) excluding embeddings, plus small core/conv terms
    assert 6e9 < per_token / 2 < 9e9


def test_nemotron_h_moe_layers() -> None:
    cfg = dict(NEMOTRON_H_8B)
    cfg.update(
        hybrid_override_pattern="ME*E",
        num_hidden_layers=4,
        n_routed_experts=128,
        num_experts_per_tok=6,
        moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712,
    )
    m = served(cfg)
    assert m.layer_kinds == ("recurrent", "mlp", "attention", "mlp")
    h = 4096
    moe_params = h * 128 + 6 * 2 * h * 1856 + 2 * h * 3712
    assert m.prefill_flops_by_kind(10)["mlp"] == 2 * 2 * moe_params * 10


# --------------------------------------------------------------------------------------------------
# Hand computations: Falcon-H1-7B (parallel hybrid: attention AND Mamba2 in every layer)
# --------------------------------------------------------------------------------------------------


def falcon_hand_flops(n: int, past: int) -> dict[str, int]:
    h = 3072
    # 44 layers, each: attention (12 q / 2 kv x 128, no gate) + Mamba2 (24 x 128, state 256, 1 group,
    # conv 4) on the same input, then a SwiGLU of 12288. Every block runs in all 44 layers.
    attn_params = h * (12 * 128) + h * (2 * 128) * 2 + (12 * 128) * h
    assert attn_params == 11_010_048
    attn = 44 * (2 * attn_params * n + 4 * 12 * 128 * ctx_sum(n, past))
    inner = 24 * 128  # 3072 == mamba_d_ssm (here == hidden, not expand * hidden)
    mamba_params = h * (2 * inner + 2 * 1 * 256 + 24) + inner * h  # in_proj z,x,B,C,dt + out_proj
    assert mamba_params == 29_958_144
    conv_dim = inner + 2 * 1 * 256  # 3584
    mamba_other = 2 * conv_dim * 4 + 5 * 24 * 128 * 256
    rec = 44 * n * (2 * mamba_params + mamba_other)
    mlp = 44 * n * 2 * (3 * h * 12288)
    return {"attention": attn, "recurrent": rec, "mlp": mlp}


def test_falcon_h1_structure_and_bytes(falcon: ModelCostModel) -> None:
    assert falcon.model_type == "falcon_h1"
    assert falcon.num_layers == 44 and set(falcon.layer_kinds) == {"parallel"}
    # both blocks in every layer: KV in all 44 layers AND a Mamba2 state in all 44
    assert (falcon.num_attention_layers, falcon.num_recurrent_layers) == (44, 44)
    assert falcon.kv_bytes_per_token == 2 * 2 * 128 * 2 * 44 == 45_056
    ssm = 24 * 128 * 256 * 4  # fp32
    conv = (3072 + 2 * 256) * 3 * 2  # bf16, W-1 = 3 taps
    assert (ssm, conv) == (3_145_728, 21_504)
    assert falcon.state_bytes == 44 * (ssm + conv) == 139_358_208


@pytest.mark.parametrize("n,past", [(1, 0), (1000, 0), (1024, 0), (1024, 3000), (32768, 0), (7, 9000)])
def test_falcon_h1_flops_by_hand(falcon: ModelCostModel, n: int, past: int) -> None:
    hand = falcon_hand_flops(n, past)
    assert falcon.prefill_flops_by_kind(n, past) == {k: float(v) for k, v in hand.items()}
    assert falcon.prefill_flops(n, past) == float(sum(hand.values()))


def test_falcon_h1_params_about_7b(falcon: ModelCostModel) -> None:
    # non-embedding params: 44 x (11.0M attention + 30.0M Mamba2 + 113.2M MLP) = 6.79B (+ core/conv)
    assert 6.5e9 < falcon.prefill_flops(1, 0) / 2 < 7.2e9


# --------------------------------------------------------------------------------------------------
# Hand computations: Granite-4.0-H-Tiny (4 attention / 36 Mamba2, MoE + shared expert everywhere)
# --------------------------------------------------------------------------------------------------


def granite_hand_flops(n: int, past: int) -> dict[str, int]:
    h = 1536
    # attention: 12 q / 4 kv heads x (1536 / 12 = 128), no gate, 4 layers
    attn_params = h * (12 * 128) + h * (4 * 128) * 2 + (12 * 128) * h
    assert attn_params == 6_291_456
    attn = 4 * (2 * attn_params * n + 4 * 12 * 128 * ctx_sum(n, past))
    inner = 48 * 64  # 3072 == expand 2 * hidden
    mamba_params = h * (2 * inner + 2 * 1 * 128 + 48) + inner * h
    assert mamba_params == 14_622_720
    mamba_other = 2 * (inner + 2 * 128) * 4 + 5 * 48 * 64 * 128
    rec = 36 * n * (2 * mamba_params + mamba_other)
    # every one of the 40 layers: router 1536 x 64, 6 SwiGLU experts of 512, a SwiGLU shared of 1024
    moe_params = h * 64 + 6 * 3 * h * 512 + 3 * h * 1024
    assert moe_params == 18_972_672
    mlp = 40 * n * 2 * moe_params
    return {"attention": attn, "recurrent": rec, "mlp": mlp}


def test_granite_h_structure_and_bytes(granite: ModelCostModel) -> None:
    assert granite.model_type == "granitemoehybrid"
    assert (granite.num_layers, granite.num_attention_layers, granite.num_recurrent_layers) == (40, 4, 36)
    assert [i for i, k in enumerate(granite.layer_kinds) if k == "attention"] == [5, 15, 25, 35]
    assert granite.kv_bytes_per_token == 2 * 4 * 128 * 2 * 4 == 8192
    ssm = 48 * 64 * 128 * 4
    conv = (3072 + 2 * 128) * 3 * 2
    assert granite.state_bytes == 36 * (ssm + conv) == 57_341_952


@pytest.mark.parametrize("n,past", [(1, 0), (1000, 0), (1024, 0), (1024, 3000), (32768, 0), (3, 77)])
def test_granite_h_flops_by_hand(granite: ModelCostModel, n: int, past: int) -> None:
    hand = granite_hand_flops(n, past)
    assert granite.prefill_flops_by_kind(n, past) == {k: float(v) for k, v in hand.items()}
    assert granite.prefill_flops(n, past) == float(sum(hand.values()))


def test_granite_h_tiny_active_params_about_1b(granite: ModelCostModel) -> None:
    # "7B total / 1B active": 40 x 19.0M MoE + 36 x 14.6M Mamba2 + 4 x 6.3M attention ~ 1.31B
    # non-embedding active params (the card's 1B rounds; 154M embeddings not counted)
    assert 1.2e9 < granite.prefill_flops(1, 0) / 2 < 1.45e9


# --------------------------------------------------------------------------------------------------
# The new table entries at a glance: checkpoint bytes, KV bytes per token (bf16), 1k-token prefill
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,state_bytes,kv_bytes,flops_1k",
    [
        # 44 x (24*128*256 fp32 + 3584*3 bf16); 2*2*128 bf16 x 44; 1024 tokens, hand sum below
        ("falcon-h1-7b", 139_358_208, 45_056, 14_216_899_592_192),
        # 36 x (48*64*128 fp32 + 3328*3 bf16); 2*4*128 bf16 x 4
        ("granite-4.0-h-tiny", 57_341_952, 8192, 2_770_241_323_008),
    ],
)
def test_new_table_entries(name: str, state_bytes: int, kv_bytes: int, flops_1k: int) -> None:
    m = cost_model(name)
    assert m.state_bytes == state_bytes
    assert m.kv_bytes_per_token == kv_bytes
    hand = {"falcon-h1-7b": falcon_hand_flops, "granite-4.0-h-tiny": granite_hand_flops}[name](1024, 0)
    assert sum(hand.values()) == flops_1k
    assert m.prefill_flops(1024) == float(flops_1k)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layer_kinds_match_the_block_counts(name: str) -> None:
    m = MODELS[name]
    assert m.num_attention_layers == m.layer_kinds.count("attention") + m.layer_kinds.count("parallel")
    assert m.num_recurrent_layers == m.layer_kinds.count("recurrent") + m.layer_kinds.count("parallel")
    assert all(s.num_layers <= m.num_layers for s in m.mlps)


# --------------------------------------------------------------------------------------------------
# Falcon-H1 / Granite-4.0-H read from SGLang's config objects (small configs, numbers by hand)
# --------------------------------------------------------------------------------------------------


def test_falcon_h1_small_config_by_hand() -> None:
    cfg = FalconH1Config(
        architectures=["FalconH1ForCausalLM"],
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != 64 / 4: the config's head_dim wins, as SGLang reads it
        intermediate_size=96,
        mamba_d_ssm=None,  # -> mamba_expand * hidden = 128
        mamba_n_heads=8,
        mamba_d_head="auto",  # -> 128 / 8 = 16
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_d_conv=3,
        mamba_expand=2,
        key_multiplier=0.5,
        ssm_multipliers=[2.0] * 5,
        mlp_multipliers=[0.25, 4.0],
    )
    m = model_cost(cfg)
    assert m.layer_kinds == ("parallel",) * 3
    assert (m.num_attention_layers, m.num_recurrent_layers) == (3, 3)
    assert (m.attention.head_dim, m.recurrent.inner_size, m.recurrent.head_dim) == (32, 128, 16)
    assert m.kv_bytes_per_token == 2 * 2 * 32 * 2 * 3
    conv_dim = 128 + 2 * 2 * 8
    assert m.state_bytes == 3 * (8 * 16 * 8 * 4 + conv_dim * 2 * 2)
    n, past, h = 5, 11, 64
    attn = 3 * (2 * (h * 4 * 32 + 2 * h * 2 * 32 + 4 * 32 * h) * n + 4 * 4 * 32 * ctx_sum(n, past))
    mamba = 3 * n * (2 * (h * (2 * 128 + 2 * 2 * 8 + 8) + 128 * h) + 2 * conv_dim * 3 + 5 * 8 * 16 * 8)
    mlp = 3 * n * 2 * 3 * h * 96
    assert m.prefill_flops_by_kind(n, past) == {"attention": attn, "recurrent": mamba, "mlp": mlp}


@pytest.mark.parametrize(
    "experts,shared,mlp_params",
    [
        (4, 48, 64 * 4 + 2 * 3 * 64 * 16 + 3 * 64 * 48),  # MoE (top 2) + shared SwiGLU
        (4, 0, 64 * 4 + 2 * 3 * 64 * 16),  # MoE only
        (0, 48, 3 * 64 * 48),  # dense: the shared SwiGLU is the MLP (granite-4.0-h-micro's shape)
        (0, 0, 0),  # no FFN at all
    ],
)
def test_granite_h_small_config_by_hand(experts: int, shared: int, mlp_params: int) -> None:
    cfg = GraniteMoeHybridConfig(
        architectures=["GraniteMoeHybridForCausalLM"],
        hidden_size=64,
        num_hidden_layers=4,
        # HF's newer spellings, which SGLang maps to mamba / attention
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,  # ignored: SGLang's attention uses hidden / heads = 16
        intermediate_size=16,
        shared_intermediate_size=shared,
        num_local_experts=experts,
        num_experts_per_tok=2 if experts else 0,
        mamba_n_heads=8,
        mamba_d_head=16,  # 8 * 16 == expand 2 * hidden 64
        mamba_d_state=4,
        mamba_n_groups=1,
        mamba_d_conv=4,
        residual_multiplier=0.5,
        embedding_multiplier=3.0,
    )
    m = model_cost(cfg)
    assert m.layer_kinds == ("recurrent", "attention", "recurrent", "recurrent")
    assert (m.num_attention_layers, m.num_recurrent_layers) == (1, 3)
    assert m.attention.head_dim == 16
    assert m.kv_bytes_per_token == 2 * 1 * 16 * 2 * 1
    conv_dim = 128 + 2 * 4
    assert m.state_bytes == 3 * (8 * 16 * 4 * 4 + conv_dim * 3 * 2)
    n, past, h = 6, 2, 64
    attn = 1 * (2 * (h * 4 * 16 + 2 * h * 16 + 4 * 16 * h) * n + 4 * 4 * 16 * ctx_sum(n, past))
    mamba = 3 * n * (2 * (h * (2 * 128 + 2 * 4 + 8) + 128 * h) + 2 * conv_dim * 4 + 5 * 8 * 16 * 4)
    mlp = 4 * n * 2 * mlp_params
    assert m.prefill_flops_by_kind(n, past) == {"attention": attn, "recurrent": mamba, "mlp": mlp}
    assert len(m.mlps) == (1 if mlp_params else 0)


# --------------------------------------------------------------------------------------------------
# dtype overrides
# --------------------------------------------------------------------------------------------------


def test_dtype_fields() -> None:
    m = dataclasses.replace(cost_model("qwen3-next-80b-a3b"), ssm_dtype_bytes=2, kv_dtype_bytes=1)
    assert m.kv_bytes_per_token == 2 * 2 * 256 * 1 * 12
    assert m.state_bytes == 36 * (32 * 128 * 128 * 2 + 8192 * 3 * 2)


# --------------------------------------------------------------------------------------------------
# Properties: monotonicity, additivity, resume / saved semantics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_monotone_in_n_and_past(name: str, request: pytest.FixtureRequest) -> None:
    m: ModelCostModel = request.getfixturevalue(name)
    assert m.prefill_flops(0) == 0.0
    ns = [0, 1, 2, 10, 100, 1000, 10_000]
    vals = [m.prefill_flops(n, 0) for n in ns]
    assert all(a < b for a, b in zip(vals, vals[1:], strict=False))
    pasts = [0, 1, 100, 10_000, 1_000_000]
    vals = [m.prefill_flops(16, p) for p in pasts]
    assert all(a < b for a, b in zip(vals, vals[1:], strict=False))
    # only attention depends on the context
    by0, by1 = m.prefill_flops_by_kind(16, 0), m.prefill_flops_by_kind(16, 10_000)
    assert by0["recurrent"] == by1["recurrent"] and by0["mlp"] == by1["mlp"]
    assert by1["attention"] > by0["attention"]


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(ALL),
    a=st.integers(0, 200_000),
    b=st.integers(0, 200_000),
    past=st.integers(0, 200_000),
)
def test_additivity(name: str, a: int, b: int, past: int) -> None:
    m = {
        "qnext": MODELS["qwen3-next-80b-a3b"],
        "q35": Q35,
        "nemh": MODELS["nemotron-h-8b"],
        "falcon": MODELS["falcon-h1-7b"],
        "granite": MODELS["granite-4.0-h-tiny"],
    }[name]
    lhs = m.prefill_flops(a, past) + m.prefill_flops(b, past_tokens=past + a)
    assert math.isclose(lhs, m.prefill_flops(a + b, past), rel_tol=1e-14)
    # the exact (integer) breakdown is additive with no rounding at moderate sizes
    if a + b + past < 5000:
        assert lhs == m.prefill_flops(a + b, past)


@pytest.mark.parametrize("name", ALL)
def test_resume_and_saved(name: str, request: pytest.FixtureRequest) -> None:
    m: ModelCostModel = request.getfixturevalue(name)
    c, d = 4096, 6000
    # resuming at checkpoint c with KV matched to d re-prefills c..d through all layers
    assert m.node_flops_saved(d, c) == m.prefill_flops(d - c, past_tokens=c)
    assert m.node_flops_saved(d, d) == 0.0
    # ... so it costs more than the context-independent part (recurrent layers + MLPs) alone
    by = m.prefill_flops_by_kind(d - c)
    assert m.node_flops_saved(d, c) > by["recurrent"] + by["mlp"]
    # saved == full prefill - what still has to run after the hit
    p, r = 10_000, 4096
    saved = m.flops_saved(p, r)
    assert saved == m.prefill_flops(r)
    assert math.isclose(saved, m.prefill_flops(p) - m.prefill_flops(p - r, past_tokens=r), rel_tol=1e-12)
    assert m.flops_saved(p, 0) == 0.0
    with pytest.raises(ValueError, match="resume_depth"):
        m.flops_saved(10, 11)
    with pytest.raises(ValueError, match="fallback_depth"):
        m.node_flops_saved(10, 11)


def test_node_flops_saved_grows_with_fallback_distance_and_depth(qnext: ModelCostModel) -> None:
    parent, node = 30_000, 30_512
    saved = qnext.node_flops_saved(node, parent)
    assert saved == qnext.prefill_flops(512, past_tokens=30_000)
    # a deeper fallback checkpoint (sparse tree) -> more FLOPs saved by keeping the node
    deeper = qnext.node_flops_saved(node, 20_000)
    assert deeper > saved and deeper == qnext.prefill_flops(10_512, past_tokens=20_000)
    # same-length node deeper in the tree is worth more (attention sees more context)
    assert qnext.node_flops_saved(1512, 1000) < saved


def test_bad_token_counts(qnext: ModelCostModel) -> None:
    with pytest.raises(ValueError, match="n_tokens"):
        qnext.prefill_flops(-1)
    with pytest.raises(ValueError, match="past_tokens"):
        qnext.prefill_flops(1, past_tokens=-5)
    with pytest.raises(TypeError, match="n_tokens"):
        qnext.prefill_flops(1.5)  # type: ignore[arg-type]


def test_frozen(qnext: ModelCostModel) -> None:
    with pytest.raises(AttributeError):
        qnext.hidden_size = 1  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# The simulator's table and the adapter's reading of SGLang's config objects
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("qwen3-next-80b-a3b", QWEN3_NEXT_80B_A3B),
        ("nemotron-h-8b", NEMOTRON_H_8B),
        ("falcon-h1-7b", FALCON_H1_7B),
        ("granite-4.0-h-tiny", GRANITE_4_H_TINY),
    ],
)
def test_table_equals_sglangs_reading_of_the_public_config(name: str, cfg: dict) -> None:
    assert served(cfg) == MODELS[name]


def test_qwen3_next_layout_and_moe_placement_follow_sglangs_config() -> None:
    # SGLang lays the layers out from full_attention_interval
    m = served(dict(QWEN3_NEXT_80B_A3B, full_attention_interval=2, num_hidden_layers=8))
    assert m.layer_kinds == ("recurrent", "attention") * 4
    # HF Qwen3-Next: MoE unless in mlp_only_layers or off the decoder_sparse_step
    m = served(dict(QWEN3_NEXT_80B_A3B, num_hidden_layers=8, mlp_only_layers=[1], decoder_sparse_step=2))
    assert [(s.num_layers, s.is_moe) for s in m.mlps] == [(5, False), (3, True)]
    assert [(s.num_layers, s.is_moe) for s in served(dict(QWEN3_NEXT_80B_A3B, num_experts=0)).mlps] == [
        (48, False)
    ]


def test_unsupported_architecture_named() -> None:
    cfg = Qwen3NextConfig(**dict(QWEN3_NEXT_80B_A3B, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match="'LlamaForCausalLM'") as exc:
        model_cost(cfg)
    assert all(a in str(exc.value) for a in ARCHITECTURES)
    with pytest.raises(ValueError, match="unknown model 'llama'"):
        cost_model("llama")

"""Tiny random-weight hybrid (GatedDeltaNet or Mamba2 + attention) checkpoints for CPU serving tests.

``make_tiny_model`` writes a HF checkpoint (config, safetensors weights, generation config) plus a
small local word-level tokenizer into ``out_dir``; nothing is downloaded. Weights are drawn from a
seeded generator, so the same arguments give byte-identical weights on the same torch version.

Sizes (:data:`SIZES`): ``tiny`` (default) starts in seconds, for the serving tests; ``bench``
(hidden 768, 12 layers) is where prefill dominates, for ``benchmarks/prefill_cpu.py``.

Arches (:data:`ARCHS`): GDN hybrids ``qwen3_next``, ``qwen3_5`` (:data:`GDN_ARCHS`) and Mamba2
hybrids ``nemotron_h``, ``falcon_h1``, ``granite_moe_hybrid`` (Granite-4.0-H; :data:`MAMBA2_ARCHS`).

Layer pattern: GDN arches and ``granite_moe_hybrid``: every ``full_attention_interval``-th layer is
full attention, the others are linear (GDN / Mamba2), e.g. interval 4 gives ``L L L A``. SGLang
0.5.23's Qwen3-Next config derives the pattern from ``full_attention_interval`` only (it ignores
HF's ``layer_types``), so arbitrary patterns are not offered; both keys are written consistently.
``nemotron_h`` takes its blocks from ``nemotron_pattern`` (``M`` Mamba2, ``*`` attention, ``-`` MLP,
``E`` MoE; its length is the layer count, ``num_layers`` is ignored); ``falcon_h1`` runs attention and
Mamba2 side by side in every one of its ``num_layers`` layers.

Mamba2 configs are written for both readers (SGLang 0.5.23's own config classes in
``srt/configs/`` and transformers 5.19): every renamed key in both spellings (HF's ``n_groups``,
``conv_kernel``, ``chunk_size``, ... and SGLang's legacy ``mamba_n_groups``, ``mamba_d_conv``,
``mamba_chunk_size``, ...; SGLang sizes its state pool from one spelling and builds the mixer from the
other), Nemotron-H's blocks as ``hybrid_override_pattern`` (SGLang rejects HF's ``layers_block_type``
names), and the SSM chunk size that SGLang reads (``mamba_chunk_size``, default 64 here; SGLang's own
default 256, HF's NemotronHConfig 128). Nemotron-H's ``time_step_min`` is stored as 0 after weight
initialisation: HF clamps prefill ``dt`` at it, SGLang at 0 (``dt_limit=(0, inf)`` in
``MambaMixer2.forward``), so both then compute the same function. ``granite_moe_hybrid`` always has
one SSM group (as Granite-4.0-H: HF's gated norm is ungrouped, SGLang's per group) and
``num_experts`` routed experts of width ``moe_intermediate_size`` plus a shared MLP; ``rope_theta`` is
also written flat (SGLang's Falcon-H1 / Granite configs read it, transformers writes
``rope_parameters``). CLI: :func:`main`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GDN_ARCHS = ("qwen3_next", "qwen3_5")
MAMBA2_ARCHS = ("nemotron_h", "falcon_h1", "granite_moe_hybrid")
ARCHS = GDN_ARCHS + MAMBA2_ARCHS


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model (all arches share these knobs)."""

    hidden_size: int = 128
    num_layers: int = 4
    full_attention_interval: int = 4  # every n-th layer is attention, the rest GDN
    vocab_size: int = 4096
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    conv_kernel: int = 4
    intermediate_size: int = 256
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64
    max_position_embeddings: int = 2048
    init_std: float = 0.05
    # Mamba2 arches only (see _MAMBA2_FIELDS); d_ssm = mamba_num_heads * mamba_head_dim
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    mamba_n_groups: int = 2  # granite_moe_hybrid always uses 1 (see _build_mamba2_config)
    ssm_state_size: int = 16
    mamba_chunk_size: int = 64
    nemotron_pattern: str = "M-M*M-"


SIZES: dict[str, TinySpec] = {
    "tiny": TinySpec(),
    "bench": TinySpec(
        hidden_size=768,
        num_layers=12,
        vocab_size=32000,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=96,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=96,
        linear_value_head_dim=96,
        intermediate_size=2048,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=8192,
        init_std=0.02,
        mamba_num_heads=24,
        mamba_head_dim=64,
        mamba_n_groups=4,
        ssm_state_size=64,
        mamba_chunk_size=128,
        nemotron_pattern="M-M-M*-M-M-M*-",
    ),
}

#: TinySpec fields only the Mamba2 arches read; left out of the GDN arches' stamps, so GDN checkpoints
#: written before they existed are still recognised (their weights never depended on them).
_MAMBA2_FIELDS = frozenset(
    {
        "mamba_num_heads",
        "mamba_head_dim",
        "mamba_n_groups",
        "ssm_state_size",
        "mamba_chunk_size",
        "nemotron_pattern",
    }
)


def layer_types(spec: TinySpec) -> list[str]:
    """HF ``layer_types`` list for ``spec`` ("linear_attention" / "full_attention")."""
    n = spec.full_attention_interval
    if n < 1:
        raise ValueError(f"full_attention_interval must be >= 1, got {n}")
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(spec.num_layers)]


def _config_kwargs(spec: TinySpec) -> dict[str, Any]:
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        linear_conv_kernel_dim=spec.conv_kernel,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        layer_types=layer_types(spec),
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _mamba2_common(spec: TinySpec) -> dict[str, Any]:
    """Keys shared by the Mamba2 arches' transformers configs."""
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _build_mamba2_config(arch: str, spec: TinySpec) -> Any:
    d_ssm = spec.mamba_num_heads * spec.mamba_head_dim
    if d_ssm % spec.hidden_size:
        raise ValueError(f"mamba_num_heads * mamba_head_dim = {d_ssm} must be a multiple of hidden_size")
    expand = d_ssm // spec.hidden_size
    kw = _mamba2_common(spec)
    if arch == "nemotron_h":
        from transformers import NemotronHConfig

        cfg = NemotronHConfig(
            **kw,
            hybrid_override_pattern=spec.nemotron_pattern,
            head_dim=spec.head_dim,
            mamba_num_heads=spec.mamba_num_heads,
            mamba_head_dim=spec.mamba_head_dim,
            n_groups=spec.mamba_n_groups,
            ssm_state_size=spec.ssm_state_size,
            conv_kernel=spec.conv_kernel,
            expand=expand,
            chunk_size=spec.mamba_chunk_size,
            n_routed_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        )
        cfg.architectures = ["NemotronHForCausalLM"]
    elif arch == "falcon_h1":
        from transformers import FalconH1Config

        cfg = FalconH1Config(
            **kw,
            num_hidden_layers=spec.num_layers,
            head_dim=spec.head_dim,
            mamba_d_ssm=d_ssm,
            mamba_n_heads=spec.mamba_num_heads,
            mamba_d_head=spec.mamba_head_dim,
            mamba_n_groups=spec.mamba_n_groups,
            mamba_d_state=spec.ssm_state_size,
            mamba_d_conv=spec.conv_kernel,
            mamba_expand=expand,
            mamba_chunk_size=spec.mamba_chunk_size,
        )
        cfg.architectures = ["FalconH1ForCausalLM"]
    elif arch == "granite_moe_hybrid":
        from transformers import GraniteMoeHybridConfig

        kinds = ["attention" if kind == "full_attention" else "mamba" for kind in layer_types(spec)]
        # One group, as in the Granite-4.0-H checkpoints: HF's Granite gated norm is ungrouped while
        # SGLang's (Mixer2RMSNormGated) normalises per group, so the two agree only at one group.
        cfg = GraniteMoeHybridConfig(
            **kw,
            num_hidden_layers=spec.num_layers,
            layer_types=kinds,
            position_embedding_type="rope",
            mamba_n_heads=spec.mamba_num_heads,
            mamba_d_head=spec.mamba_head_dim,
            mamba_n_groups=1,
            mamba_d_state=spec.ssm_state_size,
            mamba_d_conv=spec.conv_kernel,
            mamba_expand=expand,
            mamba_chunk_size=spec.mamba_chunk_size,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            shared_intermediate_size=spec.shared_expert_intermediate_size,
        )
        cfg.intermediate_size = spec.moe_intermediate_size  # the routed experts' width in Granite
        cfg.architectures = ["GraniteMoeHybridForCausalLM"]
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    cfg.dtype = "float32"
    return cfg


#: (transformers key, SGLang 0.5.23 legacy key) pairs of Nemotron-H configs; both are written.
_NEMOTRON_H_KEY_PAIRS = (
    ("n_groups", "mamba_n_groups"),
    ("conv_kernel", "mamba_d_conv"),
    ("expand", "mamba_expand"),
    ("chunk_size", "mamba_chunk_size"),
    ("use_conv_bias", "mamba_conv_bias"),
    ("time_step_min", "mamba_dt_min"),
    ("time_step_max", "mamba_dt_max"),
    ("time_step_limit", "mamba_dt_limit"),
    ("time_step_floor", "mamba_dt_init_floor"),
)


def _sglang_compatible_config(arch: str, cfg: dict[str, Any], spec: TinySpec) -> dict[str, Any]:
    """The saved ``config.json`` of a Mamba2 arch, made readable by SGLang 0.5.23 as well (see the
    module docstring). Pure function of its arguments."""
    out = dict(cfg)
    out["mamba_chunk_size"] = spec.mamba_chunk_size
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]  # SGLang's FalconH1 / Granite configs read this key
    if arch == "nemotron_h":
        out["time_step_min"] = 0.0
        out.pop("layers_block_type", None)
        out.pop("layer_types", None)
        out["hybrid_override_pattern"] = spec.nemotron_pattern
        for hf_key, legacy in _NEMOTRON_H_KEY_PAIRS:
            out[legacy] = out[hf_key]
    return out


def build_config(arch: str, spec: TinySpec) -> Any:
    """The transformers config object for ``arch`` with the shapes of ``spec``."""
    if arch in MAMBA2_ARCHS:
        return _build_mamba2_config(arch, spec)
    kw = _config_kwargs(spec)
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(
            **kw,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        cfg.architectures = ["Qwen3NextForCausalLM"]
    elif arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**kw)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    cfg.dtype = "float32"
    # SGLang reads the hybrid pattern from this key (HF pops it in __post_init__), so store it.
    cfg.full_attention_interval = spec.full_attention_interval
    return cfg


def _build_tokenizer(vocab_size: int) -> Any:
    """A deterministic word-level tokenizer: ``<pad> <s> </s> <unk>`` then ``w4 .. w{V-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3_next",
    size: str = "tiny",
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random-weight ``arch`` checkpoint + tokenizer to ``out_dir`` and return the path.

    ``overrides`` replace fields of the ``size`` preset (see :class:`TinySpec`), e.g.
    ``hidden_size=256, num_layers=8, full_attention_interval=4``. Idempotent: if ``out_dir`` already
    holds a checkpoint written with the same arguments, it is reused."""
    import torch

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    spec = TinySpec(**{**SIZES[size].__dict__, **overrides})
    out = Path(out_dir)
    stamp_spec = {k: v for k, v in spec.__dict__.items() if arch in MAMBA2_ARCHS or k not in _MAMBA2_FIELDS}
    stamp = {"arch": arch, "size": size, "seed": seed, "spec": stamp_spec, "torch": torch.__version__}
    stamp_path = out / "sglang_sparse_tiny.json"
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)

    cfg = build_config(arch, spec)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    if arch in MAMBA2_ARCHS:
        cfg_path = out / "config.json"
        saved = json.loads(cfg_path.read_text())
        cfg_path.write_text(
            json.dumps(_sglang_compatible_config(arch, saved, spec), indent=2, sort_keys=True)
        )
    _build_tokenizer(spec.vocab_size).save_pretrained(out)
    stamp_path.write_text(json.dumps(stamp, indent=1, sort_keys=True))
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: ``python -m sglang_sparse.models.tiny --out DIR``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--arch", default="qwen3_next", choices=ARCHS)
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--full-attention-interval", type=int, help="every n-th layer is attention")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--nemotron-pattern", help="nemotron_h blocks: M mamba2, * attention, - mlp, E moe")
    ap.add_argument("--mamba-chunk-size", type=int, help="Mamba2 SSM chunk size (a power of two)")
    args = ap.parse_args(argv)
    overrides = {
        k: v
        for k, v in dict(
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            full_attention_interval=args.full_attention_interval,
            vocab_size=args.vocab_size,
            nemotron_pattern=args.nemotron_pattern,
            mamba_chunk_size=args.mamba_chunk_size,
        ).items()
        if v is not None
    }
    path = make_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed, **overrides)
    print(path)


if __name__ == "__main__":
    main()

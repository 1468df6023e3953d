"""Tiny random-weight hybrid (GatedDeltaNet + attention) checkpoints for CPU serving tests.

``make_tiny_model`` writes a HF checkpoint (config, safetensors weights, generation config) plus a
small local word-level tokenizer into ``out_dir``; nothing is downloaded. Weights are drawn from a
seeded generator, so the same arguments give byte-identical weights on the same torch version.

Sizes (:data:`SIZES`): ``tiny`` (default) starts in seconds, for the serving tests; ``bench``
(hidden 768, 12 layers) is where prefill dominates, for ``benchmarks/prefill_cpu.py``.

Layer pattern: every ``full_attention_interval``-th layer is full attention, the others are GDN
(linear attention), e.g. interval 4 gives ``L L L A``. SGLang 0.5.23's Qwen3-Next config derives
the pattern from ``full_attention_interval`` only (it ignores HF's ``layer_types``), so arbitrary
patterns are not offered; both keys are written consistently. CLI: :func:`main`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHS = ("qwen3_next", "qwen3_5")


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
    ),
}


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


def build_config(arch: str, spec: TinySpec) -> Any:
    """The transformers config object for ``arch`` with the shapes of ``spec``."""
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
    spec = TinySpec(**{**SIZES[size].__dict__, **overrides})
    out = Path(out_dir)
    stamp = {"arch": arch, "size": size, "seed": seed, "spec": spec.__dict__, "torch": torch.__version__}
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
    args = ap.parse_args(argv)
    overrides = {
        k: v
        for k, v in dict(
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            full_attention_interval=args.full_attention_interval,
            vocab_size=args.vocab_size,
        ).items()
        if v is not None
    }
    path = make_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed, **overrides)
    print(path)


if __name__ == "__main__":
    main()

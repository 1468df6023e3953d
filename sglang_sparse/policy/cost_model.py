"""FLOP and byte cost model for hybrid attention + recurrent (GatedDeltaNet / Mamba2) LLMs.

Built from an HF-style ``config.json`` dict by :meth:`ModelCostModel.from_hf_config`. Supported
``model_type`` values: ``qwen3_next``, ``qwen3_5`` / ``qwen3_5_text`` (text config may be nested under
``text_config``), ``qwen3_5_moe`` / ``qwen3_5_moe_text`` and ``nemotron_h``. An unknown ``model_type``
falls back to the Qwen-style parser when the config has ``linear_num_value_heads`` and to the
Nemotron-H parser when it has ``hybrid_override_pattern``; otherwise a :class:`ValueError` names it.

Units: token counts are plain ints, memory is in **bytes**, compute is in **FLOPs** (one multiply
and one add count as 2 FLOPs). All FLOP counts are forward-only (inference prefill).

Notation
--------
``h`` hidden size; ``Hq``/``Hkv``/``D`` attention query heads / KV heads / head dim; ``Hk``/``Hv``/``K``/``V``
GDN key heads / value heads / key head dim / value head dim; ``Hm``/``P``/``N``/``G`` Mamba2 heads /
head dim / state size / groups; ``I = Hm*P`` Mamba2 inner size; ``W`` conv kernel width; ``F`` dense MLP
intermediate size; ``E``/``k``/``Fe``/``Fs`` MoE experts / experts per token / expert and shared
expert intermediate sizes. ``ctx_i = past + i + 1`` is the causal context length of the i-th new token.

Per-layer, per-token FLOPs (linear layers cost ``2 * params`` per token)
-----------------------------------------------------------------------

=============  ====================================================  ================================
block          linear params per token (FLOPs = 2 * params)          other FLOPs per token
=============  ====================================================  ================================
attention      ``h*g*Hq*D + 2*h*Hkv*D + Hq*D*h`` (g=2: output gate)  ``4*Hq*D*ctx_i`` (QK^T + PV)
GatedDeltaNet  ``h*(2*Hk*K + 2*Hv*V + 2*Hv) + Hv*V*h``               conv ``2*C*W``, C=2*Hk*K+Hv*V;
               (in_proj qkvz + b/a, out_proj)                        core ``7*Hv*K*V``
Mamba2 (SSD)   ``h*(2*I + 2*G*N + Hm) + I*h``                        conv ``2*C*W``, C=I+2*G*N;
               (in_proj z,x,B,C,dt + out_proj)                       core ``5*Hm*P*N``
dense MLP      ``3*h*F`` gated (SwiGLU, Qwen) / ``2*h*F`` (relu2)    --
MoE            ``h*E + k*m*h*Fe + m*h*Fs`` (+ ``h`` shared gate)     --
               router + top-k experts + shared; m=3 gated, 2 not
=============  ====================================================  ================================

Recurrent core counts (recurrent form, per token per head; the chunked kernels do the same O(K*V)
work plus O(chunk) intra-chunk terms that are ignored here):

* GatedDeltaNet: decay ``g*S`` (K*V) + retrieve ``S^T k`` (2*K*V) + rank-1 update ``k (x) delta``
  (2*K*V) + readout ``S^T q`` (2*K*V) = ``7*K*V``.
* Mamba2: decay ``dA*h`` (P*N) + update ``(dt*x) (x) B`` (2*P*N) + readout ``C*h`` (2*P*N) = ``5*P*N``.

Summed over the ``n`` new tokens after ``past`` cached ones, the attention context term is
``4*Hq*D * (n*past + n*(n+1)/2)`` per attention layer, so ``prefill_flops`` is exactly additive:
``prefill_flops(a) + prefill_flops(b, past_tokens=a) == prefill_flops(a + b)``.

Not counted: embeddings and ``lm_head`` (the engine computes logits for the last prefill token only,
independent of cache hits), norms, RoPE, softmax, activations, gating elementwise ops, MTP layers.

Memory
------
* ``kv_bytes_per_token = 2 * Hkv * D * kv_dtype_bytes * n_attention_layers``.
* ``state_bytes`` (one recurrent checkpoint, all recurrent layers) = ``n_recurrent_layers *
  (ssm_elems * ssm_dtype_bytes + conv_elems * conv_dtype_bytes)`` with GDN ``ssm_elems = Hv*K*V``,
  Mamba2 ``ssm_elems = Hm*P*N`` and ``conv_elems = C*(W-1)`` (SGLang stores W-1 conv taps). Defaults
  follow SGLang: SSM state float32 unless the config sets ``mamba_ssm_dtype``; conv state bfloat16;
  KV in the model dtype.

Resume semantics and Marconi
----------------------------
When the engine matches KV up to depth ``d`` but the deepest recurrent checkpoint is at ``c < d``
(SGLang ``MambaComponent`` semantics), it re-prefills tokens ``c..d`` through **all** layers;
attention reuses KV only up to ``c``. Hence ``resume_recompute_flops(c, d) = prefill_flops(d - c,
past_tokens=c)``. :meth:`ModelCostModel.recurrent_flops` is only the context-independent part
(recurrent layers + all MLPs), a lower bound on that recompute.

Marconi's reference implementation (``radix_cache_hybrid.py``) computes a node's MLP savings as
``mlp(total) - attn(parent)`` and charges the node the KV of its *whole path*. Here node savings are
``prefill_flops(node - fallback, past_tokens=fallback)`` (every block, with the right terms) and a node
is charged only the KV of its *own* tokens plus its checkpoint (:meth:`ModelCostModel.node_bytes`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "AttentionSpec",
    "GatedDeltaNetSpec",
    "Mamba2Spec",
    "MLPSpec",
    "ModelCostModel",
    "dtype_bytes",
]

#: FLOPs per token per head per (K*V) element of the GatedDeltaNet recurrence (see module docstring).
GDN_CORE_FLOPS_PER_STATE_ELEM = 7
#: FLOPs per token per head per (P*N) element of the Mamba2 recurrence (see module docstring).
MAMBA2_CORE_FLOPS_PER_STATE_ELEM = 5

_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

_QWEN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_NEMOTRON_TYPES = ("nemotron_h",)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = _QWEN_TYPES + _NEMOTRON_TYPES


def dtype_bytes(name: str, *, key: str = "dtype") -> int:
    """Bytes per element of a dtype name such as ``"bfloat16"`` or ``"torch.float32"``.

    Raises ValueError naming ``key`` (the config key it came from) for an unknown name.
    """
    norm = str(name).lower().removeprefix("torch.")
    if norm not in _DTYPE_BYTES:
        raise ValueError(f"config key '{key}': unknown dtype {name!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[norm]


def _count(x: Any, what: str) -> int:
    """Validate a non-negative integer token count (accepts numpy ints, rejects floats/bools)."""
    if isinstance(x, bool):
        raise TypeError(f"{what} must be an integer, got bool")
    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(x).__name__}") from None
    if v < 0:
        raise ValueError(f"{what} must be >= 0, got {v}")
    return v


# --------------------------------------------------------------------------------------------------
# Block specs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionSpec:
    """Full (softmax, GQA) attention blocks; ``num_layers`` identical layers."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    output_gate: bool = False  # Qwen3-Next / Qwen3.5: q_proj also emits a sigmoid gate of size Hq*D

    def linear_params(self, hidden: int) -> int:
        """Weights (elements) of q/k/v/o projections of ONE layer (== MACs per token)."""
        q_out = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        kv_out = 2 * self.num_kv_heads * self.head_dim
        o_in = self.num_heads * self.head_dim
        return hidden * (q_out + kv_out) + o_in * hidden

    def context_flops(self, n_tokens: int, past_tokens: int) -> int:
        """QK^T + PV FLOPs of ONE layer for ``n_tokens`` new tokens after ``past_tokens`` cached ones.

        ``sum_{i<n} 4*Hq*D*(past+i+1) = 4*Hq*D*(n*past + n*(n+1)/2)``.
        """
        ctx_sum = n_tokens * past_tokens + n_tokens * (n_tokens + 1) // 2
        return 4 * self.num_heads * self.head_dim * ctx_sum

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements cached per token for ONE layer."""
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """GatedDeltaNet (Qwen3-Next / Qwen3.5 ``linear_attention``) blocks; ``num_layers`` identical layers."""

    num_layers: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    kind = "gated_deltanet"

    @property
    def key_dim(self) -> int:
        """``Hk * K``."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """``Hv * V``."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal depthwise conv over q, k, v: ``2*Hk*K + Hv*V``."""
        return 2 * self.key_dim + self.value_dim

    def linear_params(self, hidden: int) -> int:
        """in_proj_qkvz + in_proj_ba + out_proj weights of ONE layer."""
        in_out = 2 * self.key_dim + 2 * self.value_dim + 2 * self.num_value_heads
        return hidden * in_out + self.value_dim * hidden

    def nonlinear_flops_per_token(self) -> int:
        """Conv (``2*C*W``) + delta-rule core (``7*Hv*K*V``) FLOPs of ONE layer per token."""
        conv = 2 * self.conv_dim * self.conv_kernel
        core = GDN_CORE_FLOPS_PER_STATE_ELEM * self.num_value_heads * self.key_head_dim * self.value_head_dim
        return conv + core

    @property
    def ssm_state_elements(self) -> int:
        """Recurrent state elements of ONE layer: ``Hv*K*V``."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    @property
    def conv_state_elements(self) -> int:
        """Conv state elements of ONE layer: ``C*(W-1)``."""
        return self.conv_dim * (self.conv_kernel - 1)


@dataclass(frozen=True)
class Mamba2Spec:
    """Mamba2 (SSD) mixer blocks; ``num_layers`` identical layers."""

    num_layers: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int

    kind = "mamba2"

    @property
    def inner_size(self) -> int:
        """``I = Hm * P`` (== ``expand * hidden`` in the public configs)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal depthwise conv over x, B, C: ``I + 2*G*N``."""
        return self.inner_size + 2 * self.n_groups * self.state_size

    def linear_params(self, hidden: int) -> int:
        """in_proj (z, x, B, C, dt) + out_proj weights of ONE layer."""
        in_out = 2 * self.inner_size + 2 * self.n_groups * self.state_size + self.num_heads
        return hidden * in_out + self.inner_size * hidden

    def nonlinear_flops_per_token(self) -> int:
        """Conv (``2*C*W``) + SSD core (``5*Hm*P*N``) FLOPs of ONE layer per token."""
        conv = 2 * self.conv_dim * self.conv_kernel
        core = MAMBA2_CORE_FLOPS_PER_STATE_ELEM * self.num_heads * self.head_dim * self.state_size
        return conv + core

    @property
    def ssm_state_elements(self) -> int:
        """Recurrent state elements of ONE layer: ``Hm*P*N``."""
        return self.num_heads * self.head_dim * self.state_size

    @property
    def conv_state_elements(self) -> int:
        """Conv state elements of ONE layer: ``C*(W-1)``."""
        return self.conv_dim * (self.conv_kernel - 1)


@dataclass(frozen=True)
class MLPSpec:
    """Dense MLP (``num_experts == 0``) or MoE block; ``num_layers`` identical layers.

    ``gated`` selects SwiGLU-style (gate, up, down: 3 matrices) vs. plain up/down (2 matrices).
    Only *active* parameters count: router, top-k routed experts, shared expert (+ its gate).
    """

    num_layers: int
    gated: bool
    intermediate_size: int = 0  # dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts block."""
        return self.num_experts > 0

    def active_params(self, hidden: int) -> int:
        """Weights touched per token by ONE layer (== MACs per token)."""
        mats = 3 if self.gated else 2
        if not self.is_moe:
            return mats * hidden * self.intermediate_size
        router = hidden * self.num_experts
        routed = self.experts_per_token * mats * hidden * self.expert_intermediate_size
        shared = mats * hidden * self.shared_expert_intermediate_size
        gate = hidden if (self.shared_expert_gate and self.shared_expert_intermediate_size > 0) else 0
        return router + routed + shared + gate


RecurrentSpec = GatedDeltaNetSpec | Mamba2Spec


# --------------------------------------------------------------------------------------------------
# Config parsing helpers
# --------------------------------------------------------------------------------------------------


def _req_int(cfg: Mapping[str, Any], key: str, where: str, *, minimum: int = 1) -> int:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{where} config is missing required key '{key}'")
    val = cfg[key]
    if isinstance(val, bool) or not isinstance(val, int):
        raise ValueError(f"{where} config key '{key}' must be an integer, got {val!r}")
    if val < minimum:
        raise ValueError(f"{where} config key '{key}' must be >= {minimum}, got {val}")
    return val


def _opt_int(cfg: Mapping[str, Any], key: str, where: str, default: int, *, minimum: int = 0) -> int:
    if cfg.get(key) is None:
        return default
    return _req_int(cfg, key, where, minimum=minimum)


def _attn_head_dim(cfg: Mapping[str, Any], where: str, hidden: int, heads: int) -> int:
    for key in ("head_dim", "attention_head_dim"):
        if cfg.get(key) is not None:
            return _req_int(cfg, key, where)
    if hidden % heads:
        raise ValueError(f"{where} config has no 'head_dim' and hidden_size % num_attention_heads != 0")
    return hidden // heads


def _qwen_layer_types(cfg: Mapping[str, Any], n_layers: int, where: str) -> list[str]:
    """Per-layer mixer kinds ("attention" | "recurrent") from layer_types or full_attention_interval."""
    if cfg.get("layer_types") is not None:
        raw = cfg["layer_types"]
        if not isinstance(raw, list | tuple) or len(raw) != n_layers:
            raise ValueError(
                f"{where} config key 'layer_types' must be a list of num_hidden_layers={n_layers} entries"
            )
        out = []
        for i, t in enumerate(raw):
            if t == "full_attention":
                out.append("attention")
            elif t == "linear_attention":
                out.append("recurrent")
            else:
                raise ValueError(
                    f"{where} config key 'layer_types'[{i}] = {t!r}; expected 'full_attention' "
                    "or 'linear_attention'"
                )
        return out
    if cfg.get("full_attention_interval") is None:
        raise ValueError(f"{where} config needs 'layer_types' or 'full_attention_interval'")
    interval = _req_int(cfg, "full_attention_interval", where)
    return ["attention" if (i + 1) % interval == 0 else "recurrent" for i in range(n_layers)]


def _model_dtype_bytes(cfg: Mapping[str, Any], outer: Mapping[str, Any]) -> int:
    for src in (cfg, outer):
        for key in ("torch_dtype", "dtype"):
            if src.get(key) is not None:
                return dtype_bytes(src[key], key=key)
    return 2  # bfloat16, the dtype of every public hybrid checkpoint this targets


def _ssm_dtype_bytes(cfg: Mapping[str, Any], outer: Mapping[str, Any]) -> int:
    for src in (cfg, outer):
        if src.get("mamba_ssm_dtype") is not None:
            return dtype_bytes(src["mamba_ssm_dtype"], key="mamba_ssm_dtype")
    return 4  # SGLang default SGLANG_MAMBA_SSM_DTYPE=float32


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCostModel:
    """FLOP / byte cost model of one hybrid model (see the module docstring for every formula).

    ``layer_kinds`` lists, per decoder layer, its sequence mixer: ``"attention"``, ``"recurrent"`` or
    ``"mlp"`` (Nemotron-H layers that are only an MLP/MoE block).
    """

    model_type: str
    hidden_size: int
    layer_kinds: tuple[str, ...]
    attention: AttentionSpec | None
    recurrent: RecurrentSpec | None
    mlps: tuple[MLPSpec, ...]
    kv_dtype_bytes: int = 2
    ssm_dtype_bytes: int = 4
    conv_dtype_bytes: int = 2

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_hf_config(
        cls,
        cfg: Mapping[str, Any],
        *,
        state_dtype_bytes: int | None = None,
        kv_dtype_bytes: int | None = None,
        conv_dtype_bytes: int | None = None,
    ) -> ModelCostModel:
        """Build from an HF ``config.json`` dict.

        ``state_dtype_bytes`` overrides the bytes per SSM (temporal) state element (default: config
        ``mamba_ssm_dtype`` or 4 = float32, SGLang's default); ``conv_dtype_bytes`` the conv state
        (default 2 = bfloat16, SGLang's default); ``kv_dtype_bytes`` the KV cache (default: model dtype).
        Raises ValueError naming an unsupported ``model_type`` or a missing/invalid key.
        """
        if not isinstance(cfg, Mapping):
            raise TypeError(f"config must be a mapping, got {type(cfg).__name__}")
        outer = cfg
        text = cfg.get("text_config")
        if isinstance(text, Mapping):
            cfg = text
        model_type = cfg.get("model_type") or outer.get("model_type")
        if model_type is None:
            raise ValueError("config is missing required key 'model_type'")
        if model_type in _QWEN_TYPES or (
            model_type not in _NEMOTRON_TYPES and "linear_num_value_heads" in cfg
        ):
            model = cls._from_qwen_hybrid(cfg, str(model_type))
        elif model_type in _NEMOTRON_TYPES or "hybrid_override_pattern" in cfg:
            model = cls._from_nemotron_h(cfg, str(model_type))
        else:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(or any config with 'linear_num_value_heads' or 'hybrid_override_pattern')"
            )
        model_bytes = _model_dtype_bytes(cfg, outer)
        ssm_bytes = _ssm_dtype_bytes(cfg, outer) if state_dtype_bytes is None else state_dtype_bytes
        for name, val in (
            ("state_dtype_bytes", state_dtype_bytes),
            ("kv_dtype_bytes", kv_dtype_bytes),
            ("conv_dtype_bytes", conv_dtype_bytes),
        ):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        return replace(
            model,
            kv_dtype_bytes=model_bytes if kv_dtype_bytes is None else kv_dtype_bytes,
            ssm_dtype_bytes=ssm_bytes,
            conv_dtype_bytes=2 if conv_dtype_bytes is None else conv_dtype_bytes,
        )

    @classmethod
    def _from_qwen_hybrid(cls, cfg: Mapping[str, Any], model_type: str) -> ModelCostModel:
        where = model_type
        h = _req_int(cfg, "hidden_size", where)
        n_layers = _req_int(cfg, "num_hidden_layers", where)
        kinds = _qwen_layer_types(cfg, n_layers, where)
        n_attn = kinds.count("attention")
        n_rec = kinds.count("recurrent")
        attention = None
        if n_attn:
            heads = _req_int(cfg, "num_attention_heads", where)
            attention = AttentionSpec(
                num_layers=n_attn,
                num_heads=heads,
                num_kv_heads=_req_int(cfg, "num_key_value_heads", where),
                head_dim=_attn_head_dim(cfg, where, h, heads),
                output_gate=bool(cfg.get("attn_output_gate", True)),  # always on in Qwen3-Next
            )
        recurrent = None
        if n_rec:
            recurrent = GatedDeltaNetSpec(
                num_layers=n_rec,
                num_key_heads=_req_int(cfg, "linear_num_key_heads", where),
                num_value_heads=_req_int(cfg, "linear_num_value_heads", where),
                key_head_dim=_req_int(cfg, "linear_key_head_dim", where),
                value_head_dim=_req_int(cfg, "linear_value_head_dim", where),
                conv_kernel=_req_int(cfg, "linear_conv_kernel_dim", where),
            )
        # MLP placement follows HF Qwen3-Next: MoE iff layer not in mlp_only_layers, num_experts > 0 and
        # (layer + 1) % decoder_sparse_step == 0; otherwise a dense SwiGLU MLP of intermediate_size.
        num_experts = _opt_int(cfg, "num_experts", where, 0)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        step = _opt_int(cfg, "decoder_sparse_step", where, 1, minimum=1)
        n_moe = sum(
            1 for i in range(n_layers) if num_experts > 0 and i not in mlp_only and (i + 1) % step == 0
        )
        n_dense = n_layers - n_moe
        mlps: list[MLPSpec] = []
        if n_dense:
            dense_f = _req_int(cfg, "intermediate_size", where)
            mlps.append(MLPSpec(num_layers=n_dense, gated=True, intermediate_size=dense_f))
        if n_moe:
            mlps.append(
                MLPSpec(
                    num_layers=n_moe,
                    gated=True,
                    num_experts=num_experts,
                    experts_per_token=_req_int(cfg, "num_experts_per_tok", where),
                    expert_intermediate_size=_req_int(cfg, "moe_intermediate_size", where),
                    shared_expert_intermediate_size=_opt_int(
                        cfg, "shared_expert_intermediate_size", where, 0
                    ),
                    shared_expert_gate=True,
                )
            )
        return cls(
            model_type=model_type,
            hidden_size=h,
            layer_kinds=tuple(kinds),
            attention=attention,
            recurrent=recurrent,
            mlps=tuple(mlps),
        )

    @classmethod
    def _from_nemotron_h(cls, cfg: Mapping[str, Any], model_type: str) -> ModelCostModel:
        where = model_type
        h = _req_int(cfg, "hidden_size", where)
        pattern = cfg.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{where} config is missing required key 'hybrid_override_pattern'")
        bad = sorted(set(pattern) - set("M*-E"))
        if bad:
            raise ValueError(f"{where} config key 'hybrid_override_pattern' has unknown symbols {bad}")
        n_layers = _opt_int(cfg, "num_hidden_layers", where, len(pattern), minimum=1)
        if n_layers != len(pattern):
            raise ValueError(
                f"{where} config key 'hybrid_override_pattern' has {len(pattern)} symbols but "
                f"num_hidden_layers={n_layers}"
            )
        kind_of = {"M": "recurrent", "*": "attention", "-": "mlp", "E": "mlp"}
        attention = None
        if "*" in pattern:
            heads = _req_int(cfg, "num_attention_heads", where)
            attention = AttentionSpec(
                num_layers=pattern.count("*"),
                num_heads=heads,
                num_kv_heads=_req_int(cfg, "num_key_value_heads", where),
                head_dim=_attn_head_dim(cfg, where, h, heads),
                output_gate=False,
            )
        recurrent = None
        if "M" in pattern:
            # Inner size is mamba_num_heads * mamba_head_dim (as in HF/SGLang); `expand` is not needed.
            recurrent = Mamba2Spec(
                num_layers=pattern.count("M"),
                num_heads=_req_int(cfg, "mamba_num_heads", where),
                head_dim=_req_int(cfg, "mamba_head_dim", where),
                state_size=_req_int(cfg, "ssm_state_size", where),
                n_groups=_req_int(cfg, "n_groups", where),
                conv_kernel=_req_int(cfg, "conv_kernel", where),
            )
        mlps: list[MLPSpec] = []
        if "-" in pattern:  # relu2 MLP: up + down (not gated)
            mlps.append(
                MLPSpec(
                    num_layers=pattern.count("-"),
                    gated=False,
                    intermediate_size=_req_int(cfg, "intermediate_size", where),
                )
            )
        if "E" in pattern:  # relu2 experts (not gated), no shared-expert gate
            mlps.append(
                MLPSpec(
                    num_layers=pattern.count("E"),
                    gated=False,
                    num_experts=_req_int(cfg, "n_routed_experts", where),
                    experts_per_token=_req_int(cfg, "num_experts_per_tok", where),
                    expert_intermediate_size=_req_int(cfg, "moe_intermediate_size", where),
                    shared_expert_intermediate_size=_opt_int(
                        cfg, "moe_shared_expert_intermediate_size", where, 0
                    ),
                    shared_expert_gate=False,
                )
            )
        return cls(
            model_type=model_type,
            hidden_size=h,
            layer_kinds=tuple(kind_of[c] for c in pattern),
            attention=attention,
            recurrent=recurrent,
            mlps=tuple(mlps),
        )

    # ---------------------------------------------------------------- structure

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layer_kinds)

    @property
    def num_attention_layers(self) -> int:
        """Layers holding a KV cache."""
        return self.attention.num_layers if self.attention else 0

    @property
    def num_recurrent_layers(self) -> int:
        """Layers holding a recurrent (SSM + conv) state."""
        return self.recurrent.num_layers if self.recurrent else 0

    # ---------------------------------------------------------------- memory (bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all attention layers: ``2*Hkv*D*kv_dtype_bytes*n_attn``."""
        if self.attention is None:
            return 0
        return self.attention.kv_elements_per_token * self.kv_dtype_bytes * self.attention.num_layers

    @property
    def ssm_state_bytes(self) -> int:
        """Bytes of the SSM (temporal) part of ONE checkpoint, all recurrent layers."""
        if self.recurrent is None:
            return 0
        return self.recurrent.ssm_state_elements * self.ssm_dtype_bytes * self.recurrent.num_layers

    @property
    def conv_state_bytes(self) -> int:
        """Bytes of the conv part of ONE checkpoint, all recurrent layers."""
        if self.recurrent is None:
            return 0
        return self.recurrent.conv_state_elements * self.conv_dtype_bytes * self.recurrent.num_layers

    @property
    def state_bytes(self) -> int:
        """Bytes of ONE recurrent checkpoint across all recurrent layers (SSM state + conv state)."""
        return self.ssm_state_bytes + self.conv_state_bytes

    def node_bytes(self, n_kv_tokens: int, *, has_checkpoint: bool = True) -> int:
        """Bytes a radix node holds: KV of its OWN ``n_kv_tokens`` tokens (+ one checkpoint if it has one).

        Unlike Marconi, the KV of ancestors is not charged: evicting the node does not free it.
        """
        n = _count(n_kv_tokens, "n_kv_tokens")
        return n * self.kv_bytes_per_token + (self.state_bytes if has_checkpoint else 0)

    # ---------------------------------------------------------------- compute (FLOPs)

    def _by_kind_int(self, n: int, past: int) -> dict[str, int]:
        h = self.hidden_size
        attn = 0
        if self.attention is not None and n:
            a = self.attention
            attn = a.num_layers * (2 * a.linear_params(h) * n + a.context_flops(n, past))
        rec = 0
        if self.recurrent is not None:
            r = self.recurrent
            rec = r.num_layers * n * (2 * r.linear_params(h) + r.nonlinear_flops_per_token())
        mlp = sum(m.num_layers * 2 * m.active_params(h) for m in self.mlps) * n
        return {"attention": attn, "recurrent": rec, "mlp": mlp}

    def prefill_flops_by_kind(self, n_tokens: int, past_tokens: int = 0) -> dict[str, float]:
        """FLOPs to prefill ``n_tokens`` new tokens after ``past_tokens`` cached tokens, by block kind.

        Keys: ``"attention"`` (attention layers: projections + QK^T/PV over the causal context),
        ``"recurrent"`` (GDN/Mamba2 layers: projections + conv + recurrence), ``"mlp"`` (dense MLP and
        active MoE parameters of all layers). Embeddings and lm_head are excluded.
        """
        n = _count(n_tokens, "n_tokens")
        past = _count(past_tokens, "past_tokens")
        return {k: float(v) for k, v in self._by_kind_int(n, past).items()}

    def prefill_flops(self, n_tokens: int, past_tokens: int = 0) -> float:
        """Total FLOPs to prefill ``n_tokens`` new tokens after ``past_tokens`` cached tokens.

        Exactly additive: ``prefill_flops(a) + prefill_flops(b, a) == prefill_flops(a + b)``.
        """
        n = _count(n_tokens, "n_tokens")
        past = _count(past_tokens, "past_tokens")
        return float(sum(self._by_kind_int(n, past).values()))

    def recurrent_flops(self, n_tokens: int) -> float:
        """Context-independent FLOPs for ``n_tokens`` tokens: recurrent layers (projections, conv, core)
        plus the MLP/MoE blocks of ALL layers. Attention layers are excluded entirely.

        This is a lower bound on resuming from a checkpoint ``n_tokens`` back; the engine's actual cost,
        which also re-runs the attention layers, is :meth:`resume_recompute_flops`.
        """
        n = _count(n_tokens, "n_tokens")
        parts = self._by_kind_int(n, 0)
        return float(parts["recurrent"] + parts["mlp"])

    def resume_recompute_flops(self, checkpoint_depth: int, matched_depth: int) -> float:
        """FLOPs to resume from a recurrent checkpoint at ``checkpoint_depth`` tokens when the radix match
        (KV) reaches ``matched_depth`` tokens.

        SGLang ``MambaComponent`` semantics: the prefix is usable only up to the checkpoint, so tokens
        ``checkpoint_depth..matched_depth`` are re-prefilled through ALL layers, attention attending to
        the ``checkpoint_depth`` cached tokens: ``prefill_flops(d - c, past_tokens=c)``.
        """
        c = _count(checkpoint_depth, "checkpoint_depth")
        d = _count(matched_depth, "matched_depth")
        if c > d:
            raise ValueError(f"checkpoint_depth ({c}) must be <= matched_depth ({d})")
        return self.prefill_flops(d - c, past_tokens=c)

    def flops_saved(self, prefix_len: int, resume_depth: int) -> float:
        """FLOPs a cache hit saves when a ``prefix_len``-token prefix resumes at ``resume_depth`` tokens,
        versus prefilling the prefix from scratch.

        ``prefill_flops(prefix_len) - prefill_flops(prefix_len - resume_depth, past_tokens=resume_depth)
        == prefill_flops(resume_depth)``: only the reused part counts.
        """
        p = _count(prefix_len, "prefix_len")
        r = _count(resume_depth, "resume_depth")
        if r > p:
            raise ValueError(f"resume_depth ({r}) must be <= prefix_len ({p})")
        return self.prefill_flops(r)

    def node_flops_saved(self, node_depth: int, fallback_depth: int) -> float:
        """FLOPs saved, per hit reaching ``node_depth``, by keeping a node whose checkpoint sits at
        ``node_depth``: without it the hit resumes at ``fallback_depth`` (the nearest checkpoint that
        remains, usually the parent's) and recomputes ``prefill_flops(node - fallback, past=fallback)``.
        """
        node = _count(node_depth, "node_depth")
        fb = _count(fallback_depth, "fallback_depth")
        if fb > node:
            raise ValueError(f"fallback_depth ({fb}) must be <= node_depth ({node})")
        return self.prefill_flops(node - fb, past_tokens=fb)

    def flops_saved_per_byte(
        self,
        node_depth: int,
        parent_depth: int,
        *,
        fallback_depth: int | None = None,
        has_checkpoint: bool = True,
    ) -> float:
        """Marconi-style eviction score in FLOPs per byte: FLOPs saved by keeping a node / bytes it holds.

        The node covers tokens ``[parent_depth, node_depth)``. Numerator: :meth:`node_flops_saved`
        with ``fallback_depth`` (default ``parent_depth``); zero if the node holds no checkpoint (a hit
        then cannot resume inside it). Denominator: :meth:`node_bytes` of its own
        ``node_depth - parent_depth`` tokens (+ checkpoint). Returns ``inf`` for savings with 0 bytes
        and 0.0 when both are 0.
        """
        node = _count(node_depth, "node_depth")
        parent = _count(parent_depth, "parent_depth")
        if parent > node:
            raise ValueError(f"parent_depth ({parent}) must be <= node_depth ({node})")
        fb = parent if fallback_depth is None else _count(fallback_depth, "fallback_depth")
        if fb > parent:
            raise ValueError(f"fallback_depth ({fb}) must be <= parent_depth ({parent})")
        saved = self.node_flops_saved(node, fb) if has_checkpoint else 0.0
        nbytes = self.node_bytes(node - parent, has_checkpoint=has_checkpoint)
        if nbytes == 0:
            return float("inf") if saved > 0 else 0.0
        return saved / nbytes

    def describe(self) -> str:
        """One-line human summary (layer counts, bytes)."""
        return (
            f"{self.model_type}: {self.num_layers} layers ({self.num_attention_layers} attention, "
            f"{self.num_recurrent_layers} recurrent), kv {self.kv_bytes_per_token} B/token, "
            f"state {self.state_bytes} B/checkpoint"
        )

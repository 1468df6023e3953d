"""FLOP and byte cost model for hybrid attention + recurrent (GatedDeltaNet / Mamba2) LLMs.

The formulas only: a :class:`ModelCostModel` is built from its block specs. Its inputs come from
SGLang's own config object of the served model in the adapter
(:mod:`sglang_sparse.sglang_adapter.model_cost`) and from a small table of named models for the
simulator (:data:`sglang_sparse.sim.models.MODELS`).

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

Layer layouts: a decoder layer holds one sequence mixer (attention or recurrent) plus an MLP/MoE
(Qwen3-Next, Qwen3.5, Granite-4.0-H), or only one of those blocks (Nemotron-H), or -- a *parallel*
hybrid, Falcon-H1 -- an attention AND a Mamba2 block side by side on the same input (outputs summed)
plus an MLP. Each block spec counts the layers holding that block, so a parallel layer counts once in
``attention.num_layers`` and once in ``recurrent.num_layers`` and is charged both blocks' FLOPs, KV and
state; ``layer_kinds`` (:class:`ModelCostModel`) records the layout and its counts match the specs'.

Not counted: embeddings and ``lm_head`` (the engine computes logits for the last prefill token only,
independent of cache hits), norms, RoPE, softmax, activations, gating elementwise ops, MTP layers.

Memory
------
* ``kv_bytes_per_token = 2 * Hkv * D * kv_dtype_bytes * n_attention_layers``.
* ``state_bytes`` (one recurrent checkpoint, all recurrent layers) = ``n_recurrent_layers *
  (ssm_elems * ssm_dtype_bytes + conv_elems * conv_dtype_bytes)`` with GDN ``ssm_elems = Hv*K*V``,
  Mamba2 ``ssm_elems = Hm*P*N`` and ``conv_elems = C*(W-1)`` (SGLang stores W-1 conv taps). Defaults
  follow SGLang's defaults: SSM state float32, conv state and KV bfloat16. A served model's bytes
  are not these but SGLang's pools' (the adapter reads them), which follow its dtype overrides
  (``SGLANG_MAMBA_SSM_DTYPE`` ...) and tensor-parallel sharding.

Resume semantics and Marconi
----------------------------
When the engine matches KV up to depth ``d`` but the deepest recurrent checkpoint is at ``c < d``
(SGLang ``MambaComponent`` semantics), it re-prefills tokens ``c..d`` through **all** layers;
attention reuses KV only up to ``c``: ``prefill_flops(d - c, past_tokens=c)``
(:meth:`ModelCostModel.node_flops_saved` with ``node_depth=d``, ``fallback_depth=c``).

Node savings count every block (Marconi's ``radix_cache_hybrid.py`` uses ``mlp(total) -
attn(parent)``), and a node is charged the KV of its *own* tokens plus its checkpoint (Marconi's:
its whole path's).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AttentionSpec",
    "GatedDeltaNetSpec",
    "Mamba2Spec",
    "MLPSpec",
    "NEMOTRON_H_LAYER_KINDS",
    "ModelCostModel",
]

#: FLOPs per token per head per (K*V) element of the GatedDeltaNet recurrence (see module docstring).
GDN_CORE_FLOPS_PER_STATE_ELEM = 7
#: FLOPs per token per head per (P*N) element of the Mamba2 recurrence (see module docstring).
MAMBA2_CORE_FLOPS_PER_STATE_ELEM = 5


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


class _RecurrentBlock:
    """Formulas shared by :class:`GatedDeltaNetSpec` and :class:`Mamba2Spec`."""

    def nonlinear_flops_per_token(self) -> int:
        """Conv (``2*C*W``) + core (GDN ``7*Hv*K*V``, Mamba2 ``5*Hm*P*N``) FLOPs of ONE layer per token."""
        return 2 * self.conv_dim * self.conv_kernel + self._core_flops * self.ssm_state_elements

    @property
    def conv_state_elements(self) -> int:
        """Conv state elements of ONE layer: ``C*(W-1)``."""
        return self.conv_dim * (self.conv_kernel - 1)


@dataclass(frozen=True)
class GatedDeltaNetSpec(_RecurrentBlock):
    """GatedDeltaNet (Qwen3-Next / Qwen3.5 ``linear_attention``) blocks; ``num_layers`` identical layers."""

    num_layers: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    kind = "gated_deltanet"
    _core_flops = GDN_CORE_FLOPS_PER_STATE_ELEM

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

    @property
    def ssm_state_elements(self) -> int:
        """Recurrent state elements of ONE layer: ``Hv*K*V``."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim


@dataclass(frozen=True)
class Mamba2Spec(_RecurrentBlock):
    """Mamba2 (SSD) mixer blocks; ``num_layers`` identical layers."""

    num_layers: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int

    kind = "mamba2"
    _core_flops = MAMBA2_CORE_FLOPS_PER_STATE_ELEM

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

    @property
    def ssm_state_elements(self) -> int:
        """Recurrent state elements of ONE layer: ``Hm*P*N``."""
        return self.num_heads * self.head_dim * self.state_size


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

#: Nemotron-H's ``hybrid_override_pattern`` symbol -> layer kind (``M`` Mamba2, ``*`` attention,
#: ``-`` a relu2 MLP, ``E`` relu2 experts; each symbol is one whole decoder layer)
NEMOTRON_H_LAYER_KINDS: dict[str, str] = {"M": "recurrent", "*": "attention", "-": "mlp", "E": "mlp"}


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCostModel:
    """FLOP / byte cost model of one hybrid model (see the module docstring for every formula).

    ``layer_kinds`` lists, per decoder layer, its sequence mixer: ``"attention"``, ``"recurrent"``,
    ``"parallel"`` (Falcon-H1: attention and Mamba2 side by side) or ``"mlp"`` (Nemotron-H layers that
    are only an MLP/MoE block). Invariant: ``attention.num_layers`` is the count of ``"attention"``
    plus ``"parallel"`` layers, ``recurrent.num_layers`` that of ``"recurrent"`` plus ``"parallel"``.
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
        """:meth:`prefill_flops` by block kind: ``"attention"`` (projections + QK^T/PV over the causal
        context), ``"recurrent"`` (GDN/Mamba2 projections + conv + recurrence), ``"mlp"`` (dense MLP and
        active MoE parameters of all layers)."""
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

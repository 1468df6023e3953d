"""Pure-torch CPU implementations of the ``sgl_kernel`` ops SGLang's hybrid GDN models need.

Written from the ops' semantics (not ported from sgl-kernel), for CPU-only machines where the real
``sgl_kernel`` (a CUDA build) cannot be installed. The thin ``sgl_kernel`` shim distribution in
``shim/`` exposes these under the names SGLang imports and registers the ``torch.ops.sgl_kernel.*``
ones (see :mod:`.registry`); ``tools/setup_env.sh`` installs it only when no real ``sgl_kernel`` is
importable and no CUDA device is visible.

Modules: :mod:`.conv` (causal conv1d prefill/decode), :mod:`.gating` (GDN gates),
:mod:`.delta_rule` (chunked prefill of the gated delta rule returning the per-chunk states ``h``;
the token-by-token recurrence on slot-indexed states: decode and capture tails), :mod:`.norm`
(gated RMSNorm), :mod:`.kv_copy` (per-layer KV row moves), :mod:`.token_pool` (req->token table
writes), :mod:`.registry` (``torch.ops.sgl_kernel.*`` registration), :mod:`.sglang_cpu_plugin`
(routes the two non-AMX Triton-only paths of SGLang 0.5.23 to these ops; input-id guard),
:mod:`.sglang_platform` (opt-in out-of-tree SGLang CPU platform with Mamba ``extra_buffer``
support), :mod:`.mamba_track` (torch decode-state tracking copies for ``extra_buffer``), :mod:`.mamba2`
(Mamba2 / SSD: causal conv wrappers, the chunked scan with SGLang's per-chunk and tracked states,
the decode state update; routed into SGLang's ``MambaMixer2`` by the CPU plugin).
"""

from .conv import causal_conv1d_fwd, causal_conv1d_update
from .delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
    fused_sigmoid_gating_delta_rule_update,
    l2norm,
)
from .gating import fused_gdn_gating, gdn_gates
from .kv_copy import copy_all_layer_kv_cache
from .norm import fused_rmsnorm_gated, rmsnorm
from .token_pool import assign_req_to_token_pool

__all__ = [
    "assign_req_to_token_pool",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "copy_all_layer_kv_cache",
    "fused_gdn_gating",
    "fused_recurrent_gated_delta_rule_update",
    "fused_rmsnorm_gated",
    "fused_sigmoid_gating_delta_rule_update",
    "gdn_gates",
    "l2norm",
    "rmsnorm",
]

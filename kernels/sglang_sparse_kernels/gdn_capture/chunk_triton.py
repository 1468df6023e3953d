"""Gated-delta-rule chunk forward with boundary-state capture, composed from FLA's Triton building blocks.

Pipeline (flash-linear-attention 0.6.0 names; same as ``fla.ops.gated_delta_rule.chunk`` forward):

1. ``fla.ops.utils.chunk_local_cumsum(g, scale=1/ln 2)``: in-chunk cumulative decay, converted to log2
   space because every FLA kernel uses ``exp2``;
2. WY representation: ``chunk_scaled_dot_kkt_fwd`` (``beta * K K^T * decay``, strictly lower) ->
   ``solve_tril`` (``(I + A)^{-1}``) -> ``recompute_w_u_fwd`` (``w``, ``u``); or, with
   ``fused_intra=True``, FLA's fused ``chunk_gated_delta_rule_fwd_intra``;
3. ``chunk_gated_delta_rule_fwd_h`` -> ``h`` ``[B, NT, HV, K, V]`` (``NT`` = total chunks; for varlen
   ``B == 1`` and sequence ``n`` owns ``h[0, chunk_offsets[n]:chunk_offsets[n+1]]``), ``v_new`` and the
   float32 final state ``[N, HV, K, V]``.  ``h[:, i]`` is the state **before** chunk ``i``, i.e. after
   ``i * chunk_size`` tokens (``h[:, 0]`` = initial state; verified against the naive reference in
   ``tests/kernels/test_gdn_capture.py``);
4. ``chunk_fwd_o`` -> ``o``.

The capture is a gather from ``h`` (boundary ``c < NT_n``) or from the final state (``c * chunk_size ==
T_n``), so it adds no kernel work.  Caveat: FLA allocates ``h`` with ``k.dtype``; for bf16/fp16 inputs
interior captured states are rounded to that dtype (the kernel itself carries the state in float32, and
the final state is float32); pass ``fp32_states=True`` to run the state and output kernels on float32
copies so interior checkpoints stay float32 (verified with fp16 under the interpreter; bf16 cannot be
checked there because the interpreter's bf16 emulation overflows, even in FLA's own
``chunk_gated_delta_rule``).

Shapes, validation and the meaning of ``capture_chunks`` are those of
:func:`sglang_sparse_kernels.gdn_capture.chunk_torch.chunk_gdn_fwd_capture`.  Under ``TRITON_INTERPRET=1`` the
workarounds in :mod:`sglang_sparse_kernels.gdn_capture._interpret` are applied automatically.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._interpret import enable_interpreter_workarounds, interpreter_active
from .chunk_torch import CaptureSpec, check_inputs, normalize_capture, seq_bounds

__all__ = ["chunk_gdn_fwd_capture_triton", "fla_wy_prepare"]

_RCP_LN2 = 1.0 / math.log(2.0)


def chunk_gdn_fwd_capture_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    capture_chunks: CaptureSpec | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    use_qk_l2norm: bool = False,
    fused_intra: bool = False,
    fp32_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    """Triton (FLA) chunked gated-delta-rule forward returning output, final state and boundary states.

    Args: as :func:`sglang_sparse_kernels.gdn_capture.chunk_torch.chunk_gdn_fwd_capture`, plus
    ``fused_intra`` (use FLA's fused kkt + solve_tril kernel instead of the three separate building
    blocks).  ``chunk_size``
    must be 16, 32 or 64 (FLA's ``solve_tril`` limit).  ``fp32_states=True`` runs the state pass
    (``chunk_gated_delta_rule_fwd_h``) and ``chunk_fwd_o`` on float32 copies of ``q, k, w, u`` so that
    interior captured states are not rounded to a 16-bit ``h`` (no effect for float32 inputs; costs the
    16-bit tensor-core speed of those two kernels on a GPU).

    Returns:
        ``(o, final_state, states)``: ``o`` ``[B, T, HV, V]`` in ``q.dtype``; ``final_state``
        ``[N, HV, K, V]`` float32; ``states`` float32 ``[N, P, HV, K, V]`` (shared boundary list) or a
        list of ``N`` tensors ``[P_n, HV, K, V]`` (per-sequence lists).
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64 for the FLA kernels, got {chunk_size!r}")
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    bounds = seq_bounds(B, T, cu_seqlens)
    N = len(bounds)
    lengths = [end - start for _, start, end in bounds]
    per_seq, shared = normalize_capture(capture_chunks, lengths, unit=chunk_size, name="capture_chunks")
    if K > 256:
        raise ValueError(f"FLA's chunk_gated_delta_rule_fwd_h supports K <= 256, got K={K}")
    if scale is None:
        scale = K**-0.5
    if interpreter_active():
        enable_interpreter_workarounds()

    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.utils.index import prepare_chunk_offsets

    BT = chunk_size
    q, k, gc, w, u, cu, chunk_indices = fla_wy_prepare(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=BT,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        fused_intra=fused_intra,
    )
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    q_o, k_h = q, k
    if fp32_states and k.dtype != torch.float32:
        q_o, k_h, w, u = (t.float() for t in (q, k, w, u))
    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(
        k=k_h,
        w=w,
        u=u,
        g=gc,
        initial_state=h0,
        output_final_state=True,
        chunk_size=BT,
        cu_seqlens=cu,
        chunk_indices=chunk_indices,
    )
    o = chunk_fwd_o(
        q=q_o,
        k=k_h,
        v=v_new,
        h=h,
        g=gc,
        scale=scale,
        cu_seqlens=cu,
        chunk_size=BT,
        chunk_indices=chunk_indices,
    )

    # ---- gather the requested boundaries ------------------------------------------------------------
    if cu is None:
        nt = -(-T // BT)
        offsets = [n * nt for n in range(N)]
    else:
        offsets = [int(x) for x in prepare_chunk_offsets(cu, BT).tolist()]
    h_flat = h.reshape(-1, HV, K, V)
    out: list[torch.Tensor] = []
    for n, lst in enumerate(per_seq):
        nt_n = -(-lengths[n] // BT)
        rows = []
        for c in lst:
            # c * BT <= T_n was validated; c == nt_n happens only when T_n is a multiple of BT.
            rows.append(final_state[n] if c >= nt_n else h_flat[offsets[n] + c].to(torch.float32))
        out.append(torch.stack(rows) if rows else final_state.new_empty(0, HV, K, V))
    states: torch.Tensor | list[torch.Tensor] = torch.stack(out) if shared else out
    return o.to(q.dtype), final_state, states


def fla_wy_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
    use_qk_l2norm: bool,
    fused_intra: bool,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
]:
    """Steps 1-2 of the pipeline (FLA kernels): optional l2norm, log2 chunk-local cumsum of ``g``, WY.

    Args: ``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``, ``g, beta`` ``[B, T, HV]`` (validated by the
    caller), ``chunk_size`` in {16, 32, 64}.

    Returns:
        ``(q, k, gc, w, u, cu, chunk_indices)``: contiguous (l2-normalised if asked) ``q, k``;
        ``gc`` ``[B, T, HV]`` float32 in-chunk cumulative decay in log2 units; ``w`` ``[B, T, HV, K]``
        and ``u`` ``[B, T, HV, V]`` (WY representation, ``k.dtype``); ``cu`` the ``cu_seqlens`` as an
        int64 tensor on ``q.device`` (None without varlen) and FLA's ``chunk_indices`` (None without
        varlen).
    """
    from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum, solve_tril
    from fla.ops.utils.index import prepare_chunk_indices

    BT = chunk_size
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        from fla.modules.norm.l2norm import l2norm_fwd

        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
    cu: torch.Tensor | None = None
    chunk_indices: torch.Tensor | None = None
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens, dtype=torch.long, device=q.device)
        chunk_indices = prepare_chunk_indices(cu, BT)

    gc = chunk_local_cumsum(g, chunk_size=BT, scale=_RCP_LN2, cu_seqlens=cu, chunk_indices=chunk_indices)
    if fused_intra:
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra

        w, u, _ = chunk_gated_delta_rule_fwd_intra(
            k=k, v=v, g=gc, beta=beta, cu_seqlens=cu, chunk_size=BT, chunk_indices=chunk_indices
        )
    else:
        A = chunk_scaled_dot_kkt_fwd(
            k=k,
            g=gc,
            beta=beta,
            cu_seqlens=cu,
            chunk_size=BT,
            output_dtype=torch.float32,
            chunk_indices=chunk_indices,
        )
        A = solve_tril(A=A, cu_seqlens=cu, chunk_indices=chunk_indices, output_dtype=k.dtype)
        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=gc, cu_seqlens=cu, chunk_indices=chunk_indices)
    return q, k, gc, w, u, cu, chunk_indices

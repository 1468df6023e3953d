"""List capture for the Triton (FLA) gated-delta-rule chunk forward: states written straight into a pool.

The server's capture interface (the CPU op
:func:`sglang_sparse_kernels.sgl_kernel_cpu.delta_rule.chunk_gated_delta_rule`) is a CSR list:
``capture_cu [N + 1]`` splits ``capture_positions`` / ``capture_slots`` (``[P]``) by sequence; entry
``j`` of sequence ``n`` asks for the state after the first ``capture_positions[j]`` tokens of ``n`` to
be written into ``ssm_pool[capture_slots[j]]``.

What is done here, and why
--------------------------
:func:`chunk_gdn_fwd_h_list_capture` is a re-implementation of FLA's chunk-state kernel
(``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``: scalar gate ``g`` in log2 units, key-first
``[K, V]`` state, no ``gk``) with the capture **fused into the kernel**: each program (one value head
and ``BV`` columns of one sequence) carries its state tile in float32 registers and, at every chunk,
looks up the captures that fall into that chunk (two loads of a per-chunk CSR pointer) and stores the
float32 state tile directly into ``ssm_pool[slot]``.  So

* nothing is gathered afterwards and there is no host copy of any state; the pool gets the float32
  accumulator even for bf16/fp16 inputs (FLA's ``h`` is stored in ``k.dtype``; the gather path in
  :mod:`.chunk_triton` needs ``fp32_states=True`` float32 copies of ``q, k, w, u`` for that);
* positions need **not** be on the chunk grid: for ``p = c * BT + r`` with ``0 < r < BT`` the kernel
  forms ``S_p = 2^{G_{r-1}} S_c + K_{<r}^T (2^{G_{r-1} - G} * D)_{<r}`` from the chunk's residuals ``D``
  (already in registers) -- one extra ``[BK, BT] x [BT, BV]`` dot per off-grid capture, exact because
  the WY rows are causal.  No torch "tail" path is needed.  ``p == T_n`` (final state) is stored from
  the final accumulator after the loop, so it is bitwise the returned final state; ``p == 0`` is the
  initial state;
* the per-chunk states ``h`` ``[B, NT, HV, K, V]`` (``k.dtype``) are still materialised, because FLA's
  output kernel ``chunk_fwd_o`` reads the state before every chunk.  Avoiding that would need a fused
  h+o kernel, which FLA does not have for this op; the capture itself adds no ``h``-sized traffic.

:func:`chunk_gdn_fwd_list_capture_triton` is the full forward (FLA's WY kernels -> this state kernel ->
FLA's ``chunk_fwd_o``), with the inputs and outputs of
:func:`sglang_sparse_kernels.gdn_capture.chunk_triton.chunk_gdn_fwd_capture_triton` except that captures
go to the pool.

Shapes: ``q, k`` ``[B, T, H, K]``; ``v`` ``[B, T, HV, V]``; ``g, beta`` ``[B, T, HV]`` (natural-log
decay); states ``[N, HV, K, V]`` float32, key-first; ``ssm_pool`` ``[S, HV, K, V]`` (any strides, so a
value-first pool ``[S, HV, V, K]`` is passed as ``pool.transpose(-1, -2)``; stores are cast to its
dtype).  ``K <= 256``.  Under ``TRITON_INTERPRET=1`` the workarounds of :mod:`._interpret` are applied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._interpret import enable_interpreter_workarounds, interpreter_active
from .chunk_torch import _as_int_list, check_inputs
from .chunk_triton import fla_wy_prepare

__all__ = [
    "build_capture_buckets",
    "chunk_gdn_fwd_h_list_capture",
    "chunk_gdn_fwd_list_capture_triton",
]

IntList = torch.Tensor | Sequence[int]


@triton.autotune(
    configs=[
        triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
        for bv in (32, 64)
        for nw in (2, 4)
        for ns in (1, 2)
    ],
    key=["H", "HV", "K", "V", "BT", "BK"],
)
@triton.jit
def _fwd_h_list_capture_kernel(
    k,
    w,
    u,
    g,
    h,
    v_new,
    h0,
    ht,
    pool,
    cu_seqlens,
    chunk_offsets,
    cap_ptr,
    cap_r,
    cap_slot,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_pv,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
):
    """One program = (``BV`` value columns, sequence ``n``, value head ``i_h``); loops over the chunks.

    Buckets: sequence ``n`` owns buckets ``chunk_offsets[n] + n + c`` for ``c = 0..NT_n``; bucket ``c <
    NT_n`` holds the captures at ``c * BT + r`` (``cap_r`` = ``r``), bucket ``NT_n`` those at ``T_n``.
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    bkt = boh + i_n

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_c = tl.arange(0, BT)
    kv_off = o_k[:, None] * V + o_v[None, :]
    pool_off = i_h * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)

    k_base = k + (bos * H + i_h // (HV // H)) * K
    w_base = w + (bos * HV + i_h) * K
    u_base = u + (bos * HV + i_h) * V
    vn_base = v_new + (bos * HV + i_h) * V
    g_base = g + bos * HV + i_h
    for i_t in range(NT):
        i_t64 = i_t.to(tl.int64)
        o_t = i_t64 * BT + o_c
        m_t = o_t < T
        p_h = h + ((boh + i_t64) * HV + i_h) * K * V + kv_off
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_kv)

        # residuals D = U - W S (FLA's v_new), [BT, BV]
        m_tk = m_t[:, None] & m_k[None, :]
        b_w = tl.load(w_base + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_v = tl.dot(b_w, b_h.to(b_w.dtype))
        p_u = u_base + o_t[:, None] * (HV * V) + o_v[None, :]
        b_v = tl.load(p_u, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32) - b_v
        p_vn = vn_base + o_t[:, None] * (HV * V) + o_v[None, :]
        tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        b_g = tl.load(g_base + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        last = tl.minimum(i_t64 * BT + BT, T) - 1
        b_g_last = tl.load(g_base + last * HV).to(tl.float32)
        p_k = k_base + o_k[:, None] + o_t[None, :] * (H * K)
        b_k = tl.load(p_k, mask=m_k[:, None] & m_t[None, :], other=0.0)  # [BK, BT]

        # captures at i_t * BT + r, 0 <= r < BT (r < T - i_t * BT was validated on the host)
        j0 = tl.load(cap_ptr + bkt + i_t64)
        j1 = tl.load(cap_ptr + bkt + i_t64 + 1)
        for j in range(j0, j1):
            r = tl.load(cap_r + j)
            p_s = pool + tl.load(cap_slot + j).to(tl.int64) * stride_ps + pool_off
            if r == 0:
                tl.store(p_s, b_h.to(p_s.dtype.element_ty), mask=m_kv)
            else:
                b_gr = tl.load(g_base + (i_t64 * BT + r - 1) * HV).to(tl.float32)
                b_vr = b_v * tl.where(o_c < r, tl.math.exp2(b_gr - b_g), 0.0)[:, None]
                b_s = tl.dot(b_k, b_vr.to(b_k.dtype), b_h * tl.math.exp2(b_gr))
                tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_kv)

        b_v = b_v * tl.where(m_t, tl.math.exp2(b_g_last - b_g), 0.0)[:, None]
        b_h *= tl.math.exp2(b_g_last)
        b_h = tl.dot(b_k, b_v.to(b_k.dtype), b_h)

    tl.store(ht + i_nh.to(tl.int64) * K * V + kv_off, b_h, mask=m_kv)
    # captures at T_n (the final state; also position 0 of an empty sequence)
    j0 = tl.load(cap_ptr + bkt + NT)
    j1 = tl.load(cap_ptr + bkt + NT + 1)
    for j in range(j0, j1):
        p_s = pool + tl.load(cap_slot + j).to(tl.int64) * stride_ps + pool_off
        tl.store(p_s, b_h.to(p_s.dtype.element_ty), mask=m_kv)


def build_capture_buckets(
    lengths: Sequence[int],
    capture_cu: IntList,
    capture_positions: IntList,
    capture_slots: IntList,
    num_slots: int,
    chunk_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate a list capture and sort it into per-chunk buckets (host side, ``O(N + P + NT)``).

    Args:
        lengths: ``N`` sequence lengths in tokens.
        capture_cu: ``[N + 1]`` CSR offsets into ``capture_positions`` / ``capture_slots``.
        capture_positions: ``[P]`` token counts ``0 <= p <= lengths[n]`` (any order, repeats allowed).
        capture_slots: ``[P]`` destination pool slots, ``0 <= slot < num_slots``, pairwise distinct
            (two programs writing one slot would race).
        num_slots: pool size ``S``.
        chunk_size: ``BT``.
        device: where the returned tensors go.

    Returns:
        ``(cap_ptr [NT_total + N + 1], cap_r [P], cap_slot [P])`` int32: bucket ``chunk_offsets[n] + n +
        c`` of sequence ``n`` holds the captures with ``p // BT == c`` and ``p < T_n`` (``cap_r = p - c *
        BT``), bucket ``chunk_offsets[n] + n + NT_n`` those with ``p == T_n``.

    Raises:
        ValueError: malformed CSR, position out of range, slot out of range or repeated.
    """
    N = len(lengths)
    cu = _as_int_list(capture_cu)
    pos = _as_int_list(capture_positions)
    slots = _as_int_list(capture_slots)
    if len(cu) != N + 1 or cu[0] != 0 or cu[-1] != len(pos) or len(pos) != len(slots):
        raise ValueError(
            f"capture CSR: capture_cu {cu} for {N} sequences, {len(pos)} positions, {len(slots)} slots"
        )
    if any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"capture_cu must be non-decreasing, got {cu}")
    if len(set(slots)) != len(slots):
        raise ValueError(f"capture_slots must be pairwise distinct, got {slots}")
    BT = chunk_size
    buckets: list[int] = []
    rs: list[int] = []
    base = 0
    for n, length in enumerate(lengths):
        nt = -(-length // BT)
        for j in range(cu[n], cu[n + 1]):
            p, s = pos[j], slots[j]
            if not 0 <= p <= length:
                raise ValueError(f"capture position {p} outside [0, {length}] for sequence {n}")
            if not 0 <= s < num_slots:
                raise ValueError(f"capture slot {s} outside [0, {num_slots}) of the pool")
            c = nt if p == length else p // BT
            buckets.append(base + c)
            rs.append(p - c * BT if p < length else 0)
        base += nt + 1
    order = sorted(range(len(pos)), key=buckets.__getitem__)
    counts = [0] * (base + 1)
    for b in buckets:
        counts[b + 1] += 1
    for i in range(base):
        counts[i + 1] += counts[i]
    packed = torch.tensor(
        counts + [rs[j] for j in order] + [slots[j] for j in order], dtype=torch.int32, device=device
    )  # one host-to-device copy
    P = len(pos)
    return packed[: base + 1], packed[base + 1 : base + 1 + P], packed[base + 1 + P :]


def chunk_gdn_fwd_h_list_capture(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    capture_cu: IntList,
    capture_positions: IntList,
    capture_slots: IntList,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-in for FLA's ``chunk_gated_delta_rule_fwd_h`` (``output_final_state=True``, key-first state,
    scalar gate, ``save_new_value=True``) that also writes the listed states into ``ssm_pool``.

    Args:
        k: ``[B, T, H, K]``; w: ``[B, T, HV, K]``; u: ``[B, T, HV, V]`` (WY outputs, same dtype as ``k``).
        g: ``[B, T, HV]`` in-chunk cumulative decay in **log2** units (``chunk_local_cumsum(g, scale=1 /
            ln 2)``), float32.
        initial_state: ``[N, HV, K, V]`` (read as float32) or None (zeros).
        ssm_pool: ``[S, HV, K, V]`` destination (any strides / float dtype); only the listed slots are
            written.  Must not alias ``initial_state``.
        capture_cu, capture_positions, capture_slots: the list capture (see :func:`build_capture_buckets`).
        chunk_size: ``BT`` in {16, 32, 64}.
        cu_seqlens: ``[N + 1]`` packed sequence offsets (then ``B == 1``), or None (``N = B`` sequences).

    Returns:
        ``(h, v_new, final_state)`` as FLA: ``h`` ``[B, NT, HV, K, V]`` in ``k.dtype`` (state before each
        chunk, ``NT`` = total chunks), ``v_new`` like ``u``, ``final_state`` ``[N, HV, K, V]`` float32.
    """
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    BT = chunk_size
    if K > 256:
        raise ValueError(f"K <= 256 required, got {K}")
    if ssm_pool.dim() != 4 or tuple(ssm_pool.shape[1:]) != (HV, K, V):
        raise ValueError(f"ssm_pool must be [S, HV={HV}, K={K}, V={V}], got {tuple(ssm_pool.shape)}")
    if ssm_pool.device != k.device or not ssm_pool.dtype.is_floating_point:
        raise ValueError(
            f"ssm_pool must be a floating tensor on {k.device}, got {ssm_pool.dtype} on {ssm_pool.device}"
        )
    dev = k.device
    if cu_seqlens is None:
        nt = -(-T // BT)
        lengths = [T] * B
        cu = torch.arange(0, B * T + 1, max(T, 1), dtype=torch.int64, device=dev)[: B + 1]
        chunk_off = torch.arange(0, B * nt + 1, max(nt, 1), dtype=torch.int64, device=dev)[: B + 1]
        h = k.new_empty(B, nt, HV, K, V)
    else:
        cu_list = _as_int_list(cu_seqlens)
        lengths = [b - a for a, b in zip(cu_list, cu_list[1:], strict=False)]
        nts = [-(-n // BT) for n in lengths]
        offs = [0]
        for n in nts:
            offs.append(offs[-1] + n)
        cu = torch.tensor(cu_list, dtype=torch.int64, device=dev)
        chunk_off = torch.tensor(offs, dtype=torch.int64, device=dev)
        h = k.new_empty(1, offs[-1], HV, K, V)
    if T == 0 or B == 0:  # arange above would be degenerate; every sequence is empty
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=dev)
        chunk_off = torch.zeros_like(cu)
    N = len(lengths)
    cap_ptr, cap_r, cap_slot = build_capture_buckets(
        lengths, capture_cu, capture_positions, capture_slots, ssm_pool.shape[0], BT, dev
    )
    v_new = torch.empty_like(u)
    final_state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=dev)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    if N == 0:
        return h, v_new, final_state
    if interpreter_active():
        enable_interpreter_workarounds()
    BK = max(16, triton.next_power_of_2(K))

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(V, meta["BV"]), N * HV)

    _fwd_h_list_capture_kernel[grid](
        k,
        w,
        u,
        g,
        h,
        v_new,
        h0 if h0 is not None else final_state,  # dummy pointer when unused
        final_state,
        ssm_pool,
        cu,
        chunk_off,
        cap_ptr,
        cap_r,
        cap_slot,
        ssm_pool.stride(0),
        ssm_pool.stride(1),
        ssm_pool.stride(2),
        ssm_pool.stride(3),
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=BT,
        BK=BK,
        USE_INITIAL_STATE=h0 is not None,
    )
    return h, v_new, final_state


def chunk_gdn_fwd_list_capture_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    capture_cu: IntList,
    capture_positions: IntList,
    capture_slots: IntList,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    use_qk_l2norm: bool = False,
    fused_intra: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton (FLA) chunked gated-delta-rule forward writing the listed states into ``ssm_pool``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g (natural-log decay), beta: ``[B, T, HV]``.
        ssm_pool: ``[S, HV, K, V]`` destination pool (float32 in the server; any float dtype / strides).
        capture_cu: ``[N + 1]`` CSR offsets; capture_positions: ``[P]`` token counts ``0 <= p <= T_n``
            (``0`` = initial state, ``T_n`` = final state, off-grid allowed); capture_slots: ``[P]``
            distinct pool slots.  Host lists or integer tensors (read once on the host).
        scale: output scale (default ``K ** -0.5``).
        initial_state: ``[N, HV, K, V]`` or None (zeros); must not alias the written slots.
        chunk_size: 16, 32 or 64.
        cu_seqlens: ``[N + 1]`` packed offsets (``B == 1``) or None (``N = B``).
        use_qk_l2norm, fused_intra: as in :func:`.chunk_triton.chunk_gdn_fwd_capture_triton`.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state [N, HV, K, V] float32)``; pool slots not listed in
        ``capture_slots`` are left untouched.
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64 for the FLA kernels, got {chunk_size!r}")
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if K > 256:
        raise ValueError(f"K <= 256 required, got K={K}")
    if scale is None:
        scale = K**-0.5
    if interpreter_active():
        enable_interpreter_workarounds()
    from fla.ops.common.chunk_o import chunk_fwd_o

    q, k, gc, w, u, cu, chunk_indices = fla_wy_prepare(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        fused_intra=fused_intra,
    )
    h, v_new, final_state = chunk_gdn_fwd_h_list_capture(
        k,
        w,
        u,
        gc,
        initial_state,
        ssm_pool,
        capture_cu,
        capture_positions,
        capture_slots,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
    )
    o = chunk_fwd_o(
        q=q,
        k=k,
        v=v_new,
        h=h,
        g=gc,
        scale=scale,
        cu_seqlens=cu,
        chunk_size=chunk_size,
        chunk_indices=chunk_indices,
    )
    return o.to(q.dtype), final_state

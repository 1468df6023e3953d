"""Gated delta rule (GatedDeltaNet) over packed sequences with a slot-indexed recurrent state pool.

Per value head, with state ``S`` (``[V, K]`` in the pool), decay ``alpha_t = exp(g_t)`` and write
strength ``beta_t``, every token does::

    S   <- alpha_t * S
    u_t  = beta_t * (v_t - S k_t)
    S   <- S + u_t k_t^T
    o_t  = S (scale * q_t)

(``q, k`` optionally L2-normalised first; ``scale`` defaults to ``K ** -0.5``; query/key heads are
shared by ``HV / H`` consecutive value heads.)

``chunk_gated_delta_rule`` evaluates this exactly (up to fp32 rounding) in chunks of ``C`` tokens:
inside a chunk with cumulative log-decay ``gam``, ``U = (I + A)^{-1} (beta V - beta e^{gam} K S0)`` with
``A[t, s] = beta_t e^{gam_t - gam_s} k_t.k_s`` (s < t), inverted by repeated squaring (A is nilpotent); the
outputs and the next state then follow from matrix products, and only the inter-chunk state is
carried sequentially. Decay factors are always formed as ``exp(gam_t - gam_s)`` with ``s <= t`` so
nothing overflows.

Shapes: ``T`` packed tokens, ``N`` sequences, ``H`` query/key heads, ``HV`` value heads, ``K``/``V``
head dims, ``S`` pool slots. All arithmetic is fp32.

Per-chunk states ``h`` (returned by :func:`chunk_gated_delta_rule`, as SGLang's Triton kernel
returns them) follow FLA's / SGLang's ``chunk_gated_delta_rule_fwd_h`` convention: sequence ``n`` owns
``ceil(len_n / C)`` consecutive rows starting at ``sum_{m<n} ceil(len_m / C)`` (packed input) or row 0
of its batch entry (``B > 1``), and its row ``c`` holds the state BEFORE chunk ``c`` (row 0 = the
initial state; the final state is not in ``h``). They are the very states the chunk loop carries.

:func:`fused_recurrent_gated_delta_rule_update` runs the recurrence token by token on slot-indexed
states in place (SGLang's kernel of that name: decode, and the ``< 64``-token tails that advance an
``h`` row to an off-grid capture position, ``sglang_sparse.sglang_adapter.capture``).
"""

from __future__ import annotations

import torch

from .gating import gdn_gates

DEFAULT_CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_l2norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k: [..., H, K]`` -> fp32, normalised, scaled (q only), expanded to ``HV`` heads."""
    q, k = q.float(), k.float()
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    return q, k


def _unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """``(I + A)^{-1}`` for strictly lower-triangular ``A: [..., C, C]`` (nilpotent: ``A^C = 0``).

    Uses ``(I + A)^{-1} = sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...`` — ``2 ceil(log2 C)`` batched
    matmuls instead of one triangular solve per matrix (much cheaper on a busy CPU, same accuracy
    in tests).
    """
    c = strict_lower.shape[-1]
    p = -strict_lower
    inv = p + torch.eye(c, dtype=p.dtype, device=p.device)
    span = 2  # inv holds all powers of p below `span`
    while span < c:
        p = p @ p
        inv = inv + inv @ p
        span *= 2
    return inv


def _chunk_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    h_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, head-major fp32 inputs.

    Args:
        q, k: ``[HV, L, K]`` (already normalised/scaled/expanded); v: ``[HV, L, V]``;
        g, beta: ``[HV, L]``; state: ``[HV, K, V]`` initial state (``K x V`` layout).
        h_out: optional ``[ceil(L / chunk), HV, K, V]`` destination; row ``c`` receives the carried
            state before chunk ``c`` (a plain copy: the returned values do not depend on it).

    Returns:
        ``(o [HV, L, V], final_state [HV, K, V])``.
    """
    hv, length, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    q = q.view(hv, n, chunk, dk)
    k = k.view(hv, n, chunk, dk)
    v = v.view(hv, n, chunk, dv)
    beta = beta.view(hv, n, chunk)
    gam = g.view(hv, n, chunk).cumsum(-1)

    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    incl = torch.tril(ones)
    strict = torch.tril(ones, diagonal=-1)
    diff = gam.unsqueeze(-1) - gam.unsqueeze(-2)  # [HV, n, C, C]: gam_t - gam_s
    neg_inf = torch.tensor(float("-inf"), dtype=diff.dtype, device=diff.device)
    decay_strict = torch.exp(torch.where(strict, diff, neg_inf))
    decay_incl = torch.exp(torch.where(incl, diff, neg_inf))

    kb = k * beta.unsqueeze(-1)
    strict_a = (kb @ k.transpose(-1, -2)) * decay_strict  # A: strictly lower triangular
    rhs = torch.cat([v * beta.unsqueeze(-1), kb * torch.exp(gam).unsqueeze(-1)], dim=-1)
    sol = _unit_lower_inverse(strict_a) @ rhs  # (I + A)^{-1} rhs
    u_const, u_state = sol[..., :dv], sol[..., dv:]  # U = u_const - u_state @ S0

    qk = (q @ k.transpose(-1, -2)) * decay_incl  # [HV, n, C, C]
    q_decay = q * torch.exp(gam).unsqueeze(-1)
    k_tail = k * torch.exp(gam[..., -1:] - gam).unsqueeze(-1)
    chunk_decay = torch.exp(gam[..., -1])  # [HV, n]

    out = torch.empty(hv, n, chunk, dv, dtype=q.dtype, device=q.device)
    s = state
    for i in range(n):
        if h_out is not None:
            h_out[i].copy_(s)
        u = u_const[:, i] - u_state[:, i] @ s  # [HV, C, V]
        out[:, i] = q_decay[:, i] @ s + qk[:, i] @ u
        s = s * chunk_decay[:, i, None, None] + k_tail[:, i].transpose(-1, -2) @ u
    return out.reshape(hv, n * chunk, dv)[:, :length], s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Prefill (``chunk_gated_delta_rule_cpu``): SGLang's Triton ``chunk_gated_delta_rule`` on the CPU.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g (log decay), beta: ``[B, T, HV]``.
            With ``cu_seqlens`` (``[N + 1]``), ``B`` must be 1 and the ``N`` sequences are packed.
        initial_state: the state pool ``[S, HV, V, K]``; read at ``initial_state_indices`` (``[N]``,
            default ``arange(N)``) and overwritten in place with the final states. Negative indices
            mark padding sequences (skipped, zero output). None: start from zeros, no write-back.
        head_first: must be False.

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final states [N, HV, V, K] fp32 or None, h)``. ``h`` holds the
        per-chunk states in the layout of SGLang's Triton kernel (``chunk_gated_delta_rule_fwd_h``),
        which SGLang's prefill track copies index (``ssm[dst] = h.squeeze(0)[src]``): fp32
        ``[B, NT, HV, V, K]`` with ``NT = sum_n ceil(len_n / chunk_size)`` for packed input
        (``B == 1``; sequence ``n``'s rows start at ``sum_{m<n} ceil(len_m / chunk_size)``), else
        ``ceil(T / chunk_size)``; ``h[b, row0_n + c]`` is the state of sequence ``n`` before its
        chunk ``c`` (``c = 0``: the initial state; the final state is not in ``h``). Rows of padding
        sequences are zero. ``h`` is a transposed view of a contiguous ``[B, NT, HV, K, V]`` buffer
        (the chunk loop's own layout: one contiguous copy per row): gather rows from it rather than
        ``.view()`` it. Triton stores ``h`` in ``k.dtype``; here it stays fp32 and the caller rounds
        once to the pool dtype.
    """
    if head_first:
        raise NotImplementedError("head_first=True is not supported")
    bsz, total, _, dk = q.shape
    hv, dv = v.shape[-2], v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    qf, kf = _prep_qk(q, k, hv, use_qk_l2norm_in_kernel, scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if cu_seqlens is not None:
        if bsz != 1:
            raise ValueError("packed (cu_seqlens) input needs batch size 1")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        segs = [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    else:
        segs = [(b, 0, total) for b in range(bsz)]
    n_seq = len(segs)
    if initial_state_indices is None:
        slots = list(range(n_seq))
    else:
        slots = [int(x) for x in initial_state_indices.tolist()]
        if len(slots) != n_seq:
            raise ValueError(f"{len(slots)} state indices for {n_seq} sequences")
    # h rows: sequence i owns ceil(len_i / C) rows from h_row0[i] (packed) or 0 (batched).
    n_chunks = [-(-(hi - lo) // chunk_size) for _, lo, hi in segs]
    h_row0 = [0] * n_seq
    if cu_seqlens is not None:
        for i in range(1, n_seq):
            h_row0[i] = h_row0[i - 1] + n_chunks[i - 1]
    nt = (h_row0[-1] + n_chunks[-1]) if cu_seqlens is not None and n_seq else max(n_chunks, default=0)
    # empty, not zeros: every row is written below (padding sequences' rows zeroed there), so a zero
    # fill would only add a pass over a buffer of ceil(T / C) states.
    h_kv = torch.empty(bsz, nt, hv, dk, dv, dtype=torch.float32, device=v.device)
    out = torch.zeros(bsz, total, hv, dv, dtype=torch.float32, device=v.device)
    finals = torch.zeros(n_seq, hv, dv, dk, dtype=torch.float32, device=v.device)
    for i, (b, lo, hi) in enumerate(segs):
        slot = slots[i]
        rows = h_kv[b, h_row0[i] : h_row0[i] + n_chunks[i]]
        if slot < 0:
            rows.zero_()
            continue
        if initial_state is None:
            s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device)
        else:
            s = initial_state[slot].float().transpose(-1, -2)
        if hi > lo:
            o, s = _chunk_one(
                qf[b, lo:hi].transpose(0, 1),
                kf[b, lo:hi].transpose(0, 1),
                vf[b, lo:hi].transpose(0, 1),
                gf[b, lo:hi].transpose(0, 1),
                bf[b, lo:hi].transpose(0, 1),
                s,
                chunk=chunk_size,
                h_out=rows,
            )
            out[b, lo:hi] = o.transpose(0, 1)
        finals[i] = s.transpose(-1, -2)
        if initial_state is not None:
            initial_state[slot] = finals[i].to(initial_state.dtype)
    return out.to(v.dtype), (finals if output_final_state else None), h_kv.transpose(-1, -2)


def _recurrent_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence for ``M`` independent sequences of equal length ``L``.

    ``q, k: [M, L, HV, K]``, ``v: [M, L, HV, V]``, ``g, beta: [M, L, HV]``, ``state: [M, HV, V, K]``.
    Returns ``(o [M, L, HV, V], state)``.
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state
    for t in range(q.shape[1]):
        s = s * torch.exp(g[:, t])[..., None, None]
        kv = (s @ k[:, t].unsqueeze(-1)).squeeze(-1)  # [M, HV, V]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
        s = s + u.unsqueeze(-1) * k[:, t].unsqueeze(-2)
        out[:, t] = (s @ q[:, t].unsqueeze(-1)).squeeze(-1)
    return out, s


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode (``fused_sigmoid_gating_delta_rule_update_cpu``): gates + recurrent update in one call.

    ``a, b``: ``[T, HV]`` (or ``[1, T, HV]``) raw gate inputs, turned into ``g``/``beta`` as in
    :func:`sglang_sparse_kernels.sgl_kernel_cpu.gating.gdn_gates`; everything else as
    :func:`fused_recurrent_gated_delta_rule_update`. Returns ``o: [1, T, HV, V]`` in ``v.dtype``.
    """
    total, hv = v.shape[-3], v.shape[-2]
    g, beta = gdn_gates(
        A_log, a.reshape(total, hv), b.reshape(total, hv), dt_bias, softplus_beta, softplus_threshold
    )
    return fused_recurrent_gated_delta_rule_update(
        q,
        k,
        v,
        g.reshape(1, total, hv),
        beta.reshape(1, total, hv),
        scale=scale,
        initial_state_source=initial_state_source,
        initial_state_indices=initial_state_indices,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state_source: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    disable_state_update: bool = False,
    disable_output_calculation: bool = False,
) -> torch.Tensor:
    """Token-by-token gated delta rule over packed sequences with slot-indexed states, in place:
    SGLang's ``fused_recurrent_gated_delta_rule_update`` (``sglang/kernels/ops/attention/fla/
    fused_recurrent.py``, the keyword arguments it takes without speculative decoding) on the CPU.

    Args:
        q, k: ``[1, T, H, K]``; v: ``[1, T, HV, V]``; g (log decay), beta: ``[1, T, HV]`` (beta
            None: ones).
        initial_state_source: state pool ``[S, HV, V, K]``, read at ``initial_state_indices``
            (``[N]``; negative = padding, skipped) and, unless ``disable_state_update``, overwritten
            with the state after each sequence, in the pool's dtype.
        cu_seqlens: ``[N + 1]`` token offsets (None: one token per sequence).
        disable_output_calculation: return an empty tensor instead of the outputs (the state update
            alone; its cost is the same here, the output is a by-product of the recurrence).

    Returns:
        ``o: [1, T, HV, V]`` in ``v.dtype`` (empty with ``disable_output_calculation``).
    """
    total, hv, dv = v.shape[-3], v.shape[-2], v.shape[-1]
    dk = q.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    qf, kf = _prep_qk(q.reshape(total, -1, dk), k.reshape(total, -1, dk), hv, use_qk_l2norm_in_kernel, scale)
    vf = v.reshape(total, hv, dv).float()
    gf = g.reshape(total, hv).float()
    bf = torch.ones_like(gf) if beta is None else beta.reshape(total, hv).float()
    if cu_seqlens is None:
        bounds = list(range(total + 1))
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
    n_seq = len(bounds) - 1
    pool = initial_state_source
    if pool is None:
        raise ValueError("initial_state_source (the state pool) is required")
    idx = initial_state_indices.to(torch.long).reshape(-1)[:n_seq]
    lengths = {bounds[i + 1] - bounds[i] for i in range(n_seq)}
    out = torch.zeros(total, hv, dv, dtype=torch.float32, device=v.device)
    valid = idx >= 0
    if len(lengths) == 1 and bounds[0] == 0 and bounds[-1] == total:
        # Equal lengths (decode: all 1): vectorise across sequences.
        length = lengths.pop()
        if length > 0 and bool(valid.any()):
            shape = (n_seq, length)
            o, st = _recurrent_steps(
                qf.view(*shape, hv, dk)[valid],
                kf.view(*shape, hv, dk)[valid],
                vf.view(*shape, hv, dv)[valid],
                gf.view(*shape, hv)[valid],
                bf.view(*shape, hv)[valid],
                pool[idx[valid]].float(),
            )
            out.view(*shape, hv, dv)[valid] = o
            if not disable_state_update:
                pool[idx[valid]] = st.to(pool.dtype)
    else:
        for i in range(n_seq):
            lo, hi, slot = bounds[i], bounds[i + 1], int(idx[i])
            if slot < 0 or hi <= lo:
                continue
            o, st = _recurrent_steps(
                qf[None, lo:hi],
                kf[None, lo:hi],
                vf[None, lo:hi],
                gf[None, lo:hi],
                bf[None, lo:hi],
                pool[slot].float()[None],
            )
            out[lo:hi] = o[0]
            if not disable_state_update:
                pool[slot] = st[0].to(pool.dtype)
    if disable_output_calculation:
        return v.new_empty(0)
    return out.unsqueeze(0).to(v.dtype)

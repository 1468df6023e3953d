"""Mamba2 (SSD) on the CPU: pure-torch stand-ins for SGLang 0.5.23's Triton Mamba2 kernels.

Per head ``h`` (``H`` heads of ``P`` channels, ``G`` groups of ``N`` state dims, head ``h`` reading
group ``h // (H / G)``), with state ``S [P, N]``, every token ``t`` of a sequence does::

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)     (softplus optional, identity above 20)
    S    <- exp(dt_t * A) * S + dt_t * x_t B_t^T           (A < 0: a per-head log-decay rate)
    y_t  = S C_t + D * x_t,   out_t = y_t * silu(z_t)      (D and z optional)

:func:`mamba_chunk_scan_combined` (prefill) evaluates this exactly, up to fp32 rounding, in the SSD
chunked form on SGLang's *flattened* chunk grid: the packed tokens of the whole batch are cut into
chunks of ``Q = chunk_size`` (a power of two) regardless of sequence boundaries, so a chunk can hold
the end of one sequence and the start of the next. Inside a chunk, with the cumulative log-decay
``cum_t = sum_{i<=t} dt_i A`` (natural log, reset at every chunk start), outputs are one masked
quadratic form ``y_t = sum_{s<=t, same seq} (C_t . B_s) e^{cum_t - cum_s} dt_s x_s`` (one batched
matmul per group: ``e^{cum_t - m} [CB (e^{m - cum_s} dt_s x_s)]`` with ``m`` the chunk's mid log-decay,
when the in-chunk spread of ``cum`` is at most :data:`FACTORISE_MAX_SPREAD`, else the per-head
``[Q, Q]`` exponentials ``e^{cum_t - cum_s}``, ``s <= t``) plus the carried state decayed by
``e^{cum_t - cum_b}`` (``b`` the chunk start or the token before the sequence's start). Only the
state at chunk boundaries is passed sequentially (one ``[H, P, N]`` update per chunk). No exponent
is positive beyond the bounded factorisation (nothing overflows); arithmetic is fp32 (fp64 for fp64
inputs). Conventions match the Triton kernels (``kernels/ops/mamba/triton_ops/ssd_*.py``):

* ``states [batch, nchunks, H, P, N]`` (what SGLang calls ``h``): row ``c`` is the state at the
  *start* of flattened chunk ``c``: row 0 is ``initial_states[0]`` (zeros without initial states),
  row ``c >= 1`` the state of the sequence owning token ``c*Q - 1`` after that token (the sequence's
  final state if it ends exactly there). SGLang's extra_buffer reads ``h[end_loc // Q]`` for
  on-grid ``end_loc``.
* ``varlen_states [nseq, H, P, N]``: the final state of every ``cu_seqlens`` sequence.
* ``track_states [1, ntrack, H, P, N]``: the exact state of sequence ``track_seq_idx[j]`` after its
  tokens ``[cu_seqlens[k], track_end_locs[j])`` (flattened positions, any offset).
* Sequences are the runs of ``seq_idx`` (the Triton masking key); ``chunk_indices`` /
  ``chunk_offsets`` (SGLang's logical-chunk split, ``mamba2_metadata.py``) are implied by ``seq_idx``
  and accepted for signature compatibility only. Sequence ``k`` starts from ``initial_states[k]``
  (zeros when ``initial_states`` is None).
* Returned states are cast to ``state_dtype`` (default ``C.dtype``), ``final_states`` is fp32, the
  output goes into ``out`` (required, as in Triton) in its dtype. Internally states stay fp32 where
  the Triton kernels round ``states`` to ``state_dtype`` before reusing them (so 16-bit runs agree to
  16-bit rounding, fp32 runs to fp32 rounding).

:func:`selective_state_update` (decode, ``T`` tokens per request, usually 1) and the conv wrappers
:func:`causal_conv1d_fn` / :func:`causal_conv1d_update` (around :mod:`.conv`) keep the signatures
SGLang's ``MambaMixer2.forward`` (``srt/layers/attention/mamba/mamba.py``) calls. Speculative-decoding
extras that need tree bookkeeping (``retrieve_parent_token``, conv ``intermediate_conv_window``) and
Triton-only storage variants (paged conv ``block_table``, stochastic rounding) raise
``NotImplementedError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import conv

PAD_SLOT_ID = -1

#: softplus is the identity above this (the Triton kernels' threshold)
SOFTPLUS_THRESHOLD = 20.0


# --------------------------------------------------------------------------------------------------
# causal conv1d (SGLang's causal_conv1d_fn / causal_conv1d_update signatures, conv.py math)
# --------------------------------------------------------------------------------------------------


def _silu_flag(activation: bool | str | None) -> bool:
    """SGLang's activation argument (``"silu"``/``"swish"``/``True``: SiLU; None/False: none)."""
    if activation is None or activation is False:
        return False
    if activation is True or activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported conv activation {activation!r} (expected None, 'silu' or 'swish')")


def _check_state_len(conv_state: torch.Tensor | None, weight: torch.Tensor) -> None:
    if conv_state is not None and conv_state.shape[-1] != weight.shape[1] - 1:
        raise NotImplementedError(
            f"conv state length {conv_state.shape[-1]} != kernel width - 1 = {weight.shape[1] - 1}"
        )


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_states: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    seq_lens_cpu: Sequence[int] | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: bool | str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    block_table: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Prefill conv over packed sequences (``causal_conv1d_triton.causal_conv1d_fn``'s contract).

    Args:
        x: ``[D, T]`` packed tokens (a transposed ``[T, D]`` view is fine), or ``[B, D, L]`` equal-length
            sequences when ``query_start_loc`` is None.
        weight: ``[D, W]``; bias: ``[D]`` or None.
        conv_states: ``[S, D, W - 1]`` pool, updated in place: slot ``cache_indices[b]`` receives the
            last ``W - 1`` inputs of sequence ``b``; read as its initial window when
            ``has_initial_state[b]``.
        query_start_loc: ``[B + 1]`` token offsets; cache_indices: ``[B]`` slots (``pad_slot_id``
            sequences are skipped and their outputs left zero).
        seq_lens_cpu, kwargs (``validate_data``, ``metadata``, ...): accepted, unused.

    Returns:
        ``[D, T]`` (or ``[B, D, L]``) outputs in ``x.dtype``.
    """
    if block_table is not None:
        raise NotImplementedError("causal_conv1d_fn (CPU): paged conv state (block_table) not supported")
    _check_state_len(conv_states, weight)
    silu = _silu_flag(activation)
    if x.dim() == 3:
        if query_start_loc is not None:
            raise ValueError("causal_conv1d_fn: 3-D x takes no query_start_loc")
        n, dim, length = x.shape
        flat = x.transpose(0, 1).reshape(dim, n * length)
        qsl = torch.arange(n + 1, dtype=torch.int64) * length
        out = conv.causal_conv1d_fwd(
            flat, weight, bias, conv_states, qsl, cache_indices, has_initial_state, silu, pad_slot_id
        )
        return out.view(dim, n, length).transpose(0, 1).contiguous()
    return conv.causal_conv1d_fwd(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, silu, pad_slot_id
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accept_tokens: torch.Tensor | None = None,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata: Any = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """Decode conv (``causal_conv1d_triton.causal_conv1d_update``'s contract, non-speculative).

    ``x [B, D]`` or ``[B, D, L]``; ``conv_state [S, D, W - 1]`` updated in place at
    ``conv_state_indices`` (``pad_slot_id`` rows skipped, output zero). Returns ``x``'s shape/dtype.
    """
    spec = (num_accept_tokens, intermediate_conv_window, intermediate_state_indices)
    tree = (retrieve_next_token, retrieve_next_sibling, retrieve_parent_token)
    if any(t is not None for t in spec + tree):
        raise NotImplementedError("causal_conv1d_update (CPU): speculative-decoding windows not supported")
    _check_state_len(conv_state, weight)
    return conv.causal_conv1d_update(
        x, conv_state, weight, bias, _silu_flag(activation), cache_seqlens, conv_state_indices, pad_slot_id
    )


# --------------------------------------------------------------------------------------------------
# dt
# --------------------------------------------------------------------------------------------------


def _softplus(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v <= SOFTPLUS_THRESHOLD, torch.log1p(torch.exp(v)), v)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------------
# decode: selective_state_update
# --------------------------------------------------------------------------------------------------


def _lift(t: torch.Tensor | None, dims: int) -> torch.Tensor | None:
    """Insert singleton dim 1 until ``t`` has ``dims`` dims (the Triton wrapper's unsqueezes)."""
    while t is not None and t.dim() < dims:
        t = t.unsqueeze(1)
    return t


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    out: torch.Tensor | None = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    cache_steps: int | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    enable_stochastic_rounding: bool = False,
    cache_philox_rounds: int = 0,
) -> None:
    """Recurrent Mamba2 step(s) on a slot-indexed state pool (``triton_ops.mamba_ssm``'s contract).

    Shapes (after the Triton wrapper's singleton insertions): ``state [S, H, P, N]`` (updated in place
    unless ``disable_state_update``), ``x, dt, z, out [b, T, H, P]`` (``[b, H, P]`` / ``[b, P]`` for one
    token), ``A [H, P, N]``, ``B, C [b, T, G, N]``, ``D, dt_bias [H, P]``. No ``dt_limit`` clamp here
    (as in Triton). Rows whose slot is ``pad_slot_id`` start from a zero state, still write ``out``
    and never write the pool. ``intermediate_states_buffer`` (``[*, cache_steps, H, P, N]``,
    contiguous) receives the state after every step at row ``intermediate_state_indices[b]`` (else
    the slot, else ``b``), as the speculative verify path expects.
    """
    if out is None:
        raise ValueError("selective_state_update: out is required (in-place output, as in Triton)")
    if retrieve_parent_token is not None:
        raise NotImplementedError(
            "selective_state_update (CPU): EAGLE tree (retrieve_parent_token) not supported"
        )
    if enable_stochastic_rounding:
        raise NotImplementedError("selective_state_update (CPU): stochastic rounding not supported")
    pool = _lift(state, 4)
    xs, dts, zs, outs = (_lift(t, 4) for t in (x, dt, z, out))
    Bs, Cs = _lift(B, 4), _lift(C, 4)
    A3 = A.unsqueeze(0) if A.dim() == 2 else A
    D2 = _lift(D, 2) if D is not None and D.dim() == 1 else D
    bias2 = dt_bias.unsqueeze(0) if dt_bias is not None and dt_bias.dim() == 1 else dt_bias
    assert pool is not None and xs is not None and dts is not None and outs is not None
    assert Bs is not None and Cs is not None
    _, nheads, dim, dstate = pool.shape
    batch, steps = xs.shape[:2]
    ngroups = Bs.shape[2]
    if xs.shape != (batch, steps, nheads, dim) or dts.shape != xs.shape or outs.shape != xs.shape:
        raise ValueError(
            f"selective_state_update: x {tuple(xs.shape)} / dt / out vs state {tuple(pool.shape)}"
        )
    if nheads % ngroups or Bs.shape != (batch, steps, ngroups, dstate) or Cs.shape != Bs.shape:
        raise ValueError(f"selective_state_update: B/C {tuple(Bs.shape)} vs {nheads} heads, N={dstate}")
    cd = _compute_dtype(xs)
    if state_batch_indices is None:
        slots = torch.arange(batch, device=pool.device)
        valid = torch.ones(batch, dtype=torch.bool, device=pool.device)
    else:
        slots = state_batch_indices.to(torch.long)
        valid = slots != pad_slot_id
    s = torch.zeros(batch, nheads, dim, dstate, dtype=cd, device=pool.device)
    s[valid] = pool[slots[valid]].to(cd)
    group = torch.arange(nheads, device=pool.device) // (nheads // ngroups)
    a = A3.to(cd)  # [H, P, N]
    buf = None
    if intermediate_states_buffer is not None:
        if cache_steps is None or cache_steps < steps:
            raise ValueError(f"selective_state_update: cache_steps {cache_steps} < {steps} steps")
        buf = intermediate_states_buffer.view(-1, cache_steps, nheads, dim, dstate)
        if intermediate_state_indices is not None:
            rows = intermediate_state_indices.to(torch.long)
        else:
            rows = slots
        keep = valid if state_batch_indices is not None else torch.ones_like(valid)
    for t in range(steps):
        d = dts[:, t].to(cd)
        if bias2 is not None:
            d = d + bias2.to(cd)
        if dt_softplus:
            d = _softplus(d)
        xt = xs[:, t].to(cd)  # [b, H, P]
        bt = Bs[:, t].to(cd)[:, group]  # [b, H, N]
        ct = Cs[:, t].to(cd)[:, group]
        s = s * torch.exp(a * d.unsqueeze(-1)) + (d * xt).unsqueeze(-1) * bt.unsqueeze(-2)
        if buf is not None and bool(keep.any()):
            buf[rows[keep], t] = s[keep].to(buf.dtype)
        y = (s * ct.unsqueeze(-2)).sum(-1)
        if D2 is not None:
            y = y + xt * D2.to(cd)
        if zs is not None:
            zt = zs[:, t].to(cd)
            y = y * F.silu(zt)
        outs[:, t] = y.to(outs.dtype)
    if not disable_state_update and bool(valid.any()):
        pool[slots[valid]] = s[valid].to(pool.dtype)


# --------------------------------------------------------------------------------------------------
# prefill: mamba_chunk_scan_combined
# --------------------------------------------------------------------------------------------------


def _runs(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of ``seg [T]``: the start index of its run of equal ids, and the run boundaries.

    Returns ``(run_start [T] long, run_bounds [R + 1] long)``."""
    length = seg.shape[0]
    is_start = torch.ones(length, dtype=torch.bool, device=seg.device)
    is_start[1:] = seg[1:] != seg[:-1]
    pos = torch.arange(length, device=seg.device)
    starts = pos[is_start]
    run_start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), 0).values
    return run_start, torch.cat([starts, pos.new_tensor([length])])


#: Largest spread of the in-chunk cumulative log-decay (per chunk and head) for which the intra-chunk
#: decay matrix is factorised as ``e^{cum_t - m} e^{m - cum_s}`` (``m`` the midpoint: both factors
#: within ``e^{+-40}``, far inside fp32's range, and each product as accurate as one ``exp``);
#: wider spreads (fast decay) use the direct per-head ``[Q, Q]`` exponentials.
FACTORISE_MAX_SPREAD = 80.0

#: Largest chunk the scan computes in. A larger ``chunk_size`` (SGLang's default is 256) is evaluated
#: on this finer grid, whose boundaries include every ``chunk_size`` boundary, and ``states`` keeps
#: every ``chunk_size / INNER_CHUNK``-th row: the same states, for a quadratic part ``T * 64`` instead
#: of ``T * chunk_size`` (and factorised more often, spreads being shorter).
INNER_CHUNK = 64


class _Scan:
    """The chunked scan of one batch row; keeps what the state queries need.

    Layout: heads as ``[G, R]`` (``R = H / G`` heads per group, head ``h = g R + r``) so B and C are
    never expanded to heads, tokens of a chunk before heads. Attributes (``nc`` chunks of ``Q``,
    compute dtype): xg ``[nc, G, Q, R, P]`` (``dt * x``), bg ``[nc, G, Q, N]`` (B), cum
    ``[nc, G, Q, R]``, h ``[nc + 1, G, R, P, N]`` (state at every chunk start; ``h[nc]`` after the
    last chunk), y ``[T, H, P]`` (outputs without the ``D`` term and the gate).
    """

    def __init__(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        seg: torch.Tensor,
        init: torch.Tensor | None,
        chunk: int,
    ) -> None:
        length, nheads, dim = x.shape
        ngroups, dstate = B.shape[1:]
        rep = nheads // ngroups
        cd, dev = dt.dtype, x.device
        nc = max(1, math.ceil(length / chunk))
        pad = nc * chunk - length
        padded = nc * chunk
        shape_tok = (nc, chunk, ngroups, rep)

        xg = F.pad(x.to(cd) * dt.unsqueeze(-1), (0, 0, 0, 0, 0, pad)).view(*shape_tok, dim).transpose(1, 2)
        xg = xg.contiguous()  # [nc, G, Q, R, P]
        c_tok = F.pad(C.to(cd), (0, 0, 0, 0, 0, pad))  # [L, G, N]
        bg = F.pad(B.to(cd), (0, 0, 0, 0, 0, pad)).view(nc, chunk, ngroups, dstate).transpose(1, 2)
        cg = c_tok.view(nc, chunk, ngroups, dstate).transpose(1, 2)  # [nc, G, Q, N]
        segp = F.pad(seg, (0, pad), value=-1).view(nc, chunk)
        cum_tok = F.pad(dt * A.to(cd), (0, 0, 0, pad)).view(nc, chunk, nheads).cumsum(1).view(padded, nheads)
        cum = cum_tok.view(shape_tok).transpose(1, 2)  # [nc, G, Q, R]
        run_start, run_bounds = _runs(seg)

        # Boundary log-decay of every token's sequence: cum just before its start if that start lies
        # inside the token's chunk, else 0 (the sequence continues from an earlier chunk or starts on
        # the chunk boundary). exp(cum_t - bnd_t) decays a state held at the chunk start / sequence
        # start up to token t.
        tok = torch.arange(length, device=dev)
        inside = (run_start > (tok // chunk) * chunk).unsqueeze(-1)
        bnd_tok = torch.where(
            inside, cum_tok[(run_start - 1).clamp(min=0)], torch.zeros_like(cum_tok[:length])
        )
        bnd = F.pad(bnd_tok, (0, 0, 0, pad)).view(shape_tok).transpose(1, 2)  # [nc, G, Q, R]

        # 1. intra-chunk (diagonal blocks): y_t = sum_{s<=t, same seq} (C_t.B_s) e^{cum_t-cum_s} dt_s x_s
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril()
        same = ((segp.unsqueeze(-1) == segp.unsqueeze(-2)) & causal).to(cd)  # [nc, Q(t), Q(s)]
        cb = (cg @ bg.transpose(-1, -2)) * same.unsqueeze(1)  # [nc, G, Q, Q], masked
        hi, lo = cum.amax(2, keepdim=True), cum.amin(2, keepdim=True)  # [nc, G, 1, R]
        if bool(((hi - lo) <= FACTORISE_MAX_SPREAD).all()):
            mid = 0.5 * (hi + lo)
            e_out = torch.exp(cum - mid).unsqueeze(-1)
            e_in = torch.exp(mid - cum).unsqueeze(-1)
            y = (cb @ (xg * e_in).view(nc, ngroups, chunk, rep * dim)).view_as(xg) * e_out
        else:
            cum_h = cum.transpose(2, 3)  # [nc, G, R, Q]
            decay = torch.exp((cum_h.unsqueeze(-1) - cum_h.unsqueeze(-2)) * same[:, None, None])
            y = ((cb.unsqueeze(2) * decay) @ xg.transpose(2, 3)).transpose(2, 3)

        # 2. per-chunk input states: the tokens of the sequence at the chunk end, decayed to it
        last = torch.clamp(torch.arange(1, nc + 1, device=dev) * chunk, max=length) - 1  # [nc]
        first = last - (last % chunk)  # first token of every chunk
        seg_last = seg[last]
        cum_last = cum[:, :, -1]  # [nc, G, R] (padding has dt = 0)
        w = torch.exp(cum_last.unsqueeze(2) - cum) * (segp == seg_last.unsqueeze(1))[:, None, :, None]
        s_in = (xg * w.unsqueeze(-1)).view(nc, ngroups, chunk, rep * dim).transpose(-1, -2) @ bg
        s_in = s_in.view(nc, ngroups, rep, dim, dstate)

        # 3. inter-chunk recurrence h[c + 1] = a_c h[c] + b_c: carry if the chunk-end sequence was
        # already running before the chunk, else restart from that sequence's initial state.
        carried = (run_start[last] < first)[:, None, None]  # [nc, 1, 1]
        carry = (torch.exp(cum_last) * carried)[..., None, None]  # [nc, G, R, 1, 1]
        b = s_in
        init_g = None
        if init is not None:
            init_g = init.to(cd).view(-1, ngroups, rep, dim, dstate)
            bnd_last = bnd[torch.arange(nc, device=dev), :, last - first]  # [nc, G, R]
            restart = torch.exp(cum_last - bnd_last) * ~carried
            b = b + restart[..., None, None] * init_g[seg_last]
        h = torch.empty(nc + 1, ngroups, rep, dim, dstate, dtype=cd, device=dev)
        h[0] = 0 if init_g is None else init_g[0]
        for c in range(nc):
            torch.addcmul(b[c], carry[c], h[c], out=h[c + 1])

        # 4. carried state -> outputs: tokens of a sequence running since an earlier chunk read h[c],
        # a sequence's tokens in the chunk where it starts read its initial state (both decayed by
        # exp(cum_t - bnd_t)).
        first_tok = (torch.arange(nc, device=dev) * chunk).unsqueeze(1)
        cont = F.pad(run_start, (0, pad), value=length).view(nc, chunk) < first_tok  # [nc, Q]
        h_cols = h[:nc].permute(0, 1, 4, 2, 3).reshape(nc, ngroups, dstate, rep * dim)
        y_state = ((cg * cont[:, None, :, None]) @ h_cols).view_as(xg)
        if init_g is not None:
            y_init = self._init_outputs(c_tok, init_g, seg, run_bounds, chunk)  # [L, G, R, P]
            y_state = y_state + y_init.view(*shape_tok, dim).transpose(1, 2)
        y = y + y_state * torch.exp(cum - bnd).unsqueeze(-1)

        self.chunk, self.xg, self.bg, self.cum, self.h = chunk, xg, bg, cum, h
        self.y = y.transpose(1, 2).reshape(padded, nheads, dim)[:length]

    @staticmethod
    def _init_outputs(
        c_tok: torch.Tensor, init_g: torch.Tensor, seg: torch.Tensor, run_bounds: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        """``C_t . init[seq(t)]`` for each sequence's tokens in the chunk where it starts (else 0).

        ``c_tok [L, G, N]``, ``init_g [nseq, G, R, P, N]``; returns ``[L, G, R, P]``. One
        ``[Q]``-padded block per sequence (run), so memory stays ``O(runs Q H max(P, N))``."""
        padded, ngroups, dstate = c_tok.shape
        _, _, rep, dim, _ = init_g.shape
        out = torch.zeros(padded, ngroups, rep, dim, dtype=c_tok.dtype, device=c_tok.device)
        starts, ends = run_bounds[:-1], run_bounds[1:]
        stop = torch.minimum(ends, (starts // chunk + 1) * chunk)
        offs = torch.arange(chunk, device=c_tok.device)
        valid = offs < (stop - starts).unsqueeze(1)  # [runs, Q]
        idx = (starts.unsqueeze(1) + offs).clamp(max=seg.shape[0] - 1)  # [runs, Q]
        cols = init_g[seg[starts]].permute(0, 1, 4, 2, 3).reshape(-1, ngroups, dstate, rep * dim)
        vals = c_tok[idx].transpose(1, 2) @ cols  # [runs, G, Q, R * P]
        out[idx[valid]] = vals.transpose(1, 2)[valid].view(-1, ngroups, rep, dim)
        return out

    def states_at(
        self, starts: torch.Tensor, ends: torch.Tensor, init_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Exact states after tokens ``[starts[q], ends[q])`` of one sequence each (flattened
        positions; ``init_rows [nq, H, P, N]`` the sequences' initial states or None for zeros).

        Mirrors ``chunk_state_varlen``: the chunk ``c`` holding token ``end - 1`` contributes its
        tokens from ``max(start, c Q)``; the base is ``h[c]`` if the sequence started before chunk
        ``c``, else the initial state decayed from the sequence start (an empty range gives the
        initial state). Returns ``[nq, H, P, N]``."""
        nq = starts.shape[0]
        _, ngroups, rep, dim, dstate = self.h.shape
        dev = self.h.device
        init_g = None if init_rows is None else init_rows.to(self.h.dtype).view(nq, ngroups, rep, dim, dstate)
        e = torch.maximum(ends, starts + 1)  # empty ranges: computed on one token, replaced below
        c = (e - 1) // self.chunk
        lo = torch.clamp(starts - c * self.chunk, min=0)  # first contributing offset in chunk c
        hi = e - 1 - c * self.chunk  # last contributing offset
        offs = torch.arange(self.chunk, device=dev)
        window = (offs >= lo.unsqueeze(1)) & (offs <= hi.unsqueeze(1))  # [nq, Q]
        cum_c = self.cum[c]  # [nq, G, Q, R]
        rows = torch.arange(nq, device=dev)
        cum_hi = cum_c[rows, :, hi]  # [nq, G, R]
        win = window[:, None, :, None].to(cum_c.dtype)
        w = torch.exp((cum_hi.unsqueeze(2) - cum_c) * win) * win  # masked before exp: no inf * 0
        st = (self.xg[c] * w.unsqueeze(-1)).view(nq, ngroups, self.chunk, rep * dim).transpose(-1, -2)
        st = (st @ self.bg[c]).view(nq, ngroups, rep, dim, dstate)
        before = (starts < c * self.chunk)[:, None, None]
        st = st + self.h[c] * (torch.exp(cum_hi) * before)[..., None, None]
        if init_g is not None:
            cum_bnd = cum_c[rows, :, (lo - 1).clamp(min=0)] * (lo > 0)[:, None, None]
            st = st + init_g * (torch.exp(cum_hi - cum_bnd) * ~before)[..., None, None]
        empty = (ends <= starts)[:, None, None, None, None]
        st = torch.where(empty, 0.0 if init_g is None else init_g, st)
        return st.view(nq, ngroups * rep, dim, dstate)


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    out: torch.Tensor | None = None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
    return_track_states: bool = False,
    track_seq_idx: torch.Tensor | None = None,
    track_end_locs: torch.Tensor | None = None,
) -> Any:
    """Chunked Mamba2 prefill (``triton_ops.ssd_combined.mamba_chunk_scan_combined``'s contract).

    Args:
        x: ``[batch, T, H, P]``; dt: ``[batch, T, H]``; A: ``[H]``; B, C: ``[batch, T, G, N]``.
        chunk_size: ``Q``, a power of two (the flattened grid; see the module docstring).
        D: ``[H]`` or ``[H, P]``; z: ``[batch, T, H, P]`` gate; dt_bias: ``[H]``.
        initial_states: ``[nseq, H, P, N]`` with ``cu_seqlens`` (one per sequence, ``seq_idx``
            required), else ``[batch, H, P, N]``.
        seq_idx: ``[batch, T]`` sequence id of every token (non-decreasing runs).
        cu_seqlens: ``[nseq + 1]`` (used only with ``return_varlen_states``; ``batch == 1``).
        out: ``[batch, T, H, P]``, written in place (required).
        track_seq_idx, track_end_locs: ``[ntrack]`` sequence ids and flattened end positions of the
            extra states to return with ``return_track_states``.

    Returns (as Triton): with ``return_track_states``: ``(states, varlen_states, track_states)``
    (``track_states`` None when nothing is tracked); else with ``return_intermediate_states``:
    ``states`` plus ``final_states`` / ``varlen_states`` as requested, in that order; else None,
    ``final_states``, ``varlen_states`` or ``(final_states, varlen_states)``.
    """
    del chunk_indices, chunk_offsets  # implied by seq_idx (see the module docstring)
    if not _is_pow2(chunk_size):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if out is None:
        raise ValueError("mamba_chunk_scan_combined: out is required (in-place output, as in Triton)")
    if not return_varlen_states:
        cu_seqlens = None
    elif cu_seqlens is None:
        raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
    if return_track_states and not return_varlen_states:
        raise ValueError("return_track_states requires return_varlen_states (cu_seqlens mode)")
    batch, length, nheads, dim = x.shape
    ngroups, dstate = B.shape[2:]
    if nheads % ngroups or B.shape != (batch, length, ngroups, dstate) or C.shape != B.shape:
        raise ValueError(f"B/C {tuple(B.shape)} do not match x {tuple(x.shape)}")
    if dt.shape != (batch, length, nheads) or A.shape != (nheads,) or out.shape != x.shape:
        raise ValueError(
            f"dt {tuple(dt.shape)} / A {tuple(A.shape)} / out {tuple(out.shape)} vs x {tuple(x.shape)}"
        )
    if seq_idx is not None and seq_idx.shape != (batch, length):
        raise ValueError(f"seq_idx {tuple(seq_idx.shape)} != {(batch, length)}")
    cont = cu_seqlens is not None
    if cont:
        if batch != 1:
            raise ValueError("varlen states need batch == 1")
        nseq = cu_seqlens.shape[0] - 1
        if initial_states is not None:
            if seq_idx is None:
                raise ValueError("seq_idx must be provided with initial_states for continuous batching")
            if initial_states.shape != (nseq, nheads, dim, dstate):
                raise ValueError(
                    f"initial_states {tuple(initial_states.shape)} != {(nseq, nheads, dim, dstate)}"
                )
    elif initial_states is not None:
        if seq_idx is not None:
            raise NotImplementedError("initial_states with seq_idx need cu_seqlens (return_varlen_states)")
        if initial_states.shape != (batch, nheads, dim, dstate):
            raise ValueError(
                f"initial_states {tuple(initial_states.shape)} != {(batch, nheads, dim, dstate)}"
            )

    cd = _compute_dtype(x)
    d = dt.to(cd)
    if dt_bias is not None:
        d = d + dt_bias.to(cd)
    if dt_softplus:
        d = _softplus(d)
    d = d.clamp(min=dt_limit[0], max=dt_limit[1])
    out_dtype = state_dtype if state_dtype is not None else C.dtype

    inner = min(chunk_size, INNER_CHUNK)
    scans: list[_Scan] = []
    for b in range(batch):
        seg = (
            seq_idx[b].to(torch.long)
            if seq_idx is not None
            else torch.zeros(length, dtype=torch.long, device=x.device)
        )
        init = None
        if initial_states is not None:
            init = initial_states if cont else initial_states[b : b + 1]
        scan = _Scan(x[b], d[b], A, B[b], C[b], seg, init, inner)
        y = scan.y
        if D is not None:
            dd = D.to(cd)
            y = y + x[b].to(cd) * (dd.unsqueeze(-1) if dd.dim() == 1 else dd)
        if z is not None:
            y = y * F.silu(z[b].to(cd))
        out[b] = y.to(out.dtype)
        scans.append(scan)

    grid_rows = torch.arange(math.ceil(length / chunk_size), device=x.device) * (chunk_size // inner)
    states = torch.stack([s.h[grid_rows] for s in scans]).flatten(2, 3).to(out_dtype)
    final_states = torch.stack([s.h[-1] for s in scans]).flatten(1, 2).to(torch.float32)
    varlen_states = track_states = None
    if cont:
        # final states of all sequences and the tracked states, in one query batch
        bounds = cu_seqlens.to(device=x.device, dtype=torch.long)
        q_start, q_end, q_seq = bounds[:-1], bounds[1:], torch.arange(nseq, device=x.device)
        ntrack = 0
        if track_seq_idx is not None and track_end_locs is not None and track_end_locs.numel() > 0:
            k = track_seq_idx.to(device=x.device, dtype=torch.long)
            ntrack = k.shape[0]
            q_start = torch.cat([q_start, bounds[k]])
            q_end = torch.cat([q_end, track_end_locs.to(device=x.device, dtype=torch.long)])
            q_seq = torch.cat([q_seq, k])
        init_rows = None if initial_states is None else initial_states[q_seq]
        got = scans[0].states_at(q_start, q_end, init_rows).to(out_dtype)
        varlen_states = got[:nseq]
        if ntrack:
            track_states = got[nseq:].unsqueeze(0)

    if return_track_states:
        return states, varlen_states, track_states
    if return_intermediate_states:
        if return_varlen_states:
            return (states, final_states, varlen_states) if return_final_states else (states, varlen_states)
        return (states, final_states) if return_final_states else states
    if not return_varlen_states:
        return final_states if return_final_states else None
    return (final_states, varlen_states) if return_final_states else varlen_states

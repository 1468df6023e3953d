"""Chunked (WY / UT-transform) gated-delta-rule forward in pure PyTorch, capturing states at chunk boundaries.

Shapes and semantics are those of :mod:`sglang_sparse_kernels.gdn_capture.naive` (FLA conventions): ``q, k``
``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``, ``g, beta`` ``[B, T, HV]``, log-space decay ``g``, states
``[N, HV, K, V]`` float32 (key-first).  Everything is computed in float32.

Algorithm, per sequence, value head and chunk of ``C`` (= 64) tokens with state ``S0`` at its start and
in-chunk cumulative decay ``G_i = g_1 + ... + g_i``:

* ``A_ij = beta_i exp(G_i - G_j) k_i.k_j`` for ``j < i`` (strictly lower triangular) and
  ``T = (I + A)^{-1}`` (UT transform; applied by a unit-lower-triangular solve, never formed);
* ``U = T (beta * v)``, ``W = T (beta * exp(G) * k)``  (WY representation);
* the delta-rule residuals ("new values") are ``D = U - W S0``;
* ``O = scale * [(q * exp(G)) S0 + ((q k^T) * exp(G_i - G_j))_{j <= i} D]``;
* ``S_C = exp(G_C) S0 + (k * exp(G_C - G))^T D``.

The intra-chunk work is batched over all chunks; only the ``S0 -> S_C`` recurrence is a Python loop over
chunks, and capturing a boundary is a copy of ``S0`` before the chunk runs, so capture costs O(captured
states) memory traffic and nothing else.  Sequences whose length is not a multiple of ``C`` are padded
with ``k = v = q = 0, beta = 0, g = 0``, which leaves the state unchanged, so the final state is exact.
Variable-length batches (``cu_seqlens``, SGLang's packed layout) are unpacked into a zero-padded
``[N, T_max]`` batch.

This module also holds the input validation shared by the naive and Triton paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "CaptureSpec",
    "chunk_gdn_fwd_capture",
    "check_inputs",
    "l2norm",
    "normalize_capture",
    "seq_bounds",
]

#: One strictly increasing list of boundaries shared by all sequences, or one list per sequence.
CaptureSpec = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` in float32 (FLA's ``l2norm_fwd``)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _as_int_list(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        return [int(x) for x in cu_seqlens.tolist()]
    out = []
    for x in cu_seqlens:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"cu_seqlens entries must be ints, got {x!r}")
        out.append(x)
    return out


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate shapes / dtypes / devices and return ``(B, T, H, K, HV, V)``.

    Raises:
        TypeError: non-tensor inputs, non-floating dtypes, ``q/k/v`` dtype mismatch.
        ValueError: shape mismatches, ``HV % H != 0``, bad ``cu_seqlens`` or ``initial_state``.
    """
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {x.device for x in named.values()}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v must be 4-D [B, T, heads, dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape [B, T, H, K], got {tuple(q.shape)} vs {tuple(k.shape)}"
        )
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"num value heads HV={HV} must be a positive multiple of num qk heads H={H}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch dim must be 1 (packed sequences), got B={B}")
        cu = _as_int_list(cu_seqlens)
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != T:
            raise ValueError(f"cu_seqlens must start at 0, end at T={T} and have >= 2 entries, got {cu}")
        if any(b < a for a, b in zip(cu, cu[1:], strict=False)):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
        N = len(cu) - 1
    else:
        N = B
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        if initial_state.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"initial_state must be floating, got {initial_state.dtype}")
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)} (key-first), "
                f"got {tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device}, inputs on {q.device}")
    return B, T, H, K, HV, V


def seq_bounds(B: int, T: int, cu_seqlens: torch.Tensor | Sequence[int] | None) -> list[tuple[int, int, int]]:
    """List of ``(batch_row, start, end)`` token ranges, one per sequence (``end`` exclusive)."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = _as_int_list(cu_seqlens)
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _check_boundary_list(
    items: Sequence[int], limit_tokens: int, unit: int, name: str, seq: int
) -> list[int]:
    out: list[int] = []
    for x in items:
        if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_floating_point:
            x = int(x)
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} entries must be ints, got {x!r}")
        if x < 0 or x * unit > limit_tokens:
            what = f"chunk {x} (token {x * unit})" if unit > 1 else f"position {x}"
            raise ValueError(
                f"{name}: {what} out of range for sequence {seq} of length {limit_tokens}; "
                f"valid values are 0..{limit_tokens // unit}"
            )
        if out and x <= out[-1]:
            raise ValueError(f"{name} must be strictly increasing (sorted, no duplicates), got {list(items)}")
        out.append(x)
    return out


def normalize_capture(
    spec: CaptureSpec | None, lengths: Sequence[int], unit: int, name: str
) -> tuple[list[list[int]], bool]:
    """Validate a capture spec against per-sequence token lengths.

    ``unit`` is the number of tokens per boundary index (1 for positions, ``chunk_size`` for chunks).
    Returns ``(per_sequence_lists, shared)`` where ``shared`` is True when one list applies to all.
    """
    N = len(lengths)
    if spec is None:
        return [[] for _ in range(N)], True
    if isinstance(spec, torch.Tensor):
        if spec.dim() != 1 or spec.dtype.is_floating_point:
            raise TypeError(
                f"{name} tensor must be a 1-D integer tensor, got {spec.dtype} {tuple(spec.shape)}"
            )
        spec = [int(x) for x in spec.tolist()]
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise TypeError(
            f"{name} must be a sequence of ints or a list of per-sequence sequences, got {spec!r}"
        )
    items = list(spec)
    nested = len(items) > 0 and all(isinstance(x, (Sequence, torch.Tensor)) for x in items)
    if nested:
        if len(items) != N:
            raise ValueError(f"{name}: got {len(items)} per-sequence lists for {N} sequences")
        per = []
        for n, lst in enumerate(items):
            lst = lst.tolist() if isinstance(lst, torch.Tensor) else lst
            per.append(_check_boundary_list(list(lst), lengths[n], unit, name, n))
        return per, False
    per = [_check_boundary_list(items, lengths[n], unit, name, n) for n in range(N)]
    return per, True


def chunk_gdn_fwd_capture(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    """One-pass chunked gated-delta-rule forward returning output, final state and boundary states.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]`` with ``HV % H == 0`` (GVA).
        g: ``[B, T, HV]`` natural-log decay; ``beta``: ``[B, T, HV]``.
        scale: output scale (default ``K ** -0.5``).
        initial_state: ``[N, HV, K, V]`` (any float dtype; used in float32), zeros if None.
        capture_chunks: chunk-boundary indices ``c`` (strictly increasing, ``0 <= c * chunk_size <= T_n``):
            either one list shared by all ``N`` sequences or a list of ``N`` lists. Boundary ``c`` is the
            state after the first ``c * chunk_size`` tokens of the sequence (``0`` = ``initial_state``).
        chunk_size: tokens per chunk (positive; 64 matches FLA / the Triton path).
        cu_seqlens: optional ``[N + 1]`` cumulative lengths of packed sequences (then ``B == 1``).
        use_qk_l2norm: l2-normalise ``q`` and ``k`` first (FLA ``use_qk_l2norm_in_kernel``).

    Returns:
        ``(o, final_state, states)``: ``o`` ``[B, T, HV, V]`` in ``q.dtype``; ``final_state``
        ``[N, HV, K, V]`` float32; ``states`` float32 ``[N, P, HV, K, V]`` for a shared list of ``P``
        boundaries (``states[n, i]`` = state of sequence ``n`` after ``capture_chunks[i] * chunk_size``
        tokens), or a list of ``N`` tensors ``[P_n, HV, K, V]`` for per-sequence lists.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    bounds = seq_bounds(B, T, cu_seqlens)
    N = len(bounds)
    lengths = [end - start for _, start, end in bounds]
    per_seq, shared = normalize_capture(capture_chunks, lengths, unit=chunk_size, name="capture_chunks")
    if scale is None:
        scale = K**-0.5
    C = chunk_size
    G = HV // H
    dev = q.device
    f32 = torch.float32

    # ---- unpack into a zero-padded [N, NT*C, heads, dim] batch -------------------------------------
    L = max(lengths) if lengths else 0
    NT = -(-L // C)
    Lp = NT * C
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    if cu_seqlens is None and Lp == T:
        qp, kp, vp, gp, bp = qf, kf, v.float(), g.float(), beta.float()
    else:
        qp = q.new_zeros(N, Lp, H, K, dtype=f32)
        kp = torch.zeros_like(qp)
        vp = q.new_zeros(N, Lp, HV, V, dtype=f32)
        gp = q.new_zeros(N, Lp, HV, dtype=f32)
        bp = torch.zeros_like(gp)
        for n, (b, s, e) in enumerate(bounds):
            ln = e - s
            qp[n, :ln], kp[n, :ln], vp[n, :ln] = qf[b, s:e], kf[b, s:e], v[b, s:e].float()
            gp[n, :ln], bp[n, :ln] = g[b, s:e].float(), beta[b, s:e].float()

    # ---- batched intra-chunk work: [N, HV, NT, C, dim] --------------------------------------------
    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [N, Lp, h, d] -> [N, HV, NT, C, d]
        if x.shape[2] != HV:
            x = x.repeat_interleave(G, dim=2)
        return x.permute(0, 2, 1, 3).reshape(N, HV, NT, C, x.shape[-1])

    qc, kc, vc = heads_first(qp), heads_first(kp), heads_first(vp)
    gc = gp.permute(0, 2, 1).reshape(N, HV, NT, C).cumsum(-1)  # in-chunk cumulative log decay
    bc = bp.permute(0, 2, 1).reshape(N, HV, NT, C)

    idx = torch.arange(C, device=dev)
    causal = idx[:, None] >= idx[None, :]  # j <= i
    diff = gc[..., :, None] - gc[..., None, :]  # G_i - G_j
    decay_incl = diff.masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j) on j <= i, else 0
    kk = kc @ kc.transpose(-1, -2)
    strict = idx[:, None] > idx[None, :]  # j < i
    A = (bc[..., :, None] * kk * decay_incl).masked_fill(~strict, 0.0)  # strictly lower
    eye = torch.eye(C, device=dev, dtype=f32)
    rhs = torch.cat([bc[..., None] * vc, (bc * gc.exp())[..., None] * kc], dim=-1)  # [.., C, V + K]
    sol = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    U, W = sol[..., :V], sol[..., V:]
    del A, rhs, sol, kk

    Aqk = (qc @ kc.transpose(-1, -2)) * decay_incl * scale  # [.., C, C], lower incl. diagonal
    Qg = qc * (gc.exp() * scale)[..., None]  # [.., C, K]
    g_last = gc[..., -1]  # [N, HV, NT]
    Kd = kc * (g_last[..., None] - gc).exp()[..., None]  # [.., C, K]
    chunk_decay = g_last.exp()
    del decay_incl, diff, qc, vc

    # ---- capture bookkeeping ---------------------------------------------------------------------
    want: dict[int, list[tuple[int, int]]] = {}
    for n, lst in enumerate(per_seq):
        for slot, c in enumerate(lst):
            want.setdefault(c, []).append((n, slot))
    out_states = [q.new_empty(len(lst), HV, K, V, dtype=f32) for lst in per_seq]

    # ---- sequential inter-chunk recurrence -------------------------------------------------------
    if initial_state is None:
        S = q.new_zeros(N, HV, K, V, dtype=f32)
    else:
        S = initial_state.to(f32).clone()
    o = q.new_empty(N, HV, NT, C, V, dtype=f32)
    for i in range(NT + 1):
        for n, slot in want.get(i, ()):
            out_states[n][slot] = S[n]
        if i == NT:
            break
        D = U[:, :, i] - W[:, :, i] @ S  # [N, HV, C, V]
        o[:, :, i] = Qg[:, :, i] @ S + Aqk[:, :, i] @ D
        S = chunk_decay[:, :, i, None, None] * S + Kd[:, :, i].transpose(-1, -2) @ D

    # ---- repack ------------------------------------------------------------------------------------
    o = o.reshape(N, HV, Lp, V).permute(0, 2, 1, 3)  # [N, Lp, HV, V]
    if cu_seqlens is None:
        out = o[:, :T]
    else:
        out = q.new_empty(1, T, HV, V, dtype=f32)
        for n, (_, s, e) in enumerate(bounds):
            out[0, s:e] = o[n, : e - s]
    states: torch.Tensor | list[torch.Tensor]
    states = torch.stack(out_states) if shared else out_states
    return out.to(q.dtype).contiguous(), S, states

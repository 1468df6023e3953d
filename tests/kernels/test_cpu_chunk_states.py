"""Per-chunk states ``h`` of the CPU ``sgl_kernel`` shim's GDN prefill (SGLang's extra_buffer input).

SGLang's ``extra_buffer`` Mamba radix-cache strategy snapshots a prefill's state at the last chunk
boundary it wants to cache by gathering ``h.squeeze(0)[h_src]`` (``hybrid_linear_attn_backend.py``
``_track_mamba_state_extend``), with ``h_src = h_offset[row] + rel // 64`` and ``h_offset`` the
running sum of ``ceil(len / 64)`` (``prefill_track_metadata.build_prefill_track_plan``). These tests
check that :func:`chunk_gated_delta_rule` (the CPU stand-in of SGLang's Triton kernel) returns
exactly those states (against the token-by-token reference
:func:`sglang_sparse_kernels.gdn_capture.naive.naive_recurrent_gdn`), in the pool's ``[HV, V, K]``
layout, and that :func:`fused_recurrent_gated_delta_rule_update` (the stand-in of SGLang's recurrent
kernel, which advances an ``h`` row to an off-grid capture) matches an fp64 recurrence.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from sglang_sparse_kernels.gdn_capture.naive import naive_recurrent_gdn  # noqa: E402
from sglang_sparse_kernels.sgl_kernel_cpu import l2norm  # noqa: E402
from sglang_sparse_kernels.sgl_kernel_cpu.delta_rule import (  # noqa: E402
    DEFAULT_CHUNK,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
)
from sparse_testing.gdn_reference import gdn_states_fp64  # noqa: E402

pytestmark = pytest.mark.kernel

H, HV, K, V = 2, 4, 16, 8
TOL = 3e-5
C = DEFAULT_CHUNK


def _inputs(batch: int, total: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, total, H, K, generator=gen)
    k = torch.randn(batch, total, H, K, generator=gen)
    v = torch.randn(batch, total, HV, V, generator=gen)
    g = -torch.rand(batch, total, HV, generator=gen) * 0.3
    beta = torch.rand(batch, total, HV, generator=gen)
    return q, k, v, g, beta


def _packed(lengths: list[int], seed: int = 0):
    """Packed inputs, a pool ``[n + 2, HV, V, K]`` with random states in slots ``1..n`` (slot 0 and
    the last one unused), the working indices and the initial states in the naive (K-first) layout."""
    q, k, v, g, beta = _inputs(1, sum(lengths), seed)
    n = len(lengths)
    cu_seq = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    init = torch.randn(n, HV, K, V, generator=torch.Generator().manual_seed(seed + 1)) * 0.5
    pool = torch.zeros(n + 2, HV, V, K)
    pool[1 : n + 1] = init.transpose(-1, -2)
    return (q, k, v, g, beta), cu_seq, pool, torch.arange(1, n + 1), init


def _h_offsets(lengths: list[int]) -> list[int]:
    """First ``h`` row of each sequence: the running sum of ``ceil(len / C)``."""
    rows = [0]
    for n in lengths:
        rows.append(rows[-1] + -(-n // C))
    return rows


@pytest.mark.parametrize(
    "lengths",
    [[1], [63], [64], [65], [300], [70, 5, 200, 64], [128, 1, 129]],
    ids=lambda x: "-".join(map(str, x)),
)
def test_h_rows_are_states_before_each_chunk(lengths: list[int]) -> None:
    """Row ``h_offset[n] + c`` equals the reference state after ``c * C`` tokens of sequence ``n``."""
    qkvgb, cu_seq, pool, work, init = _packed(lengths, seed=len(lengths))
    o, fin, h = chunk_gated_delta_rule(*qkvgb, pool, True, cu_seq, False, True, work)
    rows = _h_offsets(lengths)
    assert h.shape == (1, rows[-1], HV, V, K) and h.dtype == torch.float32
    q, k, v, g, beta = qkvgb
    positions = [list(range(0, n, C)) for n in lengths]  # one per chunk: 0, C, 2C, ... < len
    ref_o, ref_fin, ref_caps = naive_recurrent_gdn(
        l2norm(q), l2norm(k), v, g, beta, initial_state=init, capture_positions=positions, cu_seqlens=cu_seq
    )
    assert float((o - ref_o).abs().max()) < TOL
    assert float((fin - ref_fin.transpose(-1, -2)).abs().max()) < TOL
    for s, pos in enumerate(positions):
        for c in range(len(pos)):
            got = h[0, rows[s] + c]  # [HV, V, K], the pool layout
            want = ref_caps[s][c].transpose(-1, -2)
            assert float((got - want).abs().max()) < TOL, (s, c)
        if pos:  # row 0 of every sequence is its initial state, exactly
            assert torch.equal(h[0, rows[s]], init[s].transpose(-1, -2))


def test_h_as_sglang_indexes_it() -> None:
    """SGLang's own plan (``build_prefill_track_plan``) applied to ``h`` yields the state at each
    request's cached length (``track_len - prefix_len`` rounded down to the chunk grid)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    plan_mod = pytest.importorskip("sglang.srt.layers.attention.mamba.prefill_track_metadata")
    lengths = [150, 64, 200, 10, 130]
    prefix = [0, 64, 0, 0, 128]  # tokens already cached (the extend starts after them)
    track = [p + n for p, n in zip(prefix, lengths, strict=True)]  # track the whole extend
    mask = [True, True, True, False, True]
    plan = plan_mod.build_prefill_track_plan(mask, track, lengths, prefix, C, mamba2=False)
    qkvgb, cu_seq, pool, work, init = _packed(lengths, seed=7)
    _, _, h = chunk_gated_delta_rule(*qkvgb, pool, True, cu_seq, False, True, work)
    assert plan.h_rows == [0, 2, 4] and plan.final_rows == [1]  # 64 tokens: aligned, final state
    q, k, v, g, beta = qkvgb
    positions = [[(n // C) * C] for n in lengths]
    _, _, ref_caps = naive_recurrent_gdn(
        l2norm(q), l2norm(k), v, g, beta, initial_state=init, capture_positions=positions, cu_seqlens=cu_seq
    )
    snap = h.squeeze(0)[torch.tensor(plan.h_src)]  # exactly SGLang's gather
    for j, row in enumerate(plan.h_rows):
        want = ref_caps[row][0].transpose(-1, -2)
        assert float((snap[j] - want).abs().max()) < TOL, row


def test_batched_without_cu_seqlens_and_padding() -> None:
    """``B > 1`` without ``cu_seqlens``: ``h`` is ``[B, ceil(T / C), ...]``; a padding sequence
    (negative index) keeps zero rows and zero output."""
    q, k, v, g, beta = _inputs(3, 130, seed=2)
    init = torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(3))
    pool = torch.zeros(4, HV, V, K)
    pool[:3] = init.transpose(-1, -2)
    idx = torch.tensor([0, -1, 2])
    o, fin, h = chunk_gated_delta_rule(q, k, v, g, beta, pool, True, None, False, True, idx)
    assert h.shape == (3, 3, HV, V, K)
    assert not h[1].any() and not o[1].any()
    for b in (0, 2):
        _, _, ref_caps = naive_recurrent_gdn(
            l2norm(q[b : b + 1]),
            l2norm(k[b : b + 1]),
            v[b : b + 1],
            g[b : b + 1],
            beta[b : b + 1],
            initial_state=init[b : b + 1],
            capture_positions=[0, 64, 128],
        )
        got = h[b].transpose(-1, -2)  # [3, HV, K, V]
        assert float((got - ref_caps[0]).abs().max()) < TOL


def test_empty_batch_and_empty_sequence() -> None:
    q, k, v, g, beta = _inputs(1, 0, seed=0)
    _, fin, h = chunk_gated_delta_rule(q, k, v, g, beta, None, True, torch.tensor([0]), False, True)
    assert fin.shape == (0, HV, V, K) and h.shape == (1, 0, HV, V, K)
    q, k, v, g, beta = _inputs(1, 70, seed=0)
    cu = torch.tensor([0, 0, 70])  # the first sequence is empty: it owns no h row
    _, _, h = chunk_gated_delta_rule(q, k, v, g, beta, None, True, cu, False, True)
    assert h.shape == (1, 2, HV, V, K) and not h[0, 0].any()


def test_shim_wrapper_returns_the_ops_h() -> None:
    """``sgl_kernel.mamba.chunk_gated_delta_rule_cpu`` (what SGLang's ``TritonGDNKernel.extend``
    calls on the CPU) returns ``(o, final, h)`` of the op, bit for bit, as Triton returns ``h``."""
    mamba = pytest.importorskip("sgl_kernel.mamba")
    if not hasattr(mamba, "fused_recurrent_gated_delta_rule_update_cpu"):
        pytest.skip("a real sgl_kernel is installed, not the sglang-sparse CPU shim")
    qkvgb, cu_seq, pool, work, _ = _packed([100, 30], seed=5)
    p1, p2 = pool.clone(), pool.clone()
    got = mamba.chunk_gated_delta_rule_cpu(*qkvgb, p1, cu_seq, False, True, work)
    want = chunk_gated_delta_rule(*qkvgb, p2, True, cu_seq, False, True, work)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and torch.equal(p1, p2)
    assert got[2].shape == (1, 3, HV, V, K)


def test_fused_recurrent_update_matches_fp64() -> None:
    """Varlen sequences from slot-indexed states, in place (padding slot skipped); the output with
    it, none with ``disable_output_calculation``; the pool untouched with ``disable_state_update``."""
    lengths = [5, 40, 63]
    q, k, v, g, beta = _inputs(1, sum(lengths), seed=9)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    pool = torch.randn(6, HV, V, K, generator=torch.Generator().manual_seed(1)) * 0.5
    idx = torch.tensor([4, -1, 2])
    before = pool.clone()
    o = fused_recurrent_gated_delta_rule_update(
        q, k, v, g, beta, initial_state_source=pool, initial_state_indices=idx, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert o.shape == v.shape and not o[0, 5:45].any()  # the padding sequence: zero output
    for n, slot in ((0, 4), (2, 2)):
        lo, hi = int(cu[n]), int(cu[n + 1])
        want = gdn_states_fp64(k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], before[slot], [hi - lo])
        assert float((pool[slot].double() - want[hi - lo]).abs().max()) < 1e-5, n
    untouched = [s for s in range(6) if s not in (4, 2)]
    assert torch.equal(pool[untouched], before[untouched])
    p2 = before.clone()
    empty = fused_recurrent_gated_delta_rule_update(
        q, k, v, g, beta, initial_state_source=p2, initial_state_indices=idx, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True, disable_output_calculation=True,
    )  # fmt: skip
    assert empty.numel() == 0 and torch.equal(p2, pool)
    p3 = before.clone()
    o3 = fused_recurrent_gated_delta_rule_update(
        q, k, v, g, beta, initial_state_source=p3, initial_state_indices=idx, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True, disable_state_update=True,
    )  # fmt: skip
    assert torch.equal(p3, before) and torch.equal(o3, o)

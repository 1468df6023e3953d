"""List capture of the CPU ``sgl_kernel`` shim's GDN prefill and conv ops.

``chunk_gated_delta_rule(..., capture_*)`` must write, for every (sequence, offset, slot), the state
after ``offset`` tokens into ``pool[slot]`` in the pool's ``[HV, V, K]`` layout and dtype, equal to
the token-by-token reference (:func:`sglang_sparse_kernels.gdn_capture.naive.naive_recurrent_gdn`),
while the outputs and final states stay those of the plain call. ``capture_conv_states`` must write
exactly the conv state :func:`causal_conv1d_fwd` leaves after a sequence of ``offset`` tokens.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from sglang_sparse_kernels.gdn_capture.naive import naive_recurrent_gdn  # noqa: E402
from sglang_sparse_kernels.sgl_kernel_cpu import (  # noqa: E402
    capture_conv_states,
    causal_conv1d_fwd,
    chunk_gated_delta_rule,
    l2norm,
)

pytestmark = pytest.mark.kernel

H, HV, K, V = 2, 4, 16, 8
TOL = 3e-5


def _inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, H, K, generator=gen)
    k = torch.randn(1, total, H, K, generator=gen)
    v = torch.randn(1, total, HV, V, generator=gen)
    g = -torch.rand(1, total, HV, generator=gen) * 0.3
    beta = torch.rand(1, total, HV, generator=gen)
    return q, k, v, g, beta


def _run(lengths: list[int], offsets: list[list[int]], seed: int = 0, pool_dtype=torch.float32):
    total = sum(lengths)
    q, k, v, g, beta = _inputs(total, seed)
    n = len(lengths)
    cu_seq = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    gen = torch.Generator().manual_seed(seed + 1)
    init = torch.randn(n, HV, K, V, generator=gen) * 0.5  # key-first (naive layout)
    n_caps = sum(len(o) for o in offsets)
    pool = torch.zeros(n + n_caps + 1, HV, V, K, dtype=pool_dtype)
    pool[1 : n + 1] = init.transpose(-1, -2).to(pool_dtype)
    work = torch.arange(1, n + 1)
    cu = torch.tensor([0] + list(torch.tensor([len(o) for o in offsets]).cumsum(0).tolist()))
    flat = torch.tensor([p for o in offsets for p in o], dtype=torch.long)
    dst = torch.arange(n + 1, n + 1 + n_caps)
    plain_pool = pool.clone()
    o_plain, fin_plain = chunk_gated_delta_rule(q, k, v, g, beta, plain_pool, True, cu_seq, False, True, work)
    o, fin = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        pool,
        True,
        cu_seq,
        False,
        True,
        work,
        capture_cu=cu,
        capture_offsets=flat,
        capture_slots=dst,
        capture_pool=pool,
    )
    assert torch.equal(o, o_plain) and torch.equal(fin, fin_plain)
    assert torch.equal(pool[: n + 1], plain_pool[: n + 1])  # working slots: same final states
    ref_o, ref_fin, ref_caps = naive_recurrent_gdn(
        l2norm(q),
        l2norm(k),
        v,
        g,
        beta,
        initial_state=init.to(pool_dtype).float(),
        capture_positions=[sorted(set(o)) for o in offsets],
        cu_seqlens=cu_seq,
    )
    assert float((o - ref_o).abs().max()) < TOL
    j = 0
    for s, offs in enumerate(offsets):
        for c in range(len(offs)):
            got = pool[n + 1 + j].float().transpose(-1, -2)
            want = ref_caps[s][sorted(set(offs)).index(offs[c])].to(pool_dtype).float()
            tol = TOL if pool_dtype == torch.float32 else 2e-2
            assert float((got - want).abs().max()) < tol, (s, offs[c])
            j += 1
    return pool


def test_aligned_offgrid_final_single_sequence() -> None:
    _run([300], [[64, 128, 150, 256, 299, 300]])


def test_offsets_unsorted_duplicates_and_zero() -> None:
    _run([130], [[100, 0, 64, 100]])


def test_varlen_batch_some_without_captures() -> None:
    _run([70, 5, 200, 64], [[1, 63, 70], [], [2, 65, 128, 199], [64]], seed=3)


def test_bf16_pool_gets_pool_dtype() -> None:
    pool = _run([90], [[33, 90]], seed=5, pool_dtype=torch.bfloat16)
    assert pool.dtype == torch.bfloat16


def test_capture_rejects_out_of_range_offset() -> None:
    q, k, v, g, beta = _inputs(10, 0)
    pool = torch.zeros(3, HV, V, K)
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            pool,
            True,
            torch.tensor([0, 10]),
            False,
            True,
            torch.tensor([0]),
            capture_cu=torch.tensor([0, 1]),
            capture_offsets=torch.tensor([11]),
            capture_slots=torch.tensor([1]),
            capture_pool=pool,
        )


@pytest.mark.parametrize("has_init", [True, False])
def test_conv_capture_equals_conv_state_after_prefix(has_init: bool) -> None:
    """Offsets 0..W (inside and past the initial window), mid and end, two sequences."""
    dim, width = 6, 4
    lengths = [9, 3]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(lengths), dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    pool = torch.zeros(20, dim, width - 1)
    pool[0] = torch.randn(dim, width - 1, generator=gen)
    pool[1] = torch.randn(dim, width - 1, generator=gen)
    qsl = torch.tensor([0, 9, 12])
    idx = torch.tensor([0, 1])
    hinit = torch.tensor([has_init, has_init])
    offsets = [[0, 1, 2, 3, 5, 9], [1, 3]]
    cu = torch.tensor([0, 6, 8])
    flat = torch.tensor([p for o in offsets for p in o])
    dst = torch.arange(2, 10)
    before = pool.clone()
    capture_conv_states(x, pool, qsl, idx, hinit, cu, flat, dst)
    assert torch.equal(pool[:2], before[:2])
    j = 0
    for s, offs in enumerate(offsets):
        lo = int(qsl[s])
        for p in offs:
            ref = before.clone()
            causal_conv1d_fwd(
                x[lo : lo + p].transpose(0, 1),
                weight,
                None,
                ref,
                torch.tensor([0, p]),
                idx[s : s + 1],
                hinit[s : s + 1],
                True,
            )
            want = ref[int(idx[s])] if p > 0 else (before[s] if has_init else torch.zeros(dim, width - 1))
            assert torch.equal(pool[2 + j], want), (s, p)
            j += 1

"""The pure-torch CPU ``sgl_kernel`` ops against naive references (fp32, random inputs).

References: FLA's ``naive_recurrent_gated_delta_rule`` / ``naive_chunk_gated_delta_rule`` when FLA
is importable, and always a token-by-token loop written here from the recurrence. The max abs error
of every op is printed in the terminal summary ("sgl_kernel_cpu max abs errors").
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (serve extras / tools/setup_env.sh)")
F = torch.nn.functional

from sglang_sparse_kernels.sgl_kernel_cpu import (  # noqa: E402
    assign_req_to_token_pool,
    causal_conv1d_fwd,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    copy_all_layer_kv_cache,
    fused_gdn_gating,
    fused_rmsnorm_gated,
    fused_sigmoid_gating_delta_rule_update,
    qwen3_5_ops,
)

pytestmark = pytest.mark.kernel

TOL = 2e-5
ERRORS: dict[str, float] = {}


def _record(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    err = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    ERRORS[name] = max(ERRORS.get(name, 0.0), err)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert err <= tol, f"{name}: max abs error {err:.3e} > {tol:.1e}"


@pytest.fixture(scope="module", autouse=True)
def _report_errors(request: pytest.FixtureRequest):
    yield
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is None or not ERRORS:
        return
    ctx = capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()
    with ctx:
        tr.write_line("")
        tr.write_sep("-", "sgl_kernel_cpu max abs errors (fp32)")
        for name, err in sorted(ERRORS.items()):
            tr.write_line(f"{name:<60} {err:.3e}")


# ---------------------------------------------------------------------------------- references
def ref_conv_seq(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, init: torch.Tensor, silu: bool):
    """Token loop: x [D, L], init [D, W-1] -> (out [D, L], new state [D, W-1])."""
    width = w.shape[1]
    window = init.clone()
    outs = []
    for t in range(x.shape[1]):
        full = torch.cat([window, x[:, t : t + 1]], dim=1)  # [D, W]
        y = (full * w).sum(1) + (0 if b is None else b)
        outs.append(F.silu(y) if silu else y)
        window = full[:, 1:] if width > 1 else full[:, :0]
    return torch.stack(outs, 1), window


def ref_delta_rule(q, k, v, g, beta, s0, scale):
    """Token loop in pool layout. q,k: [L, HV, K] (expanded), v: [L, HV, V], g, beta: [L, HV],
    s0: [HV, V, K]. Returns (o [L, HV, V], s [HV, V, K])."""
    s = s0.clone()
    outs = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        kv = torch.einsum("hvk,hk->hv", s, k[t])
        u = beta[t][:, None] * (v[t] - kv)
        s = s + torch.einsum("hv,hk->hvk", u, k[t])
        outs.append(torch.einsum("hvk,hk->hv", s, q[t] * scale))
    return torch.stack(outs), s


def l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# ---------------------------------------------------------------------------------- conv
@pytest.mark.parametrize(
    "dim,width,lens,silu", [(16, 4, [5, 1, 9], True), (48, 4, [70], False), (8, 2, [3, 4], True)]
)
def test_causal_conv1d_fwd(dim, width, lens, silu):
    g = torch.Generator().manual_seed(dim + width)
    total = sum(lens)
    x_tok = torch.randn(total, dim, generator=g)
    x = x_tok.t()  # [D, T] non-contiguous, as SGLang passes it
    w = torch.randn(dim, width, generator=g)
    b = torch.randn(dim, generator=g)
    slots = torch.tensor([3, 0, 5, 1][: len(lens)], dtype=torch.int32)
    pool = torch.randn(6, dim, width - 1, generator=g)
    has_init = torch.tensor([i % 2 == 0 for i in range(len(lens))])
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pool_ref = pool.clone()
    out = causal_conv1d_fwd(x, w, b, pool, qsl, slots, has_init, silu, -1)
    for i, (lo, hi) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True)):
        init = pool_ref[slots[i]] if has_init[i] else torch.zeros(dim, width - 1)
        o, st = ref_conv_seq(x[:, lo:hi], w, b, init, silu)
        _record("causal_conv1d_fwd_cpu", out[:, lo:hi], o)
        _record("causal_conv1d_fwd_cpu (state)", pool[slots[i]], st)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], pool_ref[untouched])


def test_causal_conv1d_fwd_skips_pad_slot():
    x = torch.randn(4, 6)
    w, pool = torch.randn(4, 3), torch.randn(2, 4, 2)
    before = pool.clone()
    out = causal_conv1d_fwd(x, w, None, pool, torch.tensor([0, 6]), torch.tensor([-1]), None, True, -1)
    assert torch.count_nonzero(out) == 0 and torch.equal(pool, before)


@pytest.mark.parametrize("batch,dim,width,steps", [(3, 16, 4, 1), (2, 32, 4, 3), (1, 8, 2, 2)])
def test_causal_conv1d_update(batch, dim, width, steps):
    g = torch.Generator().manual_seed(batch * dim + steps)
    x = torch.randn(batch, dim, steps, generator=g)
    w = torch.randn(dim, width, generator=g)
    b = torch.randn(dim, generator=g)
    pool = torch.randn(batch + 2, dim, width - 1, generator=g)
    idx = torch.arange(batch, dtype=torch.int32).flip(0) + 1
    ref_pool = pool.clone()
    xin = x[..., 0] if steps == 1 else x
    out = causal_conv1d_update(xin, pool, w, b, True, None, idx, -1)
    for i in range(batch):
        o, st = ref_conv_seq(x[i], w, b, ref_pool[idx[i]], True)
        _record("causal_conv1d_update_cpu", out[i] if steps > 1 else out[i].unsqueeze(-1), o)
        _record("causal_conv1d_update_cpu (state)", pool[idx[i]], st)


# ---------------------------------------------------------------------------------- gating / norm
@pytest.mark.parametrize("tokens,heads", [(1, 4), (37, 8)])
def test_fused_gdn_gating(tokens, heads):
    g = torch.Generator().manual_seed(tokens)
    a = torch.randn(tokens, heads, generator=g) * 10  # exercises the softplus threshold
    b = torch.randn(tokens, heads, generator=g)
    A_log = torch.randn(heads, generator=g)
    dt_bias = torch.randn(heads, generator=g)
    gg, beta = fused_gdn_gating(A_log, a, b, dt_bias)
    x = a + dt_bias
    softplus = torch.where(x <= 20, torch.log1p(torch.exp(x)), x)
    _record("fused_gdn_gating_cpu (g)", gg, (-torch.exp(A_log) * softplus).unsqueeze(0))
    _record("fused_gdn_gating_cpu (beta)", beta, torch.sigmoid(b).unsqueeze(0))


@pytest.mark.parametrize("rows,dim", [(1, 32), (19, 128)])
def test_fused_rmsnorm_gated(rows, dim):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, dim, generator=g)
    z = torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, generator=g)
    want = w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (z * torch.sigmoid(z))
    _record("fused_rmsnorm_gated_cpu", fused_rmsnorm_gated(x, w, z, 1e-6), want)


# ---------------------------------------------------------------------------------- delta rule
def _gdn_inputs(total, h, hv, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, h, dk, generator=g)
    k = torch.randn(1, total, h, dk, generator=g)
    v = torch.randn(1, total, hv, dv, generator=g)
    gate = -torch.rand(1, total, hv, generator=g) * 2.0  # log decay in (-2, 0]
    beta = torch.rand(1, total, hv, generator=g)
    return q, k, v, gate, beta


CHUNK_CASES = [
    # lens, H, HV, K, V, chunk
    ([1], 1, 1, 8, 8, 64),
    ([63, 64, 65], 2, 2, 16, 16, 64),
    ([200], 2, 4, 32, 16, 64),  # GQA: 2 value heads per key head
    ([5, 130, 17], 1, 3, 16, 24, 16),
    ([300], 4, 8, 32, 32, 64),
]


@pytest.mark.parametrize("lens,h,hv,dk,dv,chunk", CHUNK_CASES)
def test_chunk_gated_delta_rule(lens, h, hv, dk, dv, chunk):
    total = sum(lens)
    q, k, v, gate, beta = _gdn_inputs(total, h, hv, dk, dv, seed=total + hv)
    n = len(lens)
    pool = torch.randn(n + 3, hv, dv, dk) * 0.1
    slots = torch.arange(n, dtype=torch.int32) * 2 % (n + 3)
    ref_pool = pool.clone()
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    o, finals, _ = chunk_gated_delta_rule(
        q, k, v, gate, beta, pool, True, qsl, False, True, slots, chunk_size=chunk
    )
    rep = hv // h
    qe = l2n(q[0]).repeat_interleave(rep, 1)
    ke = l2n(k[0]).repeat_interleave(rep, 1)
    for i, (lo, hi) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True)):
        o_ref, s_ref = ref_delta_rule(
            qe[lo:hi], ke[lo:hi], v[0, lo:hi], gate[0, lo:hi], beta[0, lo:hi], ref_pool[slots[i]], dk**-0.5
        )
        _record("chunk_gated_delta_rule_cpu", o[0, lo:hi], o_ref, tol=5e-5)
        _record("chunk_gated_delta_rule_cpu (state)", pool[slots[i]], s_ref, tol=5e-5)
        assert finals is not None
        _record("chunk_gated_delta_rule_cpu (state)", finals[i], s_ref, tol=5e-5)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
@pytest.mark.parametrize("total,hv,dk,dv", [(7, 2, 16, 16), (150, 4, 32, 32)])
def test_chunk_gated_delta_rule_vs_fla_naive(total, hv, dk, dv):
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

    q, k, v, gate, beta = _gdn_inputs(total, hv, hv, dk, dv, seed=total)
    qn, kn = l2n(q), l2n(k)
    s0 = torch.randn(1, hv, dk, dv) * 0.1  # FLA layout [B, H, K, V]
    pool = s0.transpose(-1, -2).clone()  # ours: [S, HV, V, K]
    o, _, _ = chunk_gated_delta_rule(q, k, v, gate, beta, pool, True, None, False, True, None)
    o_rec, s_rec = naive_recurrent_gated_delta_rule(
        qn, kn, v, beta, gate, initial_state=s0.clone(), output_final_state=True
    )
    _record("chunk_gated_delta_rule_cpu vs fla.naive_recurrent", o, o_rec, tol=5e-5)
    _record(
        "chunk_gated_delta_rule_cpu vs fla.naive_recurrent (state)",
        pool[0].transpose(-1, -2),
        s_rec[0],
        tol=5e-5,
    )
    o_chk, s_chk = naive_chunk_gated_delta_rule(
        qn, kn, v, gate, beta, initial_state=s0.clone(), output_final_state=True
    )
    _record("chunk_gated_delta_rule_cpu vs fla.naive_chunk", o, o_chk, tol=5e-5)


def test_chunk_gated_delta_rule_skips_padding_index():
    q, k, v, gate, beta = _gdn_inputs(6, 1, 1, 8, 8, seed=1)
    pool = torch.randn(2, 1, 8, 8)
    before = pool.clone()
    o, _, _ = chunk_gated_delta_rule(
        q, k, v, gate, beta, pool, True, torch.tensor([0, 6]), False, True, torch.tensor([-1])
    )
    assert torch.count_nonzero(o) == 0 and torch.equal(pool, before)


@pytest.mark.parametrize("batch,h,hv,dk,dv", [(1, 1, 1, 8, 8), (4, 2, 4, 16, 32), (3, 4, 8, 32, 32)])
def test_fused_sigmoid_gating_delta_rule_update_decode(batch, h, hv, dk, dv):
    g = torch.Generator().manual_seed(batch * hv)
    q = torch.randn(1, batch, h, dk, generator=g)
    k = torch.randn(1, batch, h, dk, generator=g)
    v = torch.randn(1, batch, hv, dv, generator=g)
    a = torch.randn(batch, hv, generator=g)
    b = torch.randn(batch, hv, generator=g)
    A_log = torch.randn(hv, generator=g)
    dt_bias = torch.randn(hv, generator=g)
    pool = torch.randn(batch + 2, hv, dv, dk, generator=g) * 0.1
    idx = torch.arange(batch, dtype=torch.int32) + 1
    idx[0] = -1 if batch > 2 else idx[0]  # a padding row
    ref_pool = pool.clone()
    out = fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, pool, idx, torch.arange(batch + 1, dtype=torch.int32), True
    )
    gate = -torch.exp(A_log) * F.softplus(a + dt_bias)
    rep = hv // h
    for i in range(batch):
        if idx[i] < 0:
            assert torch.count_nonzero(out[0, i]) == 0
            continue
        qe = l2n(q[0, i : i + 1]).repeat_interleave(rep, 1)
        ke = l2n(k[0, i : i + 1]).repeat_interleave(rep, 1)
        o_ref, s_ref = ref_delta_rule(
            qe, ke, v[0, i : i + 1], gate[i : i + 1], torch.sigmoid(b[i : i + 1]), ref_pool[idx[i]], dk**-0.5
        )
        _record("fused_sigmoid_gating_delta_rule_update_cpu", out[0, i], o_ref[0])
        _record("fused_sigmoid_gating_delta_rule_update_cpu (state)", pool[idx[i]], s_ref)
    assert torch.equal(pool[0], ref_pool[0])


def test_fused_sigmoid_gating_delta_rule_update_varlen_matches_chunk():
    lens = [3, 1, 5]
    total, hv, dk, dv = sum(lens), 2, 16, 16
    q, k, v, _, _ = _gdn_inputs(total, hv, hv, dk, dv, seed=9)
    g = torch.Generator().manual_seed(10)
    a, b = torch.randn(total, hv, generator=g), torch.randn(total, hv, generator=g)
    A_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    pool_a = torch.randn(3, hv, dv, dk, generator=g) * 0.1
    pool_b = pool_a.clone()
    out = fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pool_a, idx, qsl, True)
    gg, beta = fused_gdn_gating(A_log, a, b, dt_bias)
    o_chunk, _, _ = chunk_gated_delta_rule(q, k, v, gg, beta, pool_b, True, qsl, False, True, idx)
    _record("fused_sigmoid_gating_delta_rule_update_cpu (varlen)", out, o_chunk, tol=5e-5)
    _record("fused_sigmoid_gating_delta_rule_update_cpu (varlen state)", pool_a, pool_b, tol=5e-5)


# ---------------------------------------------------------------------------------- Qwen3.5 helpers
def _gemma_norm(x, w, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def test_qwen3_5_split_and_norms():
    g = torch.Generator().manual_seed(3)
    t, hq, hv, dq, dv = 5, 2, 4, 8, 16
    qkvz = torch.randn(t, 2 * hq * dq + 2 * hv * dv, generator=g)
    ba = torch.randn(t, 2 * hv, generator=g)
    qkv, z, b, a = qwen3_5_ops.fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, hq, hv, dq, dv)
    q_, k_, v_, z_ = qkvz.split([hq * dq, hq * dq, hv * dv, hv * dv], dim=-1)
    _record("fused_qkvzba_split_reshape_cat_contiguous_cpu", qkv, torch.cat([q_, k_, v_], -1), tol=0)
    _record("fused_qkvzba_split_reshape_cat_contiguous_cpu", z, z_.reshape(t, hv, dv), tol=0)
    _record("fused_qkvzba_split_reshape_cat_contiguous_cpu", b, ba[:, :hv], tol=0)
    _record("fused_qkvzba_split_reshape_cat_contiguous_cpu", a, ba[:, hv:], tol=0)

    heads, kv_heads, d = 4, 2, 16
    q_gate = torch.randn(t, heads * 2 * d, generator=g)
    k = torch.randn(t, kv_heads * d, generator=g)
    qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)
    qn, kn, gate = qwen3_5_ops.fused_qk_gemma_rmsnorm_with_gate(q_gate, k, qw, kw, 1e-6, d, heads)
    pairs = q_gate.view(t, heads, 2 * d)
    _record("fused_qk_gemma_rmsnorm_with_gate_cpu", qn, _gemma_norm(pairs[..., :d], qw).reshape(-1, d))
    _record("fused_qk_gemma_rmsnorm_with_gate_cpu", kn, _gemma_norm(k.view(-1, d), kw))
    _record("fused_qk_gemma_rmsnorm_with_gate_cpu", gate, pairs[..., d:].reshape(t, -1), tol=0)
    q = torch.randn(t, heads * d, generator=g)
    qn2, kn2 = qwen3_5_ops.fused_qk_gemma_rmsnorm(q, k, qw, kw, 1e-6, d)
    _record("fused_qk_gemma_rmsnorm_cpu", qn2, _gemma_norm(q.view(-1, d), qw))
    _record("fused_qk_gemma_rmsnorm_cpu", kn2, _gemma_norm(k.view(-1, d), kw))
    x, gt = torch.randn(t, 8, generator=g), torch.randn(t, 8, generator=g)
    want = x * torch.sigmoid(gt)
    qwen3_5_ops.fused_sigmoid_mul(x, gt)
    _record("fused_sigmoid_mul_cpu", x, want)


# ---------------------------------------------------------------------------------- pools
def test_copy_all_layer_kv_cache():
    bufs = [torch.randn(12, 2, 8), torch.randn(12, 16).to(torch.float16)]
    want = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    tgt, src = torch.tensor([1, 2, 3]), torch.tensor([2, 9, 10])
    copy_all_layer_kv_cache(ptrs, strides, tgt, src)
    for b, w in zip(bufs, want, strict=True):
        w[tgt] = w[src].clone()
        assert torch.equal(b, w)


def test_assign_req_to_token_pool():
    table = torch.zeros(4, 10, dtype=torch.int32)
    out_loc = torch.arange(100, 107, dtype=torch.int64)
    assign_req_to_token_pool(
        torch.tensor([2, 0]), table, torch.tensor([3, 0]), torch.tensor([6, 4]), out_loc, 10
    )
    assert table[2, 3:6].tolist() == [100, 101, 102]
    assert table[0, 0:4].tolist() == [103, 104, 105, 106]
    assert int(table.sum()) == sum(range(100, 107))


# ---------------------------------------------------------------------------------- registration
def test_torch_ops_registration_matches_python():
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is not None:
        import sgl_kernel

        if not getattr(sgl_kernel, "__sglang_sparse_cpu_shim__", False):
            pytest.skip("a real sgl_kernel is installed; not registering the CPU shim ops")
    from sglang_sparse_kernels.sgl_kernel_cpu import registry

    registry.register()
    registry.register()  # idempotent
    ops = torch.ops.sgl_kernel
    for name in registry.op_names():
        assert hasattr(ops, name), name
    x, z, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    assert torch.equal(ops.fused_rmsnorm_gated_cpu(x, w, z, 1e-6), fused_rmsnorm_gated(x, w, z, 1e-6))
    a, b, A_log, dt = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4), torch.randn(4)
    for got, want in zip(
        ops.fused_gdn_gating_cpu(A_log, a, b, dt), fused_gdn_gating(A_log, a, b, dt), strict=True
    ):
        assert torch.equal(got, want)
    # keyword call, as SGLang's decode path does
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 2, 8)
    pool1, pool2 = torch.zeros(3, 2, 8, 8), torch.zeros(3, 2, 8, 8)
    kw = dict(
        A_log=torch.zeros(2),
        dt_bias=torch.zeros(2),
        q=q,
        k=k,
        v=v,
        a=torch.randn(2, 2),
        b=torch.randn(2, 2),
        initial_state_indices=torch.tensor([0, 2]),
        cu_seqlens=torch.tensor([0, 1, 2]),
        use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0,
        softplus_threshold=20.0,
    )
    o1 = ops.fused_sigmoid_gating_delta_rule_update_cpu(initial_state_source=pool1, **kw)
    o2 = fused_sigmoid_gating_delta_rule_update(initial_state_source=pool2, **kw)
    assert torch.equal(o1, o2) and torch.equal(pool1, pool2)

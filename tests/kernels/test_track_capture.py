"""In-forward capture through SGLang's own track copies (``sglang_adapter/track_capture.py``), on
the CPU path of a GDN layer, with SGLang 0.5.23's own code wherever it runs on the CPU.

Per layer: SGLang's conv-track line (``gdn_backend.py`` ``forward_extend``: ``conv[mask] =
mixed_qkv[track_conv_indices]``, restated below: it is inline there), the extend kernel as
``TritonGDNKernel.extend`` calls it on the CPU (the project's stand-in of SGLang's Triton kernel,
``sgl_kernel.mamba.chunk_gated_delta_rule_cpu``; the class itself binds SGLang's GPU kernel in a
process without ``SGLANG_USE_CPU_ENGINE``) wrapped by the capture's extend hook (tails), then
SGLang's real ``MambaAttnBackendBase._track_mamba_state_extend`` and the capture's done hook. The
metadata is SGLang's ``ForwardMetadata``; ``attach`` fills its track lists as it does on a server.
Captured SSM states are checked against an fp64 token-by-token recurrence (rel. 1e-4: the CPU
stand-in is fp32), conv states against the conv kernel run on the truncated
sequence (exact). The FlashInfer layout (checkpoints every N tokens, no initial state) is checked
with a stand-in that returns the CPU op's states in FlashInfer's checkpoint layout, asserting the
checkpoint plan the capture requested.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("sglang", reason="SGLang is not installed")

from sparse_testing.gdn_reference import gdn_states_fp64  # noqa: E402

pytestmark = pytest.mark.kernel

H, HV, K, V, W = 2, 4, 16, 16, 4
LAYERS = 2


class _TritonLike:
    """``TritonGDNKernel.extend``'s CPU branch (``gdn_triton.py``): the stand-in, ``(o, None, h)``."""

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kw):
        from sgl_kernel.mamba import chunk_gated_delta_rule_cpu

        o, _, h = chunk_gated_delta_rule_cpu(
            q=q, k=k, v=v, g=g, beta=beta, initial_state=ssm_states, cu_seqlens=query_start_loc,
            head_first=False, use_qk_l2norm_in_kernel=True, initial_state_indices=cache_indices,
        )  # fmt: skip
        return o, None, h


class _FlashInferLike:
    """FlashInfer's GDN prefill contract (``gdn_flashinfer.py`` ``extend``) on the CPU op: the
    final state in place, ``h`` = checkpoints ``[1, sum len // N, HV, V, K]`` only when asked."""

    uses_state_checkpoints = True

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], int, int]] = []

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kw):
        from sgl_kernel.mamba import chunk_gated_delta_rule_cpu

        cu = kw.get("state_checkpoint_cu_starts")
        n_ck, every = (
            int(kw.get("num_state_checkpoints") or 0),
            int(kw.get("state_checkpoint_every_n_tokens") or 0),
        )
        o, _, h = chunk_gated_delta_rule_cpu(
            q, k, v, g, beta, ssm_states, query_start_loc, False, True, cache_indices
        )
        if not n_ck:
            return o, None, None
        self.asked.append(([int(x) for x in cu.tolist()], n_ck, every))
        lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        ck, row0 = [], 0
        for n, length in enumerate(lens):
            for j in range(length // every):
                end = (j + 1) * every  # 64-token chunks of the CPU op: h row end // 64, or final
                ck.append(h[0, row0 + end // 64] if end < length else ssm_states[cache_indices[n]])
            row0 += -(-length // 64)
        return o, None, torch.stack(ck).unsqueeze(0)


def _run(lens: list[int], caps: list[tuple[int, int]], *, flashinfer: bool = False, seed: int = 0):
    """``caps``: ``(row, offset)``; rows resume from a prefix of 100 tokens but row 1 (a fresh
    request: zero SSM state, SGLang clears it; its conv slot left stale, the conv kernel and the
    capture must treat it as zeros)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_sparse_kernels.sgl_kernel_cpu.conv import causal_conv1d_fwd

    from sglang_sparse.sglang_adapter import track_capture as tc

    gen = torch.Generator().manual_seed(seed)
    n, total = len(lens), sum(lens)
    dim = 2 * H * K + HV * V
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    work = torch.arange(1, n + 1, dtype=torch.int32)  # working slots
    n_slots = n + len(caps) + 2
    pools = [torch.zeros(n_slots, HV, V, K) for _ in range(LAYERS)]
    conv_stack = torch.zeros(LAYERS, n_slots, dim, W - 1)  # SGLang's conv pool: [layers, slots, D, W - 1]
    convs = [conv_stack[lid] for lid in range(LAYERS)]
    inits, conv_inits = [], []
    prefix = [0 if i == 1 else 100 for i in range(n)]
    for lid in range(LAYERS):
        pools[lid][1 : n + 1] = torch.randn(n, HV, V, K, generator=gen) * 0.3
        for i in range(n):
            if not prefix[i]:
                pools[lid][1 + i] = 0
        convs[lid][1 : n + 1] = torch.randn(n, dim, W - 1, generator=gen)
        inits.append(pools[lid][1 : n + 1].clone())
        conv_inits.append(convs[lid][1 : n + 1].clone())
    mixed = torch.randn(total, dim, generator=gen)
    q, k, v = (
        torch.randn(1, total, H, K, generator=gen),
        torch.randn(1, total, H, K, generator=gen),
        torch.randn(1, total, HV, V, generator=gen),
    )
    g = -torch.rand(1, total, HV, generator=gen) * 0.3
    beta = torch.rand(1, total, HV, generator=gen)
    slots = list(range(n + 1, n + 1 + len(caps)))
    kernel = _FlashInferLike() if flashinfer else _TritonLike()
    backend = types.SimpleNamespace(
        device="cpu",
        mamba_chunk_size=64,
        conv_states_shape=convs[0].shape[1:],
        req_to_token_pool=types.SimpleNamespace(
            mamba2_layer_cache=lambda lid: types.SimpleNamespace(temporal=pools[lid], conv=[convs[lid]]),
            mamba_pool=types.SimpleNamespace(mamba_cache=types.SimpleNamespace(conv=[conv_stack])),
        ),
        kernel_dispatcher=types.SimpleNamespace(extend_kernel=kernel),
        forward_metadata=ForwardMetadata(query_start_loc=qsl, mamba_cache_indices=work),
    )
    backend._track_indices_to_device = types.MethodType(
        MambaAttnBackendBase._track_indices_to_device, backend
    )
    backend._translate_mamba_indices = lambda t: t
    batch = types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=list(lens)
    )
    plan = tc.CapturePlan(
        rows=[c[0] for c in caps],
        offsets=[c[1] for c in caps],
        slots=slots,
        geometry={r: (prefix[r], lens[r]) for r, _ in caps},
        n_layers=LAYERS,
        stats={},
    )
    tc.set_forward_plan(plan)
    assert tc.attach(backend, batch, plan)
    md = backend.forward_metadata
    assert md.has_mamba_track_mask
    for lid in range(LAYERS):
        assert tc.forward_plan() is plan and not plan.complete
        conv = convs[lid]
        conv[md.conv_states_mask_indices] = mixed[md.track_conv_indices].transpose(1, 2)  # SGLang's line
        causal_conv1d_fwd(
            mixed.t(),
            torch.randn(dim, W, generator=gen),
            None,
            conv,
            qsl,
            work,
            torch.tensor(prefix) > 0,
            True,
        )
        extend = type(kernel).extend
        out = tc.extend_hook(
            extend, kernel, q, k, v, g, beta,
            ssm_states=pools[lid], cache_indices=work, query_start_loc=qsl, layer_id=lid,
            state_checkpoint_cu_starts=md.state_checkpoint_cu_starts,
            num_state_checkpoints=md.num_state_checkpoints,
            state_checkpoint_every_n_tokens=md.state_checkpoint_every_n_tokens,
        )  # fmt: skip
        MambaAttnBackendBase._track_mamba_state_extend(backend, batch, out[2], pools[lid], md)
        tc.done_hook(None, backend, batch, out[2], pools[lid], md)
    assert plan.complete and tc.forward_plan() is None
    return dict(
        pools=pools, convs=convs, inits=inits, conv_inits=conv_inits, mixed=mixed, k=k, v=v, g=g,
        beta=beta, qsl=qsl.tolist(), slots=slots, plan=plan, md=md, kernel=kernel, prefix=prefix,
    )  # fmt: skip


def _check(r: dict, caps: list[tuple[int, int]], tol: float = 1e-4) -> None:
    starts = r["qsl"]
    for (row, off), slot in zip(caps, r["slots"], strict=True):
        lo, hi = starts[row], starts[row + 1]
        for lid in range(LAYERS):
            want = gdn_states_fp64(
                r["k"][0, lo:hi],
                r["v"][0, lo:hi],
                r["g"][0, lo:hi],
                r["beta"][0, lo:hi],
                r["inits"][lid][row],
                [off],
            )[off]
            got = r["pools"][lid][slot].double()
            err = (got - want).abs().max().item() / want.abs().max().item()
            assert err < tol, (row, off, lid, err)
            # conv: the last W - 1 pre-conv inputs before the position, exactly (reaching into
            # the initial window, or zeros without a prefix, within W - 1 tokens of the start)
            init = r["conv_inits"][lid][row] * (r["prefix"][row] > 0)
            conv_want = torch.cat([init, r["mixed"][lo : lo + off].t()], dim=1)[:, -(W - 1) :]
            assert torch.equal(r["convs"][lid][slot], conv_want), (row, off, lid)


CASES = {
    # on the 64-grid, off it (tails, one from h row 0: the initial state), the extend end (final),
    # within W - 1 tokens of the extend start (the conv window reaches into the initial window)
    "mixed": (
        [150, 64, 200],
        [(0, 2), (0, 64), (0, 100), (0, 150), (1, 1), (1, 30), (1, 64), (2, 3), (2, 128), (2, 199)],
    ),
    "single_long": ([700], [(0, 64), (0, 333), (0, 512), (0, 700)]),
    # a one-token extend captured at its end: the window is the initial one shifted by a token
    "one_token": ([1], [(0, 1)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_layout_on_the_cpu_op(case: str) -> None:
    lens, caps = CASES[case]
    r = _run(lens, caps)
    _check(r, caps)
    assert r["plan"].n_tails == sum(1 for row, off in caps if off % 64 and off != lens[row])
    assert r["md"].num_state_checkpoints == 0  # the Triton layout asks for no checkpoints


@pytest.mark.parametrize("case", list(CASES))
def test_flashinfer_layout(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "mamba_cache_chunk_size", lambda: 64)  # max(64, page 1), as on a server
    lens, caps = CASES[case]
    r = _run(lens, caps, flashinfer=True)
    _check(r, caps)
    if all(off == lens[row] for row, off in caps):  # only final states: no checkpoint is asked for
        assert r["kernel"].asked == [] and r["md"].num_state_checkpoints == 0
        return
    (cu, n_ck, every), *_ = r["kernel"].asked
    assert every == 64 and cu == [0, *torch.tensor([x // 64 for x in lens]).cumsum(0).tolist()]
    assert n_ck == cu[-1]


def test_a_forward_that_is_not_the_plans_is_left_alone() -> None:
    """Rows whose prefix or extend length differ from the plan's geometry: nothing attached, the
    plan stays unstarted (its slots are freed unpublished at the request's checkpoint)."""
    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_sparse.sglang_adapter import track_capture as tc

    md = ForwardMetadata(query_start_loc=torch.tensor([0, 80]), mamba_cache_indices=torch.tensor([1]))
    backend = types.SimpleNamespace(forward_metadata=md, mis_metadata=None)
    plan = tc.CapturePlan(rows=[0], offsets=[64], slots=[5], geometry={0: (0, 80)}, n_layers=1)
    for prefix, lens, mode in (([0], [81], ForwardMode.EXTEND), ([64], [80], ForwardMode.EXTEND),
                               ([0], [80], ForwardMode.DECODE)):  # fmt: skip
        batch = types.SimpleNamespace(
            forward_mode=mode, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=lens
        )
        assert not tc.attach(backend, batch, plan)
    assert not plan.started and md.track_ssm_h_src is None and not md.has_mamba_track_mask


def test_full_prefill_graph_replay_is_vetoed_for_a_capture_forward() -> None:
    """A full prefill CUDA graph replays the fixed-size track buffers it captured: a forward that
    carries a plan runs eagerly (counted); breakable graphs (GDN and Mamba2 layers run eagerly
    inside them) and forwards without a plan ask SGLang's own check."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_sparse.sglang_adapter import track_capture as tc

    asked = []

    def original(runner, batch):
        asked.append(runner.prefill_backend_name)
        return True

    stats: dict = {}
    plan = tc.CapturePlan(rows=[0], offsets=[64], slots=[5], geometry={0: (0, 80)}, n_layers=1, stats=stats)
    full = types.SimpleNamespace(prefill_backend_name=Backend.FULL)
    breakable = types.SimpleNamespace(prefill_backend_name=Backend.BREAKABLE)
    tc.set_forward_plan(plan)
    try:
        assert tc.graph_veto_hook(original, full, None) is False and asked == []
        assert stats["capture_graph_vetoes"] == 1
        assert tc.graph_veto_hook(original, breakable, None) is True and asked == [Backend.BREAKABLE]
    finally:
        tc.set_forward_plan(None)
    assert tc.graph_veto_hook(original, full, None) is True and asked[-1] == Backend.FULL

"""Tests for sglang_sparse_kernels.gdn_capture: naive recurrent reference vs chunked torch vs
FLA-Triton (interpreted).

The Triton path runs in a subprocess with ``TRITON_INTERPRET=1`` (set before triton is imported there), so
this process never imports triton and other tests are unaffected.  The subprocess is this very file run
as a script (``python test_gdn_capture.py --triton-worker``); it prints one JSON line of max abs errors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch = pytest.importorskip("torch", reason="torch is not installed (serve extras)")
F = torch.nn.functional

from sglang_sparse_kernels.gdn_capture import chunk_gdn_fwd_capture, naive_recurrent_gdn  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Run this module with one torch thread: on a loaded 2-core box, spinning OpenMP threads make the
    many tiny ops of the naive reference 10-100x slower.  Restored afterwards for other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Max abs error allowed, relative to max(1, |reference|.max()) (fp32 throughout).
TOL = 1e-4


def make_inputs(
    B: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    *,
    seed: int = 0,
    n_init: int | None = None,
    l2: bool = True,
) -> dict:
    """Random GDN inputs: unit-norm keys (as after Qwen3-Next's l2norm), g = logsigmoid, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if l2:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen)
    out = dict(q=q, k=k, v=v, g=g, beta=beta)
    if n_init is not None:
        out["initial_state"] = 0.5 * torch.randn(n_init, HV, K, V, generator=gen)
    return out


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    bound = TOL * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
    err = max_err(got, ref)
    assert err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"


# --------------------------------------------------------------------------------------------------
# torch chunk vs naive
# --------------------------------------------------------------------------------------------------

SHAPES = [
    # B, T, H, HV, K, V, initial_state, use_qk_l2norm
    (1, 64, 1, 1, 16, 16, False, False),
    (2, 200, 2, 4, 32, 16, True, False),  # T % 64 != 0, GVA (HV = 2H), h0
    (1, 257, 2, 2, 16, 32, True, False),  # one token past a boundary
    (3, 128, 1, 3, 16, 8, False, True),  # T multiple of 64 (last boundary = final state), l2norm
    (1, 63, 1, 2, 8, 8, True, False),  # shorter than one chunk
]


@pytest.mark.parametrize("B,T,H,HV,K,V,init,l2", SHAPES)
def test_torch_chunk_matches_naive_at_every_boundary(B, T, H, HV, K, V, init, l2):
    x = make_inputs(B, T, H, HV, K, V, seed=T + HV, n_init=B if init else None, l2=not l2)
    chunks = list(range(T // 64 + 1))
    o_ref, s_ref, c_ref = naive_recurrent_gdn(
        **x, capture_positions=[c * 64 for c in chunks], use_qk_l2norm=l2
    )
    o, s, c = chunk_gdn_fwd_capture(**x, capture_chunks=chunks, use_qk_l2norm=l2)
    assert c.shape == (B, len(chunks), HV, K, V) and c.dtype == torch.float32
    assert s.shape == (B, HV, K, V) and s.dtype == torch.float32
    assert o.shape == (B, T, HV, V) and o.dtype == x["q"].dtype
    assert_close(o, o_ref, "output")
    assert_close(s, s_ref, "final state")
    assert_close(c, c_ref, "captured states")
    if init:
        assert torch.equal(c[:, 0], x["initial_state"]), "boundary 0 must be the initial state"
    if T % 64 == 0:
        assert torch.equal(c[:, -1], s), "boundary T/64 must be the final state"


def test_torch_chunk_other_chunk_size_and_subset():
    x = make_inputs(2, 100, 1, 2, 16, 16, seed=3, n_init=2)
    o_ref, s_ref, c_ref = naive_recurrent_gdn(**x, capture_positions=[32, 96])
    o, s, c = chunk_gdn_fwd_capture(**x, capture_chunks=[1, 3], chunk_size=32)
    assert_close(o, o_ref, "output")
    assert_close(s, s_ref, "final state")
    assert_close(c, c_ref, "captured states")


def test_capture_does_not_change_output_and_none_gives_empty():
    x = make_inputs(1, 300, 2, 4, 16, 16, seed=5, n_init=1)
    o0, s0, c0 = chunk_gdn_fwd_capture(**x)
    o1, s1, c1 = chunk_gdn_fwd_capture(**x, capture_chunks=[0, 2, 4])
    assert c0.shape == (1, 0, 4, 16, 16)
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    assert c1.shape == (1, 3, 4, 16, 16)


def test_torch_varlen_matches_naive():
    lengths = [70, 0, 58, 128, 1]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = make_inputs(1, cu[-1], 1, 2, 16, 8, seed=11, n_init=len(lengths))
    per_seq = [[0, 1], [0], [0], [0, 1, 2], [0]]
    o_ref, s_ref, c_ref = naive_recurrent_gdn(
        **x, cu_seqlens=cu, capture_positions=[[64 * c for c in lst] for lst in per_seq]
    )
    o, s, c = chunk_gdn_fwd_capture(**x, cu_seqlens=torch.tensor(cu), capture_chunks=per_seq)
    assert isinstance(c, list) and len(c) == len(lengths)
    assert_close(o, o_ref, "output")
    assert_close(s, s_ref, "final state")
    for n, (got, ref) in enumerate(zip(c, c_ref, strict=True)):
        assert_close(got, ref, f"captured states of sequence {n}")
    # a shared list valid for every sequence returns a stacked tensor
    _, _, c_shared = chunk_gdn_fwd_capture(**x, cu_seqlens=cu, capture_chunks=[0])
    assert c_shared.shape == (len(lengths), 1, 2, 16, 8)
    assert torch.equal(c_shared[1, 0], x["initial_state"][1]), "empty sequence: state stays initial"


def test_varlen_equals_separate_calls():
    lengths = [100, 64, 30]
    cu = [0, 100, 164, 194]
    x = make_inputs(1, cu[-1], 2, 2, 16, 16, seed=2, n_init=3)
    o, s, c = chunk_gdn_fwd_capture(**x, cu_seqlens=cu, capture_chunks=[0])
    for n, ln in enumerate(lengths):
        sl = slice(cu[n], cu[n + 1])
        xn = {key: x[key][:, sl] for key in ("q", "k", "v", "g", "beta")}
        on, sn, _ = chunk_gdn_fwd_capture(**xn, initial_state=x["initial_state"][n : n + 1])
        assert_close(o[:, sl], on, f"output of sequence {n}")
        assert_close(s[n : n + 1], sn, f"final state of sequence {n}")
        assert ln == on.shape[1]


@pytest.mark.parametrize("T,c", [(300, 2), (256, 1), (256, 4), (130, 0)])
def test_resume_from_captured_state_equals_full_prefill(T, c):
    x = make_inputs(2, T, 1, 2, 32, 16, seed=7, n_init=2)
    o_full, s_full, states = chunk_gdn_fwd_capture(**x, capture_chunks=[c])
    p = c * 64
    rest = {key: x[key][:, p:] for key in ("q", "k", "v", "g", "beta")}
    o_rest, s_rest, _ = chunk_gdn_fwd_capture(**rest, initial_state=states[:, 0])
    assert_close(o_rest, o_full[:, p:], "resumed output")
    assert_close(s_rest, s_full, "resumed final state")


def test_low_precision_inputs():
    x = make_inputs(1, 130, 1, 2, 16, 16, seed=9)
    xb = {key: val.bfloat16() for key, val in x.items()}
    o, s, c = chunk_gdn_fwd_capture(**xb, capture_chunks=[1, 2])
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and c.dtype == torch.float32
    o_ref, s_ref, _ = naive_recurrent_gdn(**xb)
    assert max_err(o, o_ref) < 5e-2 and max_err(s, s_ref) < 1e-3


# --------------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------------

BASE = dict(B=1, T=130, H=2, HV=4, K=8, V=8)


def _x(**over):
    x = make_inputs(**BASE, n_init=1)
    x.update(over)
    return x


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(capture_chunks=[2, 1]), ValueError, "strictly increasing"),
        (dict(capture_chunks=[1, 1]), ValueError, "strictly increasing"),
        (dict(capture_chunks=[3]), ValueError, "out of range"),  # 3 * 64 = 192 > 130
        (dict(capture_chunks=[-1]), ValueError, "out of range"),
        (dict(capture_chunks=[1.0]), TypeError, "ints"),
        (dict(capture_chunks=[True]), TypeError, "ints"),
        (dict(capture_chunks="12"), TypeError, "sequence of ints"),
        (dict(capture_chunks=[[0], [1]]), ValueError, "per-sequence lists for 1 sequences"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
    ],
)
def test_bad_capture_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        chunk_gdn_fwd_capture(**_x(), **kwargs)


def test_bad_capture_positions_naive():
    with pytest.raises(ValueError, match="out of range"):
        naive_recurrent_gdn(**_x(), capture_positions=[131])
    with pytest.raises(ValueError, match="strictly increasing"):
        naive_recurrent_gdn(**_x(), capture_positions=[5, 4])


@pytest.mark.parametrize(
    "field,bad,exc,match",
    [
        ("k", torch.zeros(1, 130, 2, 4), ValueError, "same shape"),
        ("v", torch.zeros(2, 130, 4, 8), ValueError, "v must be"),
        ("v", torch.zeros(1, 130, 3, 8), ValueError, "multiple"),
        ("g", torch.zeros(1, 130, 1), ValueError, "g must be"),
        ("beta", torch.zeros(1, 129, 4), ValueError, "beta must be"),
        ("q", torch.zeros(1, 130, 8), ValueError, "4-D"),
        ("q", torch.zeros(1, 130, 2, 8, dtype=torch.int32), TypeError, "floating"),
        ("v", torch.zeros(1, 130, 4, 8, dtype=torch.float64), TypeError, "share a dtype"),
        ("initial_state", torch.zeros(1, 4, 8, 4), ValueError, "initial_state must be"),
        ("initial_state", torch.zeros(1, 4, 8, 8, dtype=torch.int64), TypeError, "floating"),
        ("beta", [0.5], TypeError, "torch.Tensor"),
    ],
)
def test_bad_tensor_inputs(field, bad, exc, match):
    with pytest.raises(exc, match=match):
        chunk_gdn_fwd_capture(**_x(**{field: bad}))
    with pytest.raises(exc, match=match):
        naive_recurrent_gdn(**_x(**{field: bad}))


@pytest.mark.parametrize(
    "cu,match",
    [
        ([0, 50, 129], "end at T"),
        ([1, 130], "start at 0"),
        ([0, 80, 60, 130], "non-decreasing"),
        ([0], ">= 2"),
    ],
)
def test_bad_cu_seqlens(cu, match):
    x = _x()
    x.pop("initial_state")
    with pytest.raises(ValueError, match=match):
        chunk_gdn_fwd_capture(**x, cu_seqlens=cu)


def test_cu_seqlens_requires_batch_one_and_matching_initial_state():
    x = make_inputs(2, 64, 1, 1, 8, 8)
    with pytest.raises(ValueError, match="batch dim must be 1"):
        chunk_gdn_fwd_capture(**x, cu_seqlens=[0, 64])
    x = make_inputs(1, 64, 1, 1, 8, 8, n_init=1)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gdn_fwd_capture(**x, cu_seqlens=[0, 30, 64])
    with pytest.raises(TypeError, match="integer"):
        chunk_gdn_fwd_capture(**x, cu_seqlens=torch.tensor([0.0, 64.0]))


# --------------------------------------------------------------------------------------------------
# Triton (FLA building blocks) under TRITON_INTERPRET=1, in a subprocess
# --------------------------------------------------------------------------------------------------

TRITON_CASES = [
    "equal_len_h0",
    "equal_len_fused_intra",
    "gva_l2norm_T64",
    "varlen",
    "resume",
    "h_is_state_before",
    "fp16_h_rounding",
    "fp16_fp32_states",
]


def _triton_worker() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1 already set); prints {case: {metric: max_abs_err}}."""
    from sglang_sparse_kernels.gdn_capture import chunk_gdn_fwd_capture_triton as tri
    from sglang_sparse_kernels.gdn_capture._interpret import enable_interpreter_workarounds

    enable_interpreter_workarounds()
    res: dict[str, dict[str, float]] = {}

    def cmp(name, got, ref):
        o, s, c = got
        o_ref, s_ref, c_ref = ref
        if isinstance(c, list):
            ce = max(max_err(a, b) for a, b in zip(c, c_ref, strict=True))
        else:
            assert c.shape == c_ref.shape, (c.shape, c_ref.shape)
            ce = max_err(c, c_ref)
        res[name] = {
            "o": max_err(o, o_ref),
            "final": max_err(s, s_ref),
            "states": ce,
            "ref_scale": max(1.0, float(o_ref.abs().max()), float(s_ref.abs().max())),
        }

    x = make_inputs(2, 150, 1, 2, 32, 16, seed=1, n_init=2)
    ref = naive_recurrent_gdn(**x, capture_positions=[0, 64, 128])
    cmp("equal_len_h0", tri(**x, capture_chunks=[0, 1, 2]), ref)
    cmp("equal_len_fused_intra", tri(**x, capture_chunks=[0, 1, 2], fused_intra=True), ref)

    x = make_inputs(1, 64, 2, 4, 16, 16, seed=2, l2=False)
    ref = naive_recurrent_gdn(**x, capture_positions=[0, 64], use_qk_l2norm=True)
    cmp("gva_l2norm_T64", tri(**x, capture_chunks=[0, 1], use_qk_l2norm=True), ref)

    cu = [0, 70, 128, 256]
    x = make_inputs(1, 256, 1, 2, 16, 16, seed=3, n_init=3)
    per_seq = [[0, 1], [0], [0, 1, 2]]
    ref = naive_recurrent_gdn(
        **x, cu_seqlens=cu, capture_positions=[[64 * c for c in lst] for lst in per_seq]
    )
    cmp("varlen", tri(**x, cu_seqlens=cu, capture_chunks=per_seq), ref)

    x = make_inputs(1, 200, 1, 1, 16, 16, seed=4, n_init=1)
    o_full, s_full, st = tri(**x, capture_chunks=[2])
    rest = {key: x[key][:, 128:] for key in ("q", "k", "v", "g", "beta")}
    o_rest, s_rest, _ = tri(**rest, initial_state=st[:, 0])
    res["resume"] = {
        "o": max_err(o_rest, o_full[:, 128:]),
        "final": max_err(s_rest, s_full),
        "states": 0.0,
        "ref_scale": max(1.0, float(o_full.abs().max())),
    }

    # fp16 inputs (bf16 is not usable under the interpreter: FLA's own chunk_gated_delta_rule overflows
    # there too, an interpreter emulation problem). FLA stores h in k.dtype, so interior captures are
    # fp16-rounded unless fp32_states=True.
    x = make_inputs(1, 192, 1, 1, 32, 32, seed=6, n_init=1)
    xh = {key: (val.half() if key != "initial_state" else val) for key, val in x.items()}
    ref = chunk_gdn_fwd_capture(**xh, capture_chunks=[1, 2, 3])
    got = tri(**xh, capture_chunks=[1, 2, 3])
    cmp("fp16_h_rounding", got, ref)
    res["fp16_h_rounding"]["interior_is_fp16"] = float(
        torch.equal(got[2][:, :2], got[2][:, :2].half().float())
    )
    got = tri(**xh, capture_chunks=[1, 2, 3], fp32_states=True)
    cmp("fp16_fp32_states", got, ref)
    res["fp16_fp32_states"]["interior_is_fp16"] = float(
        torch.equal(got[2][:, :2], got[2][:, :2].half().float())
    )

    # Direct check of FLA's convention: h[:, i] is the state after i * 64 tokens (before chunk i).
    import math

    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    x = make_inputs(1, 192, 1, 1, 16, 16, seed=5, n_init=1)
    gc = chunk_local_cumsum(x["g"], chunk_size=64, scale=1 / math.log(2))
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=x["k"], v=x["v"], g=gc, beta=x["beta"], chunk_size=64)
    h, _, ht = chunk_gated_delta_rule_fwd_h(
        k=x["k"], w=w, u=u, g=gc, initial_state=x["initial_state"], output_final_state=True
    )
    _, s_ref, c_ref = naive_recurrent_gdn(**x, capture_positions=[0, 64, 128])
    res["h_is_state_before"] = {
        "o": 0.0,
        "final": max_err(ht, s_ref),
        "states": max_err(h[0], c_ref[0]),
        "ref_scale": 1.0,
        "h_shape": list(h.shape),
    }
    print("GDN_TRITON_RESULT " + json.dumps(res))


@pytest.fixture(scope="module")
def triton_results() -> dict:
    missing = [m for m in ("triton", "fla") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not importable (install the serve extras)")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--triton-worker"],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=150,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GDN_TRITON_RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"triton worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_interpreted_matches_naive(triton_results, case):
    r = triton_results[case]
    # fp16 cases compare against the torch chunk path on the same fp16 inputs (fp32 math)
    bound = (2e-3 if case.startswith("fp16") else TOL) * r["ref_scale"]
    for metric in ("o", "final", "states"):
        assert r[metric] <= bound, f"{case}/{metric}: max abs err {r[metric]:.3e} > {bound:.3e} ({r})"
    if case == "fp16_h_rounding":
        assert r["interior_is_fp16"] == 1.0, "FLA's h is expected in k.dtype (16-bit interior captures)"
    if case == "fp16_fp32_states":
        assert r["interior_is_fp16"] == 0.0, "fp32_states=True must keep float32 interior captures"
    if case == "h_is_state_before":
        assert r["h_shape"] == [1, 3, 1, 16, 16]  # [B, NT, HV, K, V]


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    _triton_worker()

"""Triton list capture (:mod:`sglang_sparse_kernels.gdn_capture.list_capture_triton`) under
``TRITON_INTERPRET=1``, float32, small sizes, against the token-by-token reference (``naive.py``) and the
gather-based Triton capture (``chunk_triton.py``).

As in ``test_gdn_capture.py`` the Triton work runs in a subprocess (this file run as a script with
``--worker``) that has ``TRITON_INTERPRET=1`` set before triton is imported; it prints one JSON line of
max abs errors and flags, which the tests below check.  Also checks ``benchmarks/gdn_capture.py --quick``.
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
for p in (ROOT, ROOT / "kernels"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

torch = pytest.importorskip("torch", reason="torch is not installed (serve extras)")
F = torch.nn.functional

pytestmark = pytest.mark.kernel

HV, K, V = 2, 16, 16
SENTINEL = -777.0


def _inputs(B: int, T: int, H: int, hv: int, dk: int, dv: int, n_init: int | None, seed: int) -> dict:
    """Random GDN inputs (unit-norm keys, g = logsigmoid, beta in (0, 1)), float32."""
    gen = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(B, T, H, dk, generator=gen),
        k=F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1),
        v=torch.randn(B, T, hv, dv, generator=gen),
        g=F.logsigmoid(torch.randn(B, T, hv, generator=gen) + 2.0),
        beta=torch.rand(B, T, hv, generator=gen),
    )
    if n_init is not None:
        x["initial_state"] = 0.5 * torch.randn(n_init, hv, dk, dv, generator=gen)
    return x


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _worker() -> None:  # pragma: no cover - runs in the subprocess
    from sglang_sparse_kernels.gdn_capture import (
        chunk_gdn_fwd_capture_triton,
        chunk_gdn_fwd_list_capture_triton,
        naive_recurrent_gdn,
    )
    from sglang_sparse_kernels.gdn_capture.list_capture_triton import build_capture_buckets

    torch.set_num_threads(1)
    res: dict[str, dict[str, float]] = {}

    def run(name: str, x: dict, positions: list[list[int]], slots: list[int], n_slots: int, **kw) -> None:
        """List-capture into a sentinel-filled pool; compare with naive (sorted, de-duplicated) captures."""
        hv, dk, dv = x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]
        if kw.pop("v_first_pool", False):  # the CPU server's [S, HV, V, K] memory, seen as [S, HV, K, V]
            pool = torch.full((n_slots, hv, dv, dk), SENTINEL).transpose(-1, -2)
            assert not pool.is_contiguous()
        else:
            pool = torch.full((n_slots, hv, dk, dv), SENTINEL)
        ccu = [0]
        for lst in positions:
            ccu.append(ccu[-1] + len(lst))
        flat = [p for lst in positions for p in lst]
        o, fin = chunk_gdn_fwd_list_capture_triton(
            **x, ssm_pool=pool, capture_cu=ccu, capture_positions=flat, capture_slots=slots, **kw
        )
        uniq = [sorted(set(lst)) for lst in positions]
        o_ref, s_ref, c_ref = naive_recurrent_gdn(
            **x, capture_positions=uniq, cu_seqlens=kw.get("cu_seqlens")
        )
        cap_err, j = 0.0, 0
        for n, lst in enumerate(positions):
            for p in lst:
                cap_err = max(cap_err, _err(pool[slots[j]], c_ref[n][uniq[n].index(p)]))
                j += 1
        untouched = [s for s in range(n_slots) if s not in slots]
        res[name] = {
            "o": _err(o, o_ref),
            "final": _err(fin, s_ref),
            "states": cap_err,
            "untouched_ok": float(bool((pool[untouched] == SENTINEL).all())),
            "ref_scale": max(1.0, float(o_ref.abs().max()), float(s_ref.abs().max())),
        }
        res[name]["_pool"] = pool  # type: ignore[assignment]
        res[name]["_o"], res[name]["_fin"] = o, fin  # type: ignore[assignment]

    # 1. equal lengths (B=2, T=192 = 3 chunks): aligned captures, position 0 (= initial state), the final
    #    state (aligned), slots out of order; then against the gather-based capture of the same boundaries.
    x = _inputs(2, 192, 1, HV, K, V, n_init=2, seed=1)
    pos = [[0, 64, 128, 192], [192, 64]]
    slots = [5, 0, 9, 2, 7, 3]
    run("aligned_final_h0", x, pos, slots, 11)
    r = res["aligned_final_h0"]
    pool, o, fin = r.pop("_pool"), r.pop("_o"), r.pop("_fin")
    r["h0_exact"] = float(torch.equal(pool[5], x["initial_state"][0]))
    r["final_bitwise"] = float(torch.equal(pool[2], fin[0]) and torch.equal(pool[7], fin[1]))
    o_g, fin_g, st_g = chunk_gdn_fwd_capture_triton(**x, capture_chunks=[0, 1, 2, 3])  # [2, 4, HV, K, V]
    res["vs_gather"] = {
        "o": _err(o, o_g),
        "final": _err(fin, fin_g),
        "states": max(
            _err(pool[[5, 0, 9, 2]], st_g[0]), _err(pool[3], st_g[1, 1]), _err(pool[7], st_g[1, 3])
        ),
        "untouched_ok": 1.0,
        "ref_scale": 1.0,
    }

    # 2. varlen, 3 sequences (one shorter than a chunk), off-grid positions, repeated
    #    positions into different slots, unordered positions and slots, fused intra-chunk WY kernel.
    cu = [0, 130, 170, 300]
    x = _inputs(1, 300, 1, HV, K, V, n_init=3, seed=2)
    pos = [[128, 0, 64, 130, 64], [40, 17], [1, 63, 64, 65, 129, 130]]
    slots = [12, 3, 8, 1, 14, 0, 10, 6, 2, 13, 5, 9, 11]
    run("varlen_offgrid", x, pos, slots, 16, cu_seqlens=cu, fused_intra=True)
    for key in ("_pool", "_o", "_fin"):
        res["varlen_offgrid"].pop(key)

    # 3. varlen with an empty sequence and no initial state, value-first pool ([S, HV, V, K]) passed as a
    #    transposed view, V = 48 (two value blocks of 32, the second one masked).
    cu = [0, 100, 100, 230]
    x = _inputs(1, 230, 1, HV, K, 48, n_init=None, seed=3)
    pos = [[100, 64], [0], [0, 100, 128, 130]]
    slots = [4, 2, 0, 7, 6, 3, 1]
    run("empty_seq_vfirst_pool", x, pos, slots, 9, cu_seqlens=cu, v_first_pool=True)
    for key in ("_pool", "_o", "_fin"):
        res["empty_seq_vfirst_pool"].pop(key)

    # 4. host-side validation
    bad = {
        "dup_slot": ([[0, 64]], [3, 3]),
        "slot_range": ([[0]], [99]),
        "pos_range": ([[65]], [0]),
        "neg_pos": ([[-1]], [0]),
    }
    raised = {}
    for name, (positions, sl) in bad.items():
        try:
            build_capture_buckets([64], [0, len(positions[0])], positions[0], sl, 8, 64, "cpu")
            raised[name] = 0.0
        except ValueError:
            raised[name] = 1.0
    # sequence 0 (130 tokens, 3 chunks): buckets 0..3; sequence 1 (empty): bucket 4 (its final state)
    ptr, rr, ss = build_capture_buckets([130, 0], [0, 3, 4], [130, 65, 0, 0], [1, 2, 3, 4], 8, 64, "cpu")
    raised["buckets_ok"] = float(
        ptr.tolist() == [0, 1, 2, 2, 3, 4] and rr.tolist() == [0, 1, 0, 0] and ss.tolist() == [3, 2, 1, 4]
    )
    res["validation"] = raised
    print("GDN_LIST_CAPTURE_RESULT " + json.dumps(res))


@pytest.fixture(scope="module")
def results() -> dict:
    missing = [m for m in ("triton", "fla") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not importable (install the serve extras)")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker"],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GDN_LIST_CAPTURE_RESULT ")]
    if proc.returncode != 0 or not lines:
        if "ModuleNotFoundError" in proc.stderr and ("triton" in proc.stderr or "fla" in proc.stderr):
            pytest.skip(f"triton/fla import failed in the worker:\n{proc.stderr[-1000:]}")
        pytest.fail(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


TOL = 1e-4


@pytest.mark.parametrize("case", ["aligned_final_h0", "varlen_offgrid", "empty_seq_vfirst_pool", "vs_gather"])
def test_list_capture_matches_reference(results: dict, case: str) -> None:
    r = results[case]
    bound = TOL * r["ref_scale"]
    for metric in ("o", "final", "states"):
        assert r[metric] <= bound, f"{case}/{metric}: max abs err {r[metric]:.3e} > {bound:.3e} ({r})"
    assert r["untouched_ok"] == 1.0, f"{case}: a pool slot not listed in capture_slots was written"


def test_list_capture_initial_and_final_states_are_exact(results: dict) -> None:
    r = results["aligned_final_h0"]
    assert r["h0_exact"] == 1.0, "position 0 must store the initial state unchanged"
    assert r["final_bitwise"] == 1.0, "position T_n must store exactly the returned final state"


def test_list_capture_validation(results: dict) -> None:
    for name, ok in results["validation"].items():
        assert ok == 1.0, name


def test_benchmark_quick(tmp_path: Path) -> None:
    """``benchmarks/gdn_capture.py --quick`` runs and writes both tables (no triton needed)."""
    from benchmarks.gdn_capture import main

    out = tmp_path / "gdn_capture.json"
    res = main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] and data["capture_overhead"]["cells"]
    cells = data["capture_overhead"]["cells"]
    assert {c["captures"] for c in cells} == set(res["capture_overhead"]["config"]["captures"])
    for c in cells:
        assert c["max_err_vs_plain"] == 0.0  # capture must not change outputs / final states
        assert c["err_final_capture"] == 0.0  # the capture at T is the final state


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()

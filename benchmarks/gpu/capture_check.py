"""Device check: several exact states per GDN extend through SGLang's own kernels and track copies.

One GatedDeltaNet layer of Qwen3-Next-80B-A3B at TP1 shapes (16 qk heads, 32 value heads, K = V =
128, bf16 activations, fp32 state pool), two batches (1 x 16,384 and 8 x 2,048 tokens, every
sequence resuming from a prefix state), four captures per 16k tokens, two on the 64-token grid and
two off it. Per batch:

* **plain**: SGLang's Triton GDN extend (``sglang/kernels/ops/attention/fla/chunk.py``
  ``chunk_gated_delta_rule``, in place on the pool, as ``TritonGDNKernel.extend`` calls it);
* **capture**: the same call plus the capture exactly as the server runs it: the track-list
  entries of ``sglang_sparse.sglang_adapter.track_lists`` built and copied to the device by
  ``track_capture.attach`` (one non-blocking copy), the adapter's ``extend_hook`` (tails: an ``h``
  row advanced by SGLang's ``fused_recurrent_gated_delta_rule_update`` over the < 64 remaining
  tokens) and SGLang's SSM track copies (``MambaAttnBackendBase._track_mamba_state_extend``,
  ``hybrid_linear_attn_backend.py`` ~L1019-1063, restated in :func:`sglang_track_copies`) and its
  conv-track gather (``gdn_backend.py`` ``forward_extend``);
* **aa**: plain again (the noise floor of the same run).

Reported: the medians of ``--repeats`` interleaved timings (CUDA events), capture overhead vs
plain (target <= 2% at 4 captures per 16k tokens) beside the A/A difference; every captured state
against a *cut* (the extend run on the sequence up to the position: the state the chunk-cut path
would keep; tolerance: bf16, since SGLang's Triton ``h`` holds the activation dtype) and, with
``--quick``, against an fp64 token-by-token recurrence; conv windows bit-exact. JSON to ``--out``.

Needs only torch, triton and einops: SGLang's FLA fork is loaded from an unpacked ``sglang`` wheel
(``--sglang-src DIR``, the folder holding ``sglang/``; a stub package tree is built from its
``kernels/ops/attention/fla`` sources, SGLang itself is never imported), or from the installed
SGLang when the flag is absent. ``--quick`` runs tiny shapes under ``TRITON_INTERPRET=1`` on the
CPU in fp16 (SGLang's kernels refuse fp32; the interpreter cannot emulate bf16) in about a minute:
the CI runs it so the script cannot rot (``tests/kernels/test_capture_check.py``).

    python benchmarks/gpu/capture_check.py --sglang-src /tmp/sglang_wheel --out capture_check.json
    python benchmarks/gpu/capture_check.py --quick --sglang-src .venv/lib/python3.11/site-packages
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "kernels"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

FLA = ("sglang", "kernels", "ops", "attention", "fla")
#: Qwen3-Next-80B-A3B's GDN layer at TP1 (config: linear_num_{key,value}_heads 16/32, head dims 128)
FULL = dict(H=16, HV=32, K=128, V=128, conv_dim=2 * 16 * 128 + 32 * 128, W=4)
QUICK = dict(H=1, HV=2, K=32, V=32, conv_dim=2 * 1 * 32 + 2 * 32, W=4)
PREFIX = 1000  # tokens every sequence resumes from (its initial state is a prefix state)


def load_sglang_fla(src: str | None) -> types.ModuleType:
    """SGLang's FLA fork (``sglang.kernels.ops.attention.fla``). With ``src`` (the folder holding an
    unpacked ``sglang/``): copies its ``fla/*.py`` into a temporary package tree whose other
    ``sglang`` modules are stubs (``srt/utils/common.py``: ``torch_release``, the one SGLang name the
    GDN chunk and recurrent kernels import) and puts it first on ``sys.path``."""
    if src is not None:
        fla_src = Path(src).joinpath(*FLA)
        if not (fla_src / "chunk.py").is_file():
            raise SystemExit(
                f"--sglang-src {src}: no {'/'.join(FLA)}/chunk.py there (unpack the sglang wheel)"
            )
        tree = Path(tempfile.mkdtemp(prefix="sglang_fla_"))
        pkg = tree
        for part in FLA[:-1]:
            pkg = pkg / part
            pkg.mkdir()
            (pkg / "__init__.py").write_text("")
        shutil.copytree(fla_src, pkg / "fla", ignore=shutil.ignore_patterns("__pycache__"))
        utils = tree / "sglang" / "srt" / "utils"
        utils.mkdir(parents=True)
        (tree / "sglang" / "srt" / "__init__.py").write_text("")
        (utils / "__init__.py").write_text("")
        (utils / "common.py").write_text(
            "import torch\nfrom packaging import version\n\n"
            "torch_release = version.parse(torch.__version__).release\n"
        )
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]
        sys.path.insert(0, str(tree))
    import importlib

    return importlib.import_module(".".join(FLA))


def _mode_extend() -> Any:
    """A ``ForwardMode``-like object: a plain extend."""
    return types.SimpleNamespace(
        is_extend=lambda: True, is_mixed=lambda: False, is_target_verify=lambda: False,
        is_draft_extend_v2=lambda: False,
    )  # fmt: skip


def sglang_track_copies(md: Any, h: Any, ssm: Any) -> None:
    """SGLang's ``_track_mamba_state_extend`` without speculative/KDA paths: ``ssm[h_dst] =
    h[h_src]``, ``ssm[final_dst] = ssm[final_src]``."""
    if md.track_ssm_h_src is not None and md.track_ssm_h_src.numel() > 0:
        ssm[md.track_ssm_h_dst] = h.squeeze(0)[md.track_ssm_h_src].to(ssm.dtype, copy=False)
    if md.track_ssm_final_src is not None and md.track_ssm_final_src.numel() > 0:
        ssm[md.track_ssm_final_dst] = ssm[md.track_ssm_final_src]


class Layer:
    """One GDN layer's inputs, pools and the two ways to run its extend."""

    def __init__(self, shape: dict, lens: list[int], caps: list[tuple[int, int]], dtype, device, seed: int):
        import torch

        self.torch, self.shape, self.lens, self.caps = torch, shape, lens, caps
        gen = torch.Generator(device="cpu").manual_seed(seed)
        H, HV, K, V, dim, W = (shape[k] for k in ("H", "HV", "K", "V", "conv_dim", "W"))
        n, total = len(lens), sum(lens)

        def rnd(*s, scale=1.0):
            return (torch.randn(*s, generator=gen) * scale).to(device)

        self.q = rnd(1, total, H, K).to(dtype)
        self.k = rnd(1, total, H, K).to(dtype)
        self.v = rnd(1, total, HV, V).to(dtype)
        self.g = (-torch.rand(1, total, HV, generator=gen) * 0.05).to(device)  # fp32 (SGLang's gating)
        self.beta = torch.rand(1, total, HV, generator=gen).to(device).to(dtype)
        self.mixed = rnd(total, dim).to(dtype)
        self.qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        self.work = torch.arange(1, n + 1, dtype=torch.int32, device=device)
        self.slots = list(range(n + 1, n + 1 + len(caps)))
        self.pool = torch.zeros(n + len(caps) + 1, HV, V, K, dtype=torch.float32, device=device)
        self.conv = torch.zeros(n + len(caps) + 1, dim, W - 1, dtype=dtype, device=device)
        self.init = rnd(n, HV, V, K, scale=0.3)
        self.reset()

    def reset(self) -> None:
        self.pool[1 : len(self.lens) + 1] = self.init

    def extend(self, fla, q=None, k=None, v=None, g=None, beta=None, qsl=None, work=None):
        return fla.chunk.chunk_gated_delta_rule(
            q=self.q if q is None else q, k=self.k if k is None else k, v=self.v if v is None else v,
            g=self.g if g is None else g, beta=self.beta if beta is None else beta,
            initial_state=self.pool, initial_state_indices=self.work if work is None else work,
            cu_seqlens=self.qsl if qsl is None else qsl, head_first=False, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    def extend_with_captures(self, fla) -> tuple[Any, Any]:
        """The server's path for one forward of one layer (attach once, then the layer)."""
        torch = self.torch
        from sglang_sparse.sglang_adapter import track_capture as tc
        from sglang_sparse.sglang_adapter.track_lists import Layout

        dev = self.pool.device
        md = types.SimpleNamespace(
            query_start_loc=self.qsl, mamba_cache_indices=self.work, track_conv_indices=None,
            conv_states_mask_indices=None, track_ssm_h_src=None, track_ssm_h_dst=None,
            track_ssm_final_src=None, track_ssm_final_dst=None, num_state_checkpoints=0,
            has_mamba_track_mask=False,
        )  # fmt: skip
        pin = dev.type == "cuda"
        backend = types.SimpleNamespace(
            forward_metadata=md, mis_metadata=None, conv_states_shape=self.conv.shape[1:],
            req_to_token_pool=types.SimpleNamespace(
                mamba2_layer_cache=lambda lid: types.SimpleNamespace(temporal=self.pool, conv=[self.conv])
            ),
            _track_indices_to_device=lambda vals, dtype=torch.int64: torch.tensor(
                vals, dtype=dtype, pin_memory=pin
            ).to(dev, non_blocking=True),
            _translate_mamba_indices=lambda t: t,
        )  # fmt: skip
        batch = types.SimpleNamespace(
            forward_mode=_mode_extend(), extend_prefix_lens_cpu=[PREFIX] * len(self.lens),
            extend_seq_lens_cpu=list(self.lens),
        )  # fmt: skip
        rows = sorted({r for r, _ in self.caps})
        plan = tc.CapturePlan(
            rows=[r for r, _ in self.caps], offsets=[o for _, o in self.caps], slots=list(self.slots),
            geometry={r: (PREFIX, self.lens[r]) for r in rows}, n_layers=1, stats={},
        )  # fmt: skip
        tc.set_forward_plan(plan)
        assert tc.attach(backend, batch, plan, layout=(Layout.CHUNKS, 64)), "plan not attached"
        self.conv[md.conv_states_mask_indices] = self.mixed[md.track_conv_indices].transpose(1, 2)

        def original(_self, q, k, v, g, beta, **kw):
            return self.extend(fla, q, k, v, g, beta)

        out = tc.extend_hook(original, None, self.q, self.k, self.v, self.g, self.beta, layer_id=0)
        sglang_track_copies(md, out[2], self.pool)
        tc.done_hook(None, backend, batch, out[2], self.pool, md)
        assert plan.complete, "plan incomplete"
        return out, plan

    def cut_states(self, fla, caps: list[tuple[int, int]]) -> list[Any]:
        """The state at each of ``caps`` by a cut: the extend run on the sequence up to there."""
        torch = self.torch
        out = []
        starts = self.qsl.tolist()
        for row, off in caps:
            self.reset()
            lo = starts[row]
            sl = slice(lo, lo + off)
            self.extend(
                fla, self.q[:, sl], self.k[:, sl], self.v[:, sl], self.g[:, sl], self.beta[:, sl],
                qsl=torch.tensor([0, off], dtype=torch.int32, device=self.qsl.device),
                work=self.work[row : row + 1],
            )  # fmt: skip
            out.append(self.pool[int(self.work[row])].clone())
        self.reset()
        return out

    def fp64_states(self) -> list[Any]:
        torch = self.torch
        out = []
        starts = self.qsl.tolist()
        rep = self.shape["HV"] // self.shape["H"]
        for row, off in self.caps:
            lo = starts[row]
            k = self.k[0, lo : lo + off].double()
            k = (k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(rep, dim=-2)
            v, g, b = (
                self.v[0, lo : lo + off].double(),
                self.g[0, lo : lo + off].double(),
                self.beta[0, lo : lo + off].double(),
            )
            s = self.init[row].double().clone()
            for t in range(off):
                s = s * torch.exp(g[t])[:, None, None]
                u = b[t][:, None] * (v[t] - (s @ k[t].unsqueeze(-1)).squeeze(-1))
                s = s + u.unsqueeze(-1) * k[t].unsqueeze(-2)
            out.append(s)
        return out


def _pct(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 100.0 * (a - b) / b


def rel_err(got: Any, want: Any) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def captures_for(lens: list[int], per_16k: int = 4) -> list[tuple[int, int]]:
    """Four captures per 16k tokens: on the 64-grid (1/4, 5/8 of a sequence) and off it (3/8 + 17,
    7/8 + 33 tokens), spread over the batch's sequences in turn."""
    total = sum(lens)
    n = max(per_16k * total // 16384, 4)
    fracs = [(0.25, 0), (0.375, 17), (0.625, 0), (0.875, 33)]
    caps = []
    for j in range(n):
        row = j % len(lens)
        f, extra = fracs[j % 4]
        off = int(lens[row] * f) // 64 * 64 + extra
        caps.append((row, max(min(off, lens[row] - 1), 4)))
    return sorted(set(caps))


def time_variants(fns: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Interleaved timings (ms) of each variant, order rotated every round."""
    names = list(fns)
    out = {k: [] for k in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(fns[name]())
    return out


#: --quick: every kind once per batch: h rows, tails (one from row 0 of h: the initial state), final
QUICK_BATCHES = {(150,): [(0, 64), (0, 100), (0, 150)], (40, 90): [(0, 5), (1, 64), (1, 70)]}


def run_batch(fla, shape: dict, lens: list[int], dtype, device, repeats: int, quick: bool, seed: int) -> dict:
    import torch

    caps = QUICK_BATCHES[tuple(lens)] if quick else captures_for(lens)
    layer = Layer(shape, lens, caps, dtype, device, seed)
    cuda = device.type == "cuda"

    def timed(fn):
        def run():
            layer.reset()
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                return a.elapsed_time(b)
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        return run

    for _ in range(3 if repeats else 0):  # warm-up (Triton autotune + compile)
        layer.reset()
        layer.extend(fla)
        layer.extend_with_captures(fla)
    fns = {
        "plain": timed(lambda: layer.extend(fla)),
        "capture": timed(lambda: layer.extend_with_captures(fla)),
        "aa": timed(lambda: layer.extend(fla)),
    }
    times = time_variants(fns, repeats)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    layer.reset()
    (_, _, _), plan = layer.extend_with_captures(fla)
    captured = [layer.pool[s].clone() for s in layer.slots]
    conv_exact = all(
        torch.equal(layer.conv[s], layer.mixed[layer.qsl[r] + o - (shape["W"] - 1) : layer.qsl[r] + o].t())
        for (r, o), s in zip(caps, layer.slots, strict=True)
    )
    # Under the interpreter one cut (the extend is slow there); on a GPU every capture's.
    cuts = layer.cut_states(fla, caps[:1] if quick else caps) + [None] * (
        len(caps) - (1 if quick else len(caps))
    )
    rows = []
    refs = layer.fp64_states() if quick else [None] * len(caps)
    for (r, o), got, cut, ref in zip(caps, captured, cuts, refs, strict=True):
        rows.append(
            {
                "row": r,
                "offset": o,
                "kind": "final" if o == lens[r] else ("h" if o % 64 == 0 else "tail"),
                "rel_err_vs_cut": None if cut is None else rel_err(got, cut),
                "rel_err_vs_fp64": None if ref is None else rel_err(got, ref),
                "cut_rel_err_vs_fp64": None if ref is None or cut is None else rel_err(cut, ref),
            }
        )
    return {
        "lens": lens,
        "captures": rows,
        "tails": plan.n_tails,
        "ms": {k: {"median": med[k], "all": times[k]} for k in times},
        "overhead_pct": _pct(med["capture"], med["plain"]),
        "aa_pct": _pct(med["aa"], med["plain"]),
        "conv_exact": conv_exact,
        "max_rel_err_vs_cut": max(x["rel_err_vs_cut"] for x in rows if x["rel_err_vs_cut"] is not None),
        "max_rel_err_vs_fp64": max(
            (x["rel_err_vs_fp64"] for x in rows if x["rel_err_vs_fp64"] is not None), default=None
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sglang-src", help="folder holding an unpacked sglang/ (wheel); default: installed SGLang"
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU, TRITON_INTERPRET=1, fp16 (CI)")
    ap.add_argument("--repeats", type=int, default=20, help="interleaved timing rounds per batch (GPU)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"
        from sglang_sparse_kernels.gdn_capture._interpret import enable_interpreter_workarounds

        enable_interpreter_workarounds()
    import torch
    import triton

    fla = load_sglang_fla(args.sglang_src)
    import importlib

    for mod in ("chunk", "fused_recurrent"):
        setattr(fla, mod, importlib.import_module(f"{fla.__name__}.{mod}"))
    from sglang_sparse.sglang_adapter import track_capture as tc

    # The adapter takes the CPU stand-in for CPU tensors; under the interpreter, SGLang's own kernel.
    tc.tail_kernel = lambda device: fla.fused_recurrent.fused_recurrent_gated_delta_rule_update
    if args.quick:
        device, dtype, shape, repeats = torch.device("cpu"), torch.float16, QUICK, 0
        batches = [list(b) for b in QUICK_BATCHES]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --quick on a CPU")
        device, dtype, shape, repeats = torch.device("cuda"), torch.bfloat16, FULL, args.repeats
        batches = [[16384], [2048] * 8]
    t0 = time.time()
    results = [
        run_batch(fla, shape, lens, dtype, device, repeats, args.quick, seed=i)
        for i, lens in enumerate(batches)
    ]
    out = {
        "what": "GDN extend with captures through SGLang's track copies vs plain (capture_check.py)",
        "quick": args.quick,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": shape,
        "prefix_tokens": PREFIX,
        "repeats": repeats,
        "batches": results,
        "targets": {"overhead_pct_max": 2.0, "rel_err_vs_cut_max": 1e-2, "rel_err_vs_fp64_max_quick": 1e-3},
        "seconds": round(time.time() - t0, 1),
    }
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for b in results:
        timing = (
            f"plain {b['ms']['plain']['median']:.3f} ms, capture {b['ms']['capture']['median']:.3f} ms "
            f"({b['overhead_pct']:+.2f}%, A/A {b['aa_pct']:+.2f}%), "
            if b["overhead_pct"] is not None
            else "not timed (interpreter), "
        )
        print(
            f"lens {b['lens']}: {timing}"
            f"{len(b['captures'])} captures ({b['tails']} tails), "
            f"max rel err vs cut {b['max_rel_err_vs_cut']:.2e}"
            + (f", vs fp64 {b['max_rel_err_vs_fp64']:.2e}" if b["max_rel_err_vs_fp64"] is not None else "")
            + f", conv exact {b['conv_exact']}"
        )
    return out


if __name__ == "__main__":
    main()

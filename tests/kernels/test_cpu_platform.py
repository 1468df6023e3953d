"""The opt-in out-of-tree SGLang CPU platform (``SGLANG_PLATFORM=sglang_sparse_cpu``) and the CPU
pieces SGLang's extra_buffer strategy needs (decode-state tracking copies, the pin-memory hook).

The platform must answer every out-of-tree seam of SGLang 0.5.23 like the in-tree CPU platform does,
except ``support_mamba_cache_extra_buffer()``. Platform resolution is process-global in SGLang, so
those checks run in subprocesses (with and without ``SGLANG_PLATFORM``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from sglang_sparse_kernels.sgl_kernel_cpu import mamba_track  # noqa: E402

pytestmark = pytest.mark.kernel

_HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not _HAVE_SGLANG, reason="sglang is not installed")

PLATFORM = "sglang_sparse_cpu"
QUALNAME = "sglang_sparse_kernels.sgl_kernel_cpu.sglang_platform.SparseCpuSRTPlatform"


def _run(script: str, **env: str) -> dict:
    """Run ``script`` (prints one JSON line last) in a fresh interpreter; return that JSON."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLATFORM", "SGLANG_USE_CPU_ENGINE")}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ platform
_ANSWERS = """
    import json, torch
    from sglang.srt.platforms import current_platform as cur
    from sglang.srt.platforms.cpu import CpuSRTPlatform
    from sglang.srt.arg_groups.mamba_hook import _platform_supports_mamba_cache_extra_buffer
    from sglang.srt.utils.common import (
        get_compiler_backend, get_cpu_memory_capacity, get_device_memory_capacity, is_host_cpu_arm64,
    )
    from sglang.srt.distributed.parallel_state import get_default_distributed_backend
    from sglang.kernels import fused_op
    ref = CpuSRTPlatform()

    def caps(p):
        return {f: getattr(p.capabilities, f) for f in p.capabilities.__struct_fields__}

    out = dict(
        cls=f"{type(cur).__module__}.{type(cur).__qualname__}",
        oot=cur.is_out_of_tree(),
        is_cpu=cur.is_cpu(),
        device=[cur.device_name, cur.device_type],
        extra_buffer_gate=_platform_supports_mamba_cache_extra_buffer(),
        caps=caps(cur),
        ref_caps=caps(ref),
        pin=cur.is_pin_memory_available(),
        dist=cur.get_torch_distributed_backend_str(),
        dist_default=get_default_distributed_backend("cpu"),
        coord=str(cur.get_group_coordinator_device(0)),
        compile_backend=get_compiler_backend(),
        mem_capacity_mib=get_device_memory_capacity("cpu"),
        cpu_mem_capacity_mib=get_cpu_memory_capacity(),
        oot_key=fused_op._oot_dispatch_key(),
        in_tree_key=fused_op._platform_key(),
    )
    if cur.is_out_of_tree():
        from sglang.srt.model_executor.cpu_graph_runner import CPUGraphRunner
        out.update(
            attn=cur.get_default_attention_backend(),
            attn_in_tree="torch_native" if is_host_cpu_arm64() else "intel_amx",
            graph_runner_is_cpu=cur.get_graph_runner_cls() is CPUGraphRunner,
            kv_pool=[cur.get_kv_pool_cls(kind=k) is None for k in ("mha", "mla", "dsa")],
            full_graph_backend=cur.get_full_graph_backend_cls() is None,
            quant=cur.get_quantization_config("fp8") is None,
            spec=[cur.supports_speculative_algorithm(a) for a in ("EAGLE", "EAGLE3", "NGRAM", "DFLASH")],
            activity=cur.get_torch_profiler_activity_str(),
            activity_is_cpu=cur.get_torch_profiler_activity() == torch.profiler.ProfilerActivity.CPU,
        )
    print(json.dumps(out))
"""


@needs_sglang
def test_entry_point_registered() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.platforms")}
    if PLATFORM not in eps:
        pytest.skip("the CPU shim distribution is not installed (tools/setup_env.sh)")
    assert eps[PLATFORM] == "sglang_sparse_kernels.sgl_kernel_cpu.sglang_platform:activate"


@needs_sglang
def test_activate_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Active only when SGLANG_PLATFORM names it, on a CPU engine, without CUDA."""
    from sglang_sparse_kernels.sgl_kernel_cpu import sglang_platform as sp

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    assert sp.activate() is None  # auto-discovery: never
    monkeypatch.setenv("SGLANG_PLATFORM", "some_other_platform")
    assert sp.activate() is None
    monkeypatch.setenv("SGLANG_PLATFORM", PLATFORM)
    if not torch.cuda.is_available():
        assert sp.activate() == QUALNAME
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sp.activate() is None  # a CUDA machine: inactive even when selected
    monkeypatch.undo()
    monkeypatch.setenv("SGLANG_PLATFORM", PLATFORM)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert sp.activate() is None  # not a CPU engine


@needs_sglang
def test_selected_platform_answers_like_in_tree_cpu() -> None:
    if PLATFORM not in {ep.name for ep in entry_points(group="sglang.srt.platforms")}:
        pytest.skip("the CPU shim distribution is not installed (tools/setup_env.sh)")
    got = _run(_ANSWERS, SGLANG_USE_CPU_ENGINE="1", SGLANG_PLATFORM=PLATFORM)
    assert got["cls"] == QUALNAME and got["oot"] and got["is_cpu"]
    assert got["extra_buffer_gate"] is True
    assert got["device"] == ["cpu", "cpu"]
    # Capabilities as CpuSRTPlatform, plus supports_pynccl (read only for OOT platforms, where True
    # keeps parallel_state's in-tree decision).
    assert {**got["ref_caps"], "supports_pynccl": True} == got["caps"]
    assert got["pin"] is False and got["dist"] == got["dist_default"] == "gloo" and got["coord"] == "cpu"
    assert got["compile_backend"] == "inductor"
    assert got["mem_capacity_mib"] == got["cpu_mem_capacity_mib"]  # OOT branch == in-tree cpu branch
    assert got["attn"] == got["attn_in_tree"] and got["graph_runner_is_cpu"]
    assert got["kv_pool"] == [True, True, True] and got["full_graph_backend"] and got["quant"]
    assert got["spec"] == [True, True, True, False]  # in-tree CPU rejects only DFLASH
    assert got["activity"] not in ("CPU", "GPU", "MEM", "CUDA_PROFILER", "RPD") and got["activity_is_cpu"]
    # BaseFusedOp: the OOT key selects the same platform forward as the in-tree key.
    assert {"cpu": "cpu", "": "native"}[got["in_tree_key"]] == got["oot_key"]


@needs_sglang
def test_unselected_keeps_in_tree_cpu_platform() -> None:
    got = _run(_ANSWERS, SGLANG_USE_CPU_ENGINE="1")
    assert got["cls"] == "sglang.srt.platforms.cpu.CpuSRTPlatform"
    assert not got["oot"] and got["extra_buffer_gate"] is False


_FUSED_OP_SCAN = """
    import importlib, json, pkgutil
    import sglang.kernels as K, sglang.srt.layers as L, sglang.srt.models as M
    from sglang.kernels import fused_op as fo
    from sglang.kernels.spec import KernelBackend, PlatformInfo, capabilities_satisfied
    for pkg, prefix in ((K, "sglang.kernels."), (L, "sglang.srt.layers."), (M, "sglang.srt.models.")):
        for m in pkgutil.walk_packages(pkg.__path__, prefix):
            try:
                importlib.import_module(m.name)
            except BaseException:
                pass

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    def defined(cls, name):
        for k in cls.__mro__:
            if k is fo.BaseFusedOp:
                return False
            if name in k.__dict__:
                return True
        return False

    cpu = PlatformInfo(device_type="cpu")
    classes = set(subclasses(fo.BaseFusedOp))
    hits = []
    for cls in classes:
        for b in cls.priority:
            if b is KernelBackend.TORCH:
                continue
            declared = b in cls.capabilities and defined(cls, fo.BACKEND_METHODS[b])
            if (b is KernelBackend.TORCH_COMPILE or declared) and capabilities_satisfied(
                cls.capabilities.get(b, frozenset()), cpu
            ):
                hits.append(f"{cls.__module__}.{cls.__qualname__}:{b.value}")
    print(json.dumps({"classes": len(classes), "hits": hits}))
"""


@needs_sglang
def test_fused_op_dispatch_step_4_never_applies_on_a_cpu() -> None:
    """On OOT platforms ``BaseFusedOp`` skips dispatch step 4 (kernel backends by priority,
    ``sglang/kernels/fused_op.py`` ``_resolve_forward_method``). That changes nothing on a CPU only
    if no op has a step-4 backend whose capability requirements a CPU satisfies; per-call gates
    (``backend_eligible`` overrides) all start from that same capability check."""
    got = _run(_FUSED_OP_SCAN, SGLANG_USE_CPU_ENGINE="1")
    assert got["classes"] >= 40, got  # the scan found SGLang's ops
    assert got["hits"] == [], got


# ------------------------------------------------------------------- decode tracking copies
def _ref_track(conv, ssm, src_idx, mask, dst_idx, bs, check, all_layers):
    conv, ssm = conv.clone(), ssm.clone()
    for i in range(bs):
        if not bool(mask[i]):
            continue
        s, d = int(src_idx[i]), int(dst_idx[i])
        if check and (s < 0 or d < 0):
            continue
        if all_layers:
            conv[:, d], ssm[:, d] = conv[:, s].clone(), ssm[:, s].clone()
        else:
            conv[d], ssm[d] = conv[s].clone(), ssm[s].clone()
    return conv, ssm


@pytest.mark.parametrize("all_layers", [False, True])
@pytest.mark.parametrize("check_freed", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32])
def test_track_mamba_states_match_reference(all_layers: bool, check_freed: bool, mask_dtype) -> None:
    """Rows with the mask set copy slot ``cache_indices[i]`` to ``mamba_track_indices[i]`` in the
    conv and SSM pools (every layer for the all-layers variant); rows past ``batch_size`` and, with
    ``check_freed_slots``, rows with a negative slot are skipped."""
    gen = torch.Generator().manual_seed(0)
    lead = (3,) if all_layers else ()
    conv = torch.randn(*lead, 12, 6, 3, generator=gen)
    ssm = torch.randn(*lead, 12, 2, 4, 4, generator=gen)
    src = torch.tensor([1, 2, 3, 4, 5, 6])
    dst = torch.tensor([7, 8, -1 if check_freed else 9, 10, 11, 0])
    mask = torch.tensor([1, 0, 1, 1, 1, 1], dtype=mask_dtype)
    bs = 5  # row 5 is padding past the batch
    want = _ref_track(conv, ssm, src, mask, dst, bs, check_freed, all_layers)
    fn = mamba_track.track_mamba_states_all_layers if all_layers else mamba_track.track_mamba_states_if_needed
    fn(conv, ssm, src, mask, dst, bs, check_freed_slots=check_freed)
    assert torch.equal(conv, want[0]) and torch.equal(ssm, want[1])


def test_track_mamba_states_empty_batch_is_a_noop() -> None:
    conv, ssm = torch.randn(4, 2), torch.randn(4, 3)
    before = conv.clone(), ssm.clone()
    empty = torch.empty(0, dtype=torch.long)
    mamba_track.track_mamba_states_if_needed(conv, ssm, empty, empty.bool(), empty, 0)
    mamba_track.track_mamba_states_if_needed(
        conv, ssm, torch.tensor([0]), torch.tensor([False]), torch.tensor([1]), 1
    )
    assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1])


@needs_sglang
def test_track_signatures_match_sglang() -> None:
    """The torch copies keep the Triton functions' signatures (they replace those names)."""
    import inspect

    triton_mod = pytest.importorskip("sglang.kernels.ops.mamba.mamba_state_scatter_triton")
    for name in ("track_mamba_states_if_needed", "track_mamba_states_all_layers"):
        want = list(inspect.signature(getattr(triton_mod, name)).parameters)
        assert list(inspect.signature(getattr(mamba_track, name)).parameters) == want, name


# ---------------------------------------------------------------------------- pin-memory hook
@needs_sglang
@pytest.mark.skipif(torch.accelerator.is_available(), reason="an accelerator is present: pinning works")
def test_pin_memory_is_a_noop_only_inside_prepare_for_decode() -> None:
    from sglang_sparse_kernels.sgl_kernel_cpu.sglang_platform import _decode_without_pinning

    t = torch.arange(4)
    with pytest.raises(RuntimeError):
        t.pin_memory()  # CPU-only torch: what SGLang's prepare_for_decode would hit
    out = _decode_without_pinning(lambda x: x.pin_memory().to("cpu", non_blocking=True), t)
    assert out is t
    with pytest.raises(RuntimeError):
        t.pin_memory()  # restored after the call

"""Out-of-tree SGLang platform for the CPU that supports the Mamba ``extra_buffer`` cache strategy.

SGLang 0.5.23 lets the ``extra_buffer`` Mamba radix-cache strategy (state snapshots at chunk
boundaries and every ``mamba_track_interval`` decode steps; required for the overlap schedule and
page sizes > 1 on hybrid GDN models) run only on CUDA/MUSA/NPU/HIP/XPU, or on an out-of-tree
platform whose ``support_mamba_cache_extra_buffer()`` is True
(``sglang/srt/arg_groups/mamba_hook.py`` ``_platform_supports_mamba_cache_extra_buffer``). This is
that platform for a CPU: SGLang's own in-tree :class:`~sglang.srt.platforms.cpu.CpuSRTPlatform`
plus that one capability, registered under the entry-point group ``sglang.srt.platforms`` as
:data:`PLATFORM_NAME`.

Opt-in only: it activates when ``SGLANG_PLATFORM=sglang_sparse_cpu`` (and ``SGLANG_USE_CPU_ENGINE=1``
on a host without CUDA), never by auto-discovery. Reasons: (a) the platform is global to every
SGLang process of the environment, and being out of tree switches ~30 SGLang code paths to their
"out-of-tree" branch (listed below), so CPU servers that do not need extra_buffer keep running on
exactly SGLang's in-tree CPU platform; (b) an auto-activated plugin would make SGLang's ``auto``
strategy silently pick ``extra_buffer`` (overlap schedule on) for every CPU server, and would make
SGLang refuse to start ("Multiple platform plugins activated") next to any other platform plugin.
``sglang_sparse.testing.server`` exposes the environment as ``CPU_EXTRA_BUFFER_ENV``.

Being out of tree (``PlatformEnum.OOT``) changes these SGLang 0.5.23 sites (``grep -rn
"is_out_of_tree()" sglang/srt sglang/kernels``); each is answered so the server behaves like the
in-tree CPU platform:

* ``arg_groups/mamba_hook.py:103`` extra_buffer gate -> :meth:`support_mamba_cache_extra_buffer` (True).
* ``arg_groups/model_override_base.py:293`` default attention backend -> the in-tree CPU choice
  (``intel_amx``, ``torch_native`` on arm64; later demoted to ``torch_native`` without AMX as
  in-tree, ``arg_groups/overrides.py`` ``_attention_backend_platform_fallbacks``).
* ``model_runner_components/cuda_graph_setup.py:764`` graph runner: an OOT platform must name one
  (``require_out_of_tree_impl``) -> ``CPUGraphRunner``, the in-tree CPU runner (``--enable-torch-compile``).
* ``utils/common.py:992`` memory capacity -> :meth:`get_device_total_memory` returns the in-tree
  ``get_cpu_memory_capacity()`` (per NUMA node, cgroup-capped; None stays None).
* ``distributed/parallel_state.py:2182`` PyNccl for model-parallel groups: ``capabilities.supports_pynccl``
  is True only so the in-tree decision is kept (a communicator that disables itself without NCCL).
  ``parallel_state.py:2125`` group-coordinator device: ``cpu`` (base default = in-tree).
* ``kernels/fused_op.py:203`` ``BaseFusedOp`` dispatch key -> ``cpu`` with AMX, else ``native``, the
  in-tree ``_platform_key()`` outcome (no SGLang op declares a kernel backend a CPU satisfies, so
  skipping dispatch step 4 on OOT platforms changes nothing; checked in tests/kernels).
* ``managers/scheduler_components/profiler_manager.py:191``, ``utils/profile_utils.py:249,328``
  profiler: the CPU has no device activity besides ``CPU``, which SGLang already handles; the
  activity name here is one no caller passes, so no second torch profiler is created.
* Sites whose base-class default already equals the in-tree CPU path: ``model_runner.py:270``
  (``init_backend``, used here to route the Triton-only decode tracking to torch),
  ``runner_backend/utils.py:95`` (full graph backend None -> in-tree), ``layers/quantization/__init__.py:179``
  (None -> in-tree), ``utils/common.py:1198`` (compile backend ``inductor`` = in-tree on a CPU),
  ``utils/common.py:3001`` (custom ops registered for ``PrivateUse1`` instead of ``CUDA``: neither
  is the CPU key, so CPU tensors dispatch the same), ``configs/device_config.py:18``,
  ``layers/rotary_embedding/base.py:129`` (already excluded for CPU), ``utils/common.py:559``
  (unreached: ``device == "cpu"`` has its own branch), ``mem_cache/kv_cache_configurator.py:1543,1953``
  and ``reject_out_of_tree_path`` sites (KV sharding, unified memory, fp4/mxfp8, DSv4, MiniMax
  sparse, HiSparse pools: features the in-tree CPU does not serve either).
* Speculative decoding (``arg_groups/speculative_hook.py``, ``speculative/*``,
  ``kernels/ops/speculative/cache_locs.py``): algorithms are accepted as in-tree (all but DFLASH);
  draft graph runners run eagerly (the in-tree table has no ``cpu`` entry and raises). The CPU
  shim has no speculative GDN verify ops, so hybrid models cannot use it on the CPU either way.
* ``model_runner_components/weight_updater.py:251``: ``update_weights_from_disk`` with
  ``recapture_cuda_graph`` re-captures the CPU graph here (in-tree CPU skips it).

``is_cpu()`` is True (``current_platform.is_cpu()`` guards CPU-only rules, e.g. fp8_e5m2 KV
rejection in ``mem_cache/kv_cache_dtype.py``); ``device_name`` / ``device_type`` stay ``cpu``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities

#: Entry-point name (group ``sglang.srt.platforms``) and the ``SGLANG_PLATFORM`` value selecting it.
PLATFORM_NAME = "sglang_sparse_cpu"

#: Profiler activity name of the (nonexistent) CPU device activity; never requested by a caller.
_NO_DEVICE_ACTIVITY = "SGLANG_SPARSE_CPU_NO_DEVICE_ACTIVITY"

#: Module attributes of SGLang 0.5.23 that hold the Triton-only decode tracking copies.
_TRACK_MODULE = "sglang.srt.layers.attention.hybrid_linear_attn_backend"


def platform_selected() -> bool:
    """Whether ``SGLANG_PLATFORM`` names this platform (the only way it activates)."""
    return os.environ.get("SGLANG_PLATFORM", "") == PLATFORM_NAME


def activate() -> str | None:
    """Entry point: the platform class's qualified name, or None to stay inactive.

    Active only when explicitly selected (:func:`platform_selected`) on a CPU engine
    (``SGLANG_USE_CPU_ENGINE=1`` on an x86-64 or arm64 host, as SGLang's ``is_cpu()``) with no CUDA
    device visible. Selected but inactive makes SGLang refuse to start ("activate() returned
    None"), which is the intended loud failure on a GPU host.

    Runs while ``sglang.srt.utils.common`` is still being imported (its module-level
    ``from sglang.srt.platforms import current_platform`` resolves the platform), so it must not
    import SGLang's utilities; the checks are spelled out here.
    """
    if not platform_selected():
        return None
    cpu_engine = os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"
    if not cpu_engine or _machine() not in _CPU_ARCHS or torch.cuda.is_available():
        return None
    return f"{__name__}.SparseCpuSRTPlatform"


#: ``platform.machine()`` values of the hosts SGLang's ``is_cpu()`` accepts (x86-64 and arm64).
_CPU_ARCHS = frozenset({"x86_64", "amd64", "i386", "i686", "aarch64", "arm64"})


def _machine() -> str:
    import platform

    return platform.machine().lower()


def install_cpu_track_routes() -> None:
    """Point SGLang's decode-state tracking (Triton-only) at the torch copies in
    :mod:`sglang_sparse_kernels.sgl_kernel_cpu.mamba_track` (now, or when the backend module is
    first imported). Idempotent."""
    from . import mamba_track
    from .sglang_cpu_plugin import after_import

    def route(module: Any) -> None:
        module.track_mamba_states_if_needed = mamba_track.track_mamba_states_if_needed
        module.track_mamba_states_all_layers = mamba_track.track_mamba_states_all_layers

    after_import(_TRACK_MODULE, route)


_pin_lock = threading.RLock()


def _unpinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.pin_memory`` without an accelerator: nothing to pin for, the tensor itself."""
    return self


def _decode_without_pinning(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``ScheduleBatch.prepare_for_decode``.

    With extra_buffer, SGLang 0.5.23 stages the decode track mask with an unconditional
    ``track_mask_cpu.pin_memory()`` (``managers/schedule_batch.py:3830``; every other staging site
    asks ``is_pin_memory_available()``, False on the CPU). A CPU-only torch raises "Cannot access
    accelerator device when none is available" there. For the duration of the call (serialised by a
    lock; the scheduler thread is the only caller) ``Tensor.pin_memory`` returns the tensor itself;
    the following ``.to("cpu", non_blocking=True)`` is then a no-op, as it is for any CPU tensor.
    """
    if torch.accelerator.is_available():
        return original(*args, **kwargs)
    with _pin_lock:
        saved = torch.Tensor.pin_memory
        torch.Tensor.pin_memory = _unpinned  # type: ignore[method-assign]
        try:
            return original(*args, **kwargs)
        finally:
            torch.Tensor.pin_memory = saved  # type: ignore[method-assign]


_hooks_registered = False


def register_extra_buffer_hooks() -> None:
    """Register the SGLang hooks extra_buffer needs on the CPU (idempotent; call from a plugin)."""
    global _hooks_registered
    if _hooks_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
        _decode_without_pinning,
        HookType.AROUND,
    )
    _hooks_registered = True


class SparseCpuSRTPlatform(CpuSRTPlatform):
    """SGLang's in-tree CPU platform, out of tree, with Mamba extra_buffer support.

    Invariant: every answer equals what SGLang 0.5.23 does for its in-tree CPU platform, except
    :meth:`support_mamba_cache_extra_buffer` (see the module docstring for each site).
    """

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # graph_capture as CpuSRTPlatform; supports_pynccl only keeps parallel_state's in-tree choice.
    capabilities = PlatformCapabilities(graph_capture=True, supports_pynccl=True)

    def is_cpu(self) -> bool:
        return True

    def support_mamba_cache_extra_buffer(self) -> bool:
        return True

    def init_backend(self) -> None:
        """Once per worker (``model_runner`` import): route the decode tracking copies to torch."""
        install_cpu_track_routes()

    def get_default_attention_backend(self) -> str:
        """In-tree CPU default (``platform_hook.handle_cpu_backends``)."""
        from sglang.srt.utils.common import is_host_cpu_arm64

        return "torch_native" if is_host_cpu_arm64() else "intel_amx"

    def get_graph_runner_cls(self) -> type | None:
        from sglang.srt.model_executor.cpu_graph_runner import CPUGraphRunner

        return CPUGraphRunner

    def get_device_total_memory(self, device_id: int = 0) -> int:
        """Bytes of the in-tree ``get_cpu_memory_capacity()`` (MiB per NUMA node, cgroup-capped);
        0 when that is unknown (``SGLANG_CPU_OMP_THREADS_BIND`` set), which SGLang reads as None."""
        from sglang.srt.utils.common import get_cpu_memory_capacity

        mib = get_cpu_memory_capacity()
        return 0 if mib is None else int(mib) << 20

    def get_dispatch_key_name(self) -> str:
        """``cpu`` with AMX (``forward_cpu``), else ``native`` (``forward_native``), like the
        in-tree ``sglang.kernels.fused_op._platform_key``."""
        from sglang.srt.utils.common import cpu_has_amx_support

        return "cpu" if cpu_has_amx_support() else "native"

    def get_torch_profiler_activity_str(self) -> str:
        return _NO_DEVICE_ACTIVITY

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CPU

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        """In-tree CPU: every algorithm but DFLASH passes argument validation."""
        return str(algorithm).upper() != "DFLASH"

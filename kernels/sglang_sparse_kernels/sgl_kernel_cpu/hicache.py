"""SGLang's hierarchical cache (HiCache, ``--enable-hierarchical-cache``) on a CPU-only SGLang.

SGLang 0.5.23 cannot start HiCache without an accelerator, for three reasons (paths under
``sglang/srt/``):

1. the host pools allocate through ``mem_cache/pool_host/common.py``'s ``ALLOC_MEMORY_FUNCS``, which
   sends ``cpu`` to ``alloc_with_host_register`` -> ``torch.cuda.cudart()`` (``common.py:147``):
   "Torch not compiled with CUDA enabled". :func:`alloc_host` allocates plain host memory instead
   (pinning is meaningless without a device to copy to);
2. the host<->device copies are ``sgl_kernel.kvcacheio`` ops that ``pool_host/mha.py:60-74`` and
   ``pool_host/mamba.py:31-42`` import only on CUDA/HIP (``NameError`` at the first backup). The
   ``direct`` io backend needs three of them; :func:`transfer_kv_direct`,
   :func:`transfer_kv_per_layer_direct_pf_lf` and :func:`transfer_kv_all_layer_direct_lf_pf` are
   their torch versions (index_select / index_copy_, the semantics of sgl-kernel's own test
   references ``ref_copy_with_indices`` and ``ref_copy_with_indices_pf_direct``);
3. the default ``kernel`` io backend needs further ops (``transfer_kv_all_layer_lf_pf``, and for
   Mamba states the JIT CUDA ``transfer_kv_mamba_lf_pf``); :func:`direct_io_on_cpu` resolves
   ``--hicache-io-backend`` to ``direct`` on a CPU server (SGLang's own resolution then turns the
   ``page_first`` layout into ``page_first_direct``), with a log line.

Streams and events need nothing: on the CPU SGLang's device module is ``torch.cpu``, whose
``Stream``/``Event`` are no-ops (timed events raise ``TypeError``, which
``mem_cache/l2_transfer.py:18-28`` catches).

Layouts: device buffers are per layer, ``[tokens | slots, ...]``; a ``page_first_direct`` host
buffer is ``[pages, layers, page_size, ...]`` (KV, ``pool_host/mha.py:310``) or
``[slots, layers, 1, ...]`` (Mamba states, ``pool_host/mamba.py:265``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mamba")


def alloc_host(
    dims: Any,
    dtype: torch.dtype,
    device: Any,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """``ALLOC_MEMORY_FUNCS["cpu"]``: a custom allocator (a storage backend's) allocates; otherwise
    plain ``torch.empty`` (no ``cudaHostRegister``)."""
    del pin_memory, registration_granularity_bytes
    if allocator is not None and type(allocator).__name__ != "HostTensorAllocator":
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def _long(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.long)


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst[l][dst_indices] = src[l][src_indices]`` for every layer ``l`` (layer-first on both
    sides)."""
    del page_size
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers vs {len(dst_layers)} destination layers")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers, strict=True):
        rows = src.index_select(0, _long(src_indices, src.device))
        dst.index_copy_(0, _long(dst_indices, dst.device), rows.to(dst.device))


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host page-first -> device layer-first, one layer (a load back): token ``i`` of the batch
    comes from host page ``src_indices[i] // page_size``, slot ``src_indices[i] % page_size``."""
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} source buffers vs {len(dst_ptrs)} destination buffers")
    n = src_indices.numel()
    if n == 0:
        return
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        idx = _long(src_indices, src.device)
        vals = src[idx // page_size, layer_id, idx % page_size]  # [n, ...]
        dst.index_copy_(0, _long(dst_indices, dst.device), vals.reshape(n, *dst.shape[1:]).to(dst.device))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layer-first -> host page-first, every layer (a backup). ``src_ptrs`` holds
    ``len(dst_ptrs)`` groups of ``L`` layers, group-major (K layers then V layers); host buffer ``j``
    receives group ``j``: ``dst_j[dst_indices[i] // page_size, l, dst_indices[i] % page_size] =
    src_{j*L+l}[src_indices[i]]``."""
    n = src_indices.numel()
    if n == 0:
        return
    layers, rest = divmod(len(src_ptrs), len(dst_ptrs))
    if rest:
        raise ValueError(f"{len(src_ptrs)} source layers do not split into {len(dst_ptrs)} groups")
    for j, dst in enumerate(dst_ptrs):
        d = _long(dst_indices, dst.device)
        page, slot = d // page_size, d % page_size
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            vals = src.index_select(0, _long(src_indices, src.device)).to(dst.device)
            dst[page, layer, slot] = vals.reshape(n, *dst.shape[3:])


TRANSFER_OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}


def _patch_alloc(module: Any) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_host


def _patch_pool(module: Any) -> None:
    for name, fn in TRANSFER_OPS.items():
        if not callable(getattr(module, name, None)):
            setattr(module, name, fn)


def direct_io_on_cpu(server_args: Any) -> None:
    """BEFORE hook on ``arg_groups.hicache_hook.resolve_layout_io_compatibility``: on a CPU server
    with HiCache and the ``kernel`` io backend (SGLang's default), declare ``direct`` (the only io
    backend the CPU has copy ops for)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    cfg = resolving_view(server_args)
    if cfg.device != "cpu" or not cfg.enable_hierarchical_cache or cfg.hicache_io_backend != "kernel":
        return None
    declare_resolution(server_args, "sglang_sparse_cpu_hicache", hicache_io_backend="direct")
    logger.warning(
        "sglang_sparse CPU plugin: HiCache on the CPU has copy ops for the 'direct' io backend only; "
        "--hicache-io-backend kernel resolved to direct"
    )
    return None


_installed = False


def install() -> None:
    """Apply the three fixes of the module docstring (idempotent; patches modules when they are
    first imported). Call on a CPU-only SGLang only."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .sglang_cpu_plugin import after_import

    after_import("sglang.srt.mem_cache.pool_host.common", _patch_alloc)
    for name in _POOL_MODULES:
        after_import(name, _patch_pool)
    HookRegistry.register(
        "sglang.srt.arg_groups.hicache_hook.resolve_layout_io_compatibility",
        direct_io_on_cpu,
        HookType.BEFORE,
    )
    _installed = True

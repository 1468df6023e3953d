"""CPU-only ``sgl_kernel`` shim from sglang-sparse (NOT the real sgl-kernel).

Provides what SGLang 0.5.23 imports from ``sgl_kernel`` on a CPU-only machine for hybrid GDN models:
the plain functions below, the ``sgl_kernel.mamba`` module, and the ``torch.ops.sgl_kernel.*`` ops
registered by :func:`sglang_sparse_kernels.sgl_kernel_cpu.registry.register`.

Other ``*_cpu`` names SGLang imports at module level on the CPU (speculative decoding helpers, ...)
resolve to stubs that raise ``NotImplementedError`` when called, so start-up succeeds and a missing
op is reported by name only if it is actually used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_sparse_kernels.sgl_kernel_cpu import registry as _registry
from sglang_sparse_kernels.sgl_kernel_cpu.kv_copy import (
    copy_all_layer_kv_cache as copy_all_layer_kv_cache_cpu,
)
from sglang_sparse_kernels.sgl_kernel_cpu.token_pool import (
    assign_req_to_token_pool as assign_req_to_token_pool_cpu,
)

from . import mamba

__sglang_sparse_cpu_shim__ = True
__version__ = "0.0.0+sglang-sparse-cpu-shim"

_registry.register()


def _missing(name: str) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is not implemented by the sglang-sparse CPU shim")

    stub.__name__ = name
    return stub


def __getattr__(name: str) -> Any:
    if name.endswith("_cpu"):
        return _missing(name)
    raise AttributeError(f"module 'sgl_kernel' (sglang-sparse CPU shim) has no attribute {name!r}")


__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", "mamba"]

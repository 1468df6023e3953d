"""SGLang general plugin (entry point group ``sglang.srt.plugins``) for CPUs without AMX.

On any CPU-only SGLang it also installs the HiCache routes (:mod:`.hicache`: host pools without
``cudaHostRegister``, torch host<->device copy ops, the ``direct`` io backend) and the Mamba2 routes
(:func:`install_mamba2_routes`).

SGLang 0.5.23 sends two pieces of the Qwen3-Next/Qwen3.5 path to its CPU kernels only when the CPU
has AMX (``cpu_has_amx_support()``) and to GPU-only Triton kernels otherwise:

* the GDN output norm (``FusedRMSNormGated`` / ``RMSNormGated``: module flag ``_use_cpu``), and
* the shared-expert gate of the MoE block (``fused_gate_sigmoid_mul_add`` in ``qwen2_moe``).

On a CPU-only SGLang without AMX this plugin sets those flags (so the norm calls
``torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu``, which our shim provides) and swaps the gate for a
torch expression. It does nothing on CUDA/AMX machines.

:func:`register_input_guard` (a second entry point, independent of the CPU) makes the tokenizer
manager reject prompts with token ids outside ``[0, vocab_size)`` with a 400 error; SGLang 0.5.23
does not check them and an out-of-vocabulary id crashes the scheduler (embedding ``IndexError``),
taking the whole server down. SGLang calls :func:`register` early in every
process (``load_plugins``); if ``SGLANG_PLUGINS`` restricts the plugin list, include
``sglang_sparse_cpu`` in it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_applied = False


def _gate_sigmoid_mul_add(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    final_hidden_states: torch.Tensor,
) -> None:
    """``final += sigmoid(hidden @ gate_weight) * shared`` in place (``gate_weight: [hidden]``)."""
    gate = hidden_states @ gate_weight.reshape(-1, 1).to(hidden_states.dtype)  # [T, 1]
    final_hidden_states.add_(torch.sigmoid(gate) * shared_output)


def needs_cpu_routes() -> bool:
    """True on a CPU-only SGLang without AMX (the case the Triton fallbacks cannot run)."""
    from sglang.srt.utils import cpu_has_amx_support, is_cpu

    return bool(is_cpu() and not cpu_has_amx_support())


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs ``callback(module)`` right after ``name`` is first executed."""

    def __init__(self, name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module
        callback = self.callback

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            callback(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        sys.meta_path.remove(self)
        return spec


def after_import(name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """Run ``callback(module)`` now if ``name`` is imported, else right after its first import.

    Lets the plugin patch SGLang modules without importing them itself (importing them early, from
    inside ``load_plugins``, could create import cycles).
    """
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PatchAfterImport(name, callback))


def _enable_cpu_norm(module: types.ModuleType) -> None:
    module._use_cpu = True  # type: ignore[attr-defined]


def _replace_gate(module: types.ModuleType) -> None:
    module.fused_gate_sigmoid_mul_add = _gate_sigmoid_mul_add  # type: ignore[attr-defined]


#: SGLang 0.5.23 modules that bind the Mamba2 Triton kernels at import: name -> attributes replaced by
#: the torch stand-ins of :mod:`.mamba2` (same names there). ``mamba.py`` binds the conv names only under
#: CUDA/NPU/XPU (``NameError`` on the CPU) and the SSD scan / state update from ``triton_ops``;
#: ``mamba1.py`` re-imports the conv names from it (so they must exist before it is imported) and its
#: ``selective_state_update`` is left alone (its Mamba1 prefill scan has no CPU path either).
MAMBA2_ROUTES: dict[str, tuple[str, ...]] = {
    "sglang.srt.layers.attention.mamba.mamba": (
        "causal_conv1d_fn",
        "causal_conv1d_fn_triton",
        "causal_conv1d_update",
        "causal_conv1d_update_triton",
        "mamba_chunk_scan_combined",
        "selective_state_update",
    ),
}

#: :data:`MAMBA2_ROUTES` names whose stand-in has another name in :mod:`.mamba2`.
_MAMBA2_ALIASES = {
    "causal_conv1d_fn_triton": "causal_conv1d_fn",
    "causal_conv1d_update_triton": "causal_conv1d_update",
}


def _route_mamba2(module: types.ModuleType) -> None:
    from . import mamba2

    for attr in MAMBA2_ROUTES[module.__name__]:
        setattr(module, attr, getattr(mamba2, _MAMBA2_ALIASES.get(attr, attr)))


def install_mamba2_routes() -> None:
    """Point SGLang's Mamba2 mixer (Nemotron-H, Falcon-H1, Granite-4.0-H) at :mod:`.mamba2`.

    For every CPU-only SGLang, AMX or not: unlike GDN, SGLang 0.5.23 has no CPU Mamba2 path at all
    (the conv names are unbound and the SSD kernels are Triton, whose wrappers also enter
    ``torch.get_device_module(x.device).device(...)``, absent from ``torch.cpu``). The stand-ins
    replace the module attributes, so ``MambaMixer2.forward`` never reaches a Triton wrapper.
    Idempotent.
    """
    for name in MAMBA2_ROUTES:
        after_import(name, _route_mamba2)


def register() -> None:
    """Apply the CPU routes (idempotent; patches modules when they are first imported).

    When the opt-in out-of-tree platform is selected (``SGLANG_PLATFORM=sglang_sparse_cpu``), also
    registers the hooks SGLang's extra_buffer strategy needs on the CPU
    (:func:`.sglang_platform.register_extra_buffer_hooks`); plugins are the only place SGLang
    applies hooks from (``load_plugins``, before the platform object exists).
    """
    global _applied
    if _applied:
        return
    try:
        from .sglang_platform import platform_selected, register_extra_buffer_hooks

        if platform_selected():
            register_extra_buffer_hooks()
    except Exception:  # noqa: BLE001 - a plugin must never take the server down
        logger.exception("sglang_sparse CPU platform hooks failed")
    try:
        from sglang.srt.utils import is_cpu

        if is_cpu():
            from . import hicache

            hicache.install()
    except Exception:  # noqa: BLE001 - a plugin must never take the server down
        logger.exception("sglang_sparse CPU HiCache routes failed")
    try:
        from sglang.srt.utils import is_cpu

        if is_cpu():
            install_mamba2_routes()
    except Exception:  # noqa: BLE001 - a plugin must never take the server down
        logger.exception("sglang_sparse CPU Mamba2 routes failed")
    try:
        if not needs_cpu_routes():
            return
        from . import registry

        registry.register()
        after_import("sglang.kernels.ops.attention.fla.fused_norm_gate", _enable_cpu_norm)
        after_import("sglang.kernels.ops.attention.fla.layernorm_gated", _enable_cpu_norm)
        after_import("sglang.srt.models.qwen2_moe", _replace_gate)
    except Exception:  # noqa: BLE001 - a plugin must never take the server down
        logger.exception("sglang_sparse CPU plugin failed")
        return
    _applied = True
    logger.info("sglang_sparse CPU plugin: gated RMSNorm and shared-expert gate routed to torch ops")


_guard_applied = False


def _check_input_ids(self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``TokenizerManager._validate_one_request``: ids must lie in ``[0, vocab)``."""
    if not input_ids:
        return None
    vocab = int(self.model_config.vocab_size)
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab:
        bad = hi if hi >= vocab else lo
        raise ValueError(f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab}).")
    return None


def register_input_guard() -> None:
    """Register the out-of-vocabulary input check (idempotent)."""
    global _guard_applied
    if _guard_applied:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
            _check_input_ids,
            HookType.BEFORE,
        )
    except Exception:  # noqa: BLE001 - a plugin must never take the server down
        logger.exception("sglang_sparse input guard plugin failed")
        return
    _guard_applied = True

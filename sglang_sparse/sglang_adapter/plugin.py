"""SGLang general plugin: registers ``--radix-cache-backend sparse`` (entry point target).

``pyproject.toml``::

    [project.entry-points."sglang.srt.plugins"]
    sparse = "sglang_sparse.sglang_adapter.plugin:register"

SGLang calls :func:`register` (no arguments) in every process it starts (launcher, tokenizer,
scheduler, detokenizer). It registers the backend factory and three hooks; this module imports
nothing from SGLang at top level (the heavy classes live in :mod:`.cache`, imported by the factory,
which runs only in the scheduler).

Plugin exceptions are only logged by SGLang, so :func:`register` validates nothing; all validation
happens in :func:`sparse_cache_factory`, which runs in the scheduler while it builds its cache, and
whose exceptions abort server start-up.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("sglang_sparse")

BACKEND_NAME = "sparse"
_ADDER_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class"
_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_env_vars"
)
_EXTRA_BUFFER_TARGET = "sglang.srt.arg_groups.overrides.supports_mamba_cache_extra_buffer"
_registered = False


def register() -> None:
    """Register the backend and its hooks (idempotent per process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.mem_cache.registry import register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        register_radix_cache_backend(BACKEND_NAME, sparse_cache_factory)
    except ValueError:  # already registered in this process
        pass
    HookRegistry.register(_ADDER_TARGET, _adder_class_hook, HookType.AROUND)
    HookRegistry.register(_STATE_TARGET, _internal_state_hook, HookType.AFTER)
    HookRegistry.register(_EXTRA_BUFFER_TARGET, _extra_buffer_hook, HookType.AROUND)
    _registered = True


def _extra_buffer_hook(original_fn, view, hf_config, *args, **kwargs):
    """One flag on GPUs too: SGLang resolves ``--mamba-radix-cache-strategy auto`` (the default) to
    ``extra_buffer`` when the overlap schedule is on and the model supports it, and to ``no_buffer``
    (plus ``disable_overlap_schedule``) otherwise. The ``sparse`` backend captures states by cutting
    prefill chunks, which needs ``no_buffer``, so for it the model reports no extra-buffer support
    and ``auto`` resolves to ``no_buffer``. An explicit ``extra_buffer`` is still rejected (by
    SGLang's own validation, or by :func:`sparse_cache_factory`)."""
    if getattr(view, "radix_cache_backend", None) == BACKEND_NAME:
        return False
    return original_fn(view, hf_config, *args, **kwargs)


def _adder_class_hook(original_fn, self, *args, **kwargs):
    if getattr(getattr(self, "tree_cache", None), "is_sparse", False):
        from .cache import sparse_prefill_adder_class

        return sparse_prefill_adder_class()
    return original_fn(self, *args, **kwargs)


def _internal_state_hook(result, self, state, *args, **kwargs):
    """Add ``state["sparse_cache"]`` (shows up in ``/server_info`` ``internal_states``)."""
    cache = getattr(getattr(self, "scheduler", None), "tree_cache", None)
    if getattr(cache, "is_sparse", False):
        try:
            state["sparse_cache"] = cache.sparse_stats()
        except Exception:  # noqa: BLE001 - a stats failure must not break /server_info
            logger.exception("sparse cache statistics failed")
    return result


class SparseBackendError(ValueError):
    """The server configuration cannot run the ``sparse`` backend."""


def _cost_model(ctx: Any):
    from sglang_sparse.policy import ModelCostModel

    hf = getattr(ctx.model_config, "hf_config", None)
    cfg = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf or {})
    text = cfg.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in cfg:
        cfg = {**text, "architectures": cfg.get("architectures")}
    return ModelCostModel.from_hf_config(cfg)


def sparse_cache_factory(ctx: Any):
    """Backend factory (runs in the scheduler): validate, build the policy and the cache."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import register_tree_core_backend
    from sglang.srt.runtime_context import get_memory, get_serving

    from .cache import (
        TREE_CORE_NAME,
        SparseFullComponent,
        SparseMambaComponent,
        SparseRadixCache,
        make_sparse_tree_core,
    )
    from .config import SparseConfig
    from .tree_policy import TreePolicy

    config = SparseConfig.from_env()  # SparseConfigError names the variable
    p = ctx.params
    problems = []
    if not ctx.is_hybrid_ssm:
        problems.append("the model has no recurrent (Mamba/GDN) layers; use the default backend")
    if getattr(p, "enable_mamba_extra_buffer", False):
        problems.append("needs --mamba-radix-cache-strategy no_buffer (extra_buffer is not supported)")
    if ctx.enable_hierarchical_cache:
        problems.append("--enable-hierarchical-cache is not supported")
    if ctx.disable_radix_cache or getattr(p, "disable", False):
        problems.append("--disable-radix-cache contradicts --radix-cache-backend sparse")
    if getattr(p, "page_size", 1) not in (1, None):
        problems.append(f"needs --page-size 1 (got {p.page_size})")
    if not p.chunked_prefill_size or p.chunked_prefill_size <= 0:
        problems.append("needs chunked prefill (--chunked-prefill-size N > 0): cuts are chunk ends")
    if p.enable_session_radix_cache or get_memory().enable_session_radix_cache:
        problems.append("--enable-session-radix-cache is not supported")
    if get_serving().enable_streaming_session:
        problems.append("--enable-streaming-session is not supported")
    try:
        from sglang.srt.runtime_context import get_exec

        cap = get_exec().mamba.mamba_max_states_per_path
    except Exception:  # noqa: BLE001 - older layouts: nothing to check
        cap = -1
    if cap is not None and cap >= 0:
        problems.append("leave --mamba-max-states-per-path at -1: the policy owns the state budget")
    if problems:
        raise SparseBackendError("--radix-cache-backend sparse: " + "; ".join(problems))

    from sglang_sparse.policy import get_policy

    spec = get_policy(config.policy)
    try:
        cost = _cost_model(ctx)
    except (ValueError, TypeError, KeyError) as e:
        if spec.flop_aware:
            raise SparseBackendError(
                f"--radix-cache-backend sparse: policy {spec.name!r} is FLOP-aware but the model's cost "
                f"model cannot be built ({e}); set SGLANG_SPARSE_POLICY to a non-FLOP-aware policy"
            ) from None
        cost = None
    kv_bytes = cost.kv_bytes_per_token if cost is not None else 1
    state_bytes = cost.state_bytes if cost is not None else 1
    mamba_slots = int(p.req_to_token_pool.mamba_allocator.available_size())
    kv_tokens = int(p.token_to_kv_pool_allocator.available_size())
    budget = kv_tokens * kv_bytes + mamba_slots * state_bytes
    policy = TreePolicy(
        config, budget_bytes=budget, cost=cost, kv_bytes_per_token=kv_bytes, state_bytes=state_bytes
    )

    p.component_registry_override = {
        **(p.component_registry_override or {}),
        ComponentType.MAMBA: SparseMambaComponent,
        ComponentType.FULL: SparseFullComponent,
    }
    # Component hooks only run under SGLang's Python tree core; ours is that core plus the
    # structural events the policy's mirror follows.
    try:
        register_tree_core_backend(TREE_CORE_NAME, make_sparse_tree_core)
    except ValueError:  # already registered in this process
        pass
    p.tree_core_backend = TREE_CORE_NAME

    def build(params):
        return SparseRadixCache(params, policy=policy, kv_bytes_per_token=kv_bytes, state_bytes=state_bytes)

    cache = create_unified_radix_cache(ctx, cache_class=build)
    logger.info(
        "sparse radix cache: %s; KV pool %d tokens, %d state slots, %d B/state",
        config.as_dict(),
        kv_tokens,
        mamba_slots,
        state_bytes,
    )
    return cache

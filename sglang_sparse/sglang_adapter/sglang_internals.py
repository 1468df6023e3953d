"""Every SGLang name the adapter relies on that SGLang does not publish as API, listed once.

SGLang 0.5.23 gives plugins two public surfaces: ``register_radix_cache_backend`` and
``HookRegistry``. Everything else the adapter touches -- the dotted targets its hooks wrap, the
private methods its subclasses override, the private methods and fields it calls, reads or writes
-- can move in any SGLang release without notice. They are named here, and only here:
:mod:`.plugin` registers its hooks from :data:`HOOKS`, and ``tests/test_sglang_internals.py``
resolves every entry against the installed SGLang, so an upgrade that moves one fails in CI with
its name (:func:`unresolved`), not as a hook that silently never runs or an override that no longer
overrides. The same test checks that the adapter's subclasses override no private SGLang method
that is not listed in :data:`PRIVATE`.

This module imports nothing from SGLang at import time (the plugin loads it in every SGLang
process); :func:`resolve` imports on demand.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

_HYBRID_BACKEND = "sglang.srt.layers.attention.hybrid_linear_attn_backend"
_TREE_CORE = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"
_COMPONENTS = "sglang.srt.mem_cache.unified_cache.components"


@dataclass(frozen=True)
class Internal:
    """One SGLang name: ``owner`` (a dotted module, or module + class) and ``name`` on it.

    ``use``: what the adapter does with it (``hook AROUND`` / ``hook AFTER``, ``override``, ``call``,
    ``read``, ``write``); ``where``: the adapter module that does it. ``instance``: a field that the
    owner's methods assign (``self.<name> = ...``), not a class attribute: it resolves when the
    owner's source assigns it."""

    owner: str
    name: str
    use: str
    where: str
    instance: bool = False

    @property
    def kind(self) -> str:
        """The ``HookType`` member name of a hook (``AROUND`` / ``AFTER``); ``""`` otherwise."""
        return self.use.split()[1] if self.use.startswith("hook ") else ""

    @property
    def target(self) -> str:
        """The dotted name (what ``HookRegistry.register`` takes)."""
        return f"{self.owner}.{self.name}"


def _hook(target: str, kind: str, where: str = "plugin") -> Internal:
    owner, name = target.rsplit(".", 1)
    return Internal(owner, name, f"hook {kind}", where)


#: role -> the hook target :mod:`.plugin` registers for it (AROUND / AFTER as in ``use``)
HOOKS: dict[str, Internal] = {
    "adder": _hook("sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class", "AROUND"),
    "internal_state": _hook(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
        "._add_env_vars",
        "AFTER",
    ),
    "server_args": _hook("sglang.srt.server_args.prepare_server_args", "AFTER"),
    "capture_prepare": _hook("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend", "AFTER"),
    "capture_init_new": _hook("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "AFTER"),
    "capture_metadata_gdn": _hook(
        "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.init_forward_metadata", "AFTER"
    ),
    "capture_metadata_mamba2": _hook(f"{_HYBRID_BACKEND}.Mamba2AttnBackend.init_forward_metadata", "AFTER"),
    "capture_extend": _hook(
        "sglang.srt.layers.attention.linear.gdn_backend.GDNKernelDispatcher.extend", "AROUND"
    ),
    "capture_mixer": _hook("sglang.srt.layers.attention.mamba.mamba.MambaMixer2.forward", "AROUND"),
    "capture_done": _hook(f"{_HYBRID_BACKEND}.MambaAttnBackendBase._track_mamba_state_extend", "AFTER"),
    "capture_graph": _hook(
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph",
        "AROUND",
    ),
    "track_grid": _hook("sglang.srt.runtime_context.mamba_track_grid", "AROUND"),
    "decode": _hook("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", "AFTER"),
    "track_update": _hook(
        "sglang.srt.managers.scheduler_components.batch_result_processor."
        "SchedulerBatchResultProcessor._mamba_prefix_cache_update",
        "AROUND",
    ),
    "chat": _hook(
        "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request", "AFTER"
    ),
}

#: the hooks the in-forward capture needs in the scheduler (the graph veto matters only where
#: prefill graphs run, so it is not among them)
CAPTURE_HOOKS: tuple[str, ...] = (
    "capture_prepare",
    "capture_init_new",
    "capture_metadata_gdn",
    "capture_metadata_mamba2",
    "capture_extend",
    "capture_mixer",
    "capture_done",
)


def _private(owner: str, use: str, where: str, *names: str, instance: bool = False) -> list[Internal]:
    return [Internal(owner, n, use, where, instance) for n in names]


#: the private SGLang methods and fields the adapter overrides, calls, reads or writes (hooks aside)
PRIVATE: tuple[Internal, ...] = (
    # cache.SparseTreeCore(UnifiedTreeCore): the mirror follows every node SGLang adds, splits and
    # removes; a hinted insert replays SGLang's own walk steps
    *_private(_TREE_CORE, "override", "cache", "_add_new_node", "_split_node", "_remove_leaf_from_parent"),
    *_private(
        _TREE_CORE,
        "call",
        "cache",
        "_advance_insert",
        "_inc_hit_count_and_check",
        "_touch_node",
        "_cascade_evict",
        "_evict_component_and_detach_lru",
        "_evict_host_leaf",
        "_update_evictable_leaf_sets",
    ),
    *_private(_TREE_CORE, "read", "cache", "_node_arena", instance=True),
    *_private(_TREE_CORE, "write", "cache", "_ongoing_insert_walk_state", instance=True),
    # cache.SparseMambaComponent / SparseFullComponent: the eviction walks in the policy's order
    *_private(
        f"{_COMPONENTS}.mamba.MambaComponent",
        "override",
        "cache",
        "_evict_device_start",
        "_evict_device_next_node",
        "_evict_device_end",
    ),
    *_private(f"{_COMPONENTS}.mamba.MambaComponent", "call", "cache", "_select_finished_checkpoint"),
    *_private(
        f"{_COMPONENTS}.mamba.MambaComponent",
        "write",
        "cache",
        "_evict_device_cursor",
        "_evict_device_request_cnt",
        instance=True,
    ),
    *_private(
        f"{_COMPONENTS}.full.FullComponent",
        "override",
        "cache",
        "_evict_device_start",
        "_evict_device_next_node",
        "_evict_device_end",
    ),
    *_private(f"{_COMPONENTS}.full.FullComponent", "call", "cache", "_ensure_eviction_strategy"),
    *_private(
        f"{_COMPONENTS}.full.FullComponent",
        "write",
        "cache",
        "_evict_device_last_node",
        "_evict_device_request_cnt",
        instance=True,
    ),
    # track_capture: the capture's index lists go to the device through SGLang's own copy
    *_private(
        f"{_HYBRID_BACKEND}.MambaAttnBackendBase",
        "call",
        "track_capture",
        "_track_indices_to_device",
        "_translate_mamba_indices",
    ),
    # tree_policy.chat_boundaries: the prompt of the first j messages, as SGLang builds it
    *_private(
        "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat",
        "call",
        "tree_policy",
        "_process_messages",
    ),
)


def resolve(target: str) -> Any:
    """The object named by dotted ``target``: the longest importable module prefix, then
    attributes. Raises ``ImportError`` / ``AttributeError`` naming the part that is missing."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                raise AttributeError(f"{'.'.join(parts[:i])} has no attribute {attr!r} (wanted {target})")
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {target} can be imported")


def _assigns(cls: type, name: str) -> bool:
    """Whether a method of ``cls`` or of its bases assigns ``self.<name>``."""
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]")
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            if pattern.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def problem(entry: Internal) -> str | None:
    """Why ``entry`` does not hold in the installed SGLang (``None``: it does)."""
    try:
        if entry.instance:
            owner = resolve(entry.owner)
            if not _assigns(owner, entry.name):
                where = f"({entry.use}, {entry.where})"
                return f"{entry.target} {where}: no method of {entry.owner} assigns self.{entry.name}"
            return None
        resolve(entry.target)
    except (ImportError, AttributeError) as exc:
        return f"{entry.target} ({entry.use}, {entry.where}): {exc}"
    return None


def every_entry() -> list[Internal]:
    """:data:`HOOKS` and :data:`PRIVATE`, hooks first."""
    return [*HOOKS.values(), *PRIVATE]


def unresolved(entries: list[Internal] | None = None) -> list[str]:
    """One line for each entry (default :func:`every_entry`) the installed SGLang lacks."""
    return [p for e in (every_entry() if entries is None else entries) if (p := problem(e)) is not None]

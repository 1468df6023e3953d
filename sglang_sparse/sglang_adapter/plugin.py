"""SGLang general plugin: registers ``--radix-cache-backend sparse`` (entry point target).

SGLang calls :func:`register` (no arguments; ``pyproject.toml``'s ``sglang.srt.plugins`` entry
point ``sparse``) in every process it starts (launcher, tokenizer, scheduler, detokenizer). It
registers the backend factory and the ``HookRegistry`` hooks (listed in ``docs/sparse_backend.md``,
"Running"); this module imports nothing from SGLang at top level (the heavy classes live in
:mod:`.cache` and :mod:`.capture`, imported by the factory, which runs only in the scheduler).

SGLang only logs plugin exceptions, so :func:`register` validates nothing: the launcher hook
(:func:`_server_args_hook`) fails fast, and :func:`sparse_cache_factory` re-checks everything in the
scheduler, where its exceptions abort server start-up.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from sglang_sparse.sglang_adapter.sglang_internals import CAPTURE_HOOKS, HOOKS

logger = logging.getLogger("sglang_sparse")

BACKEND_NAME = "sparse"
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
    for role, fn in _hook_handlers().items():
        HookRegistry.register(HOOKS[role].target, fn, getattr(HookType, HOOKS[role].kind))
    _registered = True


def _hook_handlers() -> dict[str, Any]:
    """role of :data:`.sglang_internals.HOOKS` (its target and ``HookType``) -> this module's hook
    function; the roles equal HOOKS' (``tests/test_sglang_internals.py``)."""
    return {
        "adder": _adder_class_hook,
        "internal_state": _internal_state_hook,
        "server_args": _server_args_hook,
        # SGLANG_SPARSE_CAPTURE=forward (sglang_sparse.sglang_adapter.capture, .track_capture); each
        # hook is a no-op unless this process built a sparse backend with in-forward capture, and
        # imports nothing until then.
        "capture_prepare": _capture_prepare_hook,
        "capture_init_new": _capture_init_new_hook,
        "capture_metadata_gdn": _capture_metadata_hook,
        "capture_metadata_mamba2": _capture_metadata_hook,
        "capture_extend": _capture_extend_hook,
        "capture_mixer": _capture_mixer_hook,
        "capture_done": _capture_done_hook,
        "capture_graph": _capture_graph_hook,
        # extra_buffer: decode-time states on the policy's grid, tracked only for requests whose
        # plan wants a state past the prompt (capture.refine_decode_tracks).
        "track_grid": _track_grid_hook,
        "decode": _prepare_for_decode_hook,
        "track_update": _track_update_hook,
        # /v1/chat/completions: message boundaries become planned states
        # (tree_policy.add_chat_boundaries).
        "chat": _chat_request_hook,
    }


#: hooks the capture needs in the scheduler (dotted targets: :data:`.sglang_internals.CAPTURE_HOOKS`)
_CAPTURE_TARGETS = tuple(HOOKS[role].target for role in CAPTURE_HOOKS)


def _chat_request_hook(result, self, request, *args, **kwargs):
    """Runs in the HTTP server process: with the sparse backend, add the chat's message boundaries
    (and the messages the request names) to the request's planned positions."""
    server_args = getattr(getattr(self, "tokenizer_manager", None), "server_args", None)
    if getattr(server_args, "radix_cache_backend", None) == BACKEND_NAME and isinstance(result, tuple):
        from .tree_policy import add_chat_boundaries

        add_chat_boundaries(self, result[0], request)
    return result


_CAPTURE_MODULE = f"{__package__}.capture"
_TRACK_MODULE = f"{__package__}.track_capture"


def _capture_module() -> Any:
    """The capture module if this process built a sparse backend (its factory imports it), else
    ``None``: the wrappers below then call SGLang's function unchanged and import nothing."""
    return sys.modules.get(_CAPTURE_MODULE)


def _track_module() -> Any:
    """The forward side of the capture if this process built a sparse backend with in-forward
    capture (:mod:`.track_capture`, imported by :mod:`.capture`), else ``None``."""
    return sys.modules.get(_TRACK_MODULE)


def _track_grid_hook(original, *args, **kwargs):
    """SGLang's decode-track grid (``lcm(checkpoint grid, --mamba-track-interval)``), replaced in a
    scheduler whose cache is the sparse backend on ``extra_buffer`` by the policy's grid: which
    grid points a request really tracks is the policy's per-request choice (capture.py)."""
    cap = _capture_module()
    grid = cap.decode_grid() if cap is not None else None
    return grid if grid is not None else original(*args, **kwargs)


def _prepare_for_decode_hook(result, self, *args, **kwargs):
    if getattr(getattr(self, "tree_cache", None), "decode_tracking", False):  # set by the factory
        _capture_module().refine_decode_tracks(self)
    return result


def _track_update_hook(original, self, *args, **kwargs):
    cap = _capture_module()
    if cap is None:
        return original(self, *args, **kwargs)
    return cap.prefix_cache_update_hook(original, self, *args, **kwargs)


def _capture_prepare_hook(result, self, *args, **kwargs):
    if getattr(getattr(self, "tree_cache", None), "capture_forward", False):
        from .capture import _prepare_for_extend_hook

        return _prepare_for_extend_hook(result, self, *args, **kwargs)
    return result


def _capture_init_new_hook(result, cls, batch, *args, **kwargs):
    cap = _capture_module()
    if cap is None:
        return result
    if getattr(batch, "sparse_capture", None) is not None:
        return cap._init_new_hook(result, cls, batch, *args, **kwargs)
    track = _track_module()
    if track is not None:
        track.set_forward_plan(None)  # this forward carries no plan
    return result


def _capture_metadata_hook(result, self, forward_batch, *args, **kwargs):
    track = _track_module()
    if track is not None and track.forward_plan() is not None:
        track.attach(self, forward_batch, track.forward_plan())
    return result


def _capture_extend_hook(original, self, *args, **kwargs):
    track = _track_module()
    if track is not None and track.forward_plan() is not None:
        return track.extend_hook(original, self, *args, **kwargs)
    return original(self, *args, **kwargs)


def _capture_mixer_hook(original, self, *args, **kwargs):
    track = _track_module()
    if track is not None and track.forward_plan() is not None:
        return track.mixer_hook(original, self, *args, **kwargs)
    return original(self, *args, **kwargs)


def _capture_done_hook(result, self, *args, **kwargs):
    track = _track_module()
    if track is not None and track.forward_plan() is not None:
        track.done_hook(result, self, *args, **kwargs)
    return result


def _capture_graph_hook(original, self, *args, **kwargs):
    track = _track_module()
    if track is not None and track.forward_plan() is not None:
        return track.graph_veto_hook(original, self, *args, **kwargs)
    return original(self, *args, **kwargs)


def _capture_hooks_applied() -> bool:
    """True when SGLang applied every capture hook of :data:`_CAPTURE_TARGETS` in this process
    (checked by the factory)."""
    import pkgutil

    for target in _CAPTURE_TARGETS:
        obj_path, attr = target.rsplit(".", 1)
        fn = pkgutil.resolve_name(obj_path).__dict__.get(attr)
        fn = getattr(fn, "__func__", fn)
        if fn is None or not hasattr(fn, "__wrapped__"):
            return False
    return True


def launcher_problems(server_args: Any) -> list[str]:
    """What makes ``server_args`` (+ the ``SGLANG_SPARSE_*`` options) unable to run the backend,
    checkable in the launcher before any subprocess starts (the factory re-checks everything)."""
    from .config import SparseConfig, SparseConfigError

    problems = []
    config = None
    try:
        config = SparseConfig.from_env()
    except SparseConfigError as e:
        problems.append(str(e))
    if getattr(server_args, "mamba_radix_cache_strategy", None) == "extra_buffer_lazy":
        problems.append(
            "--mamba-radix-cache-strategy extra_buffer_lazy is not supported (its second state slot is "
            "allocated only at SGLang's fixed track interval); use auto, extra_buffer or no_buffer"
        )
    page = getattr(server_args, "page_size", None)
    if getattr(server_args, "mamba_radix_cache_strategy", None) == "no_buffer" and page not in (None, 1):
        problems.append(
            f"--mamba-radix-cache-strategy no_buffer needs --page-size 1 (got {page}); "
            "use auto or extra_buffer for a paged KV cache"
        )
    if config is not None and page:
        problems += _grid_option_problems(config, int(page))
    if getattr(server_args, "disable_radix_cache", False):
        problems.append("--disable-radix-cache contradicts --radix-cache-backend sparse")
    return problems + unsupported_modes(server_args)


def unsupported_modes(server_args: Any) -> list[str]:
    """Serving modes the backend refuses (launcher and factory alike), one message each."""
    out = []
    algo = getattr(server_args, "speculative_algorithm", None)
    if algo:
        out.append(
            f"--speculative-algorithm {algo} is not supported yet: its verify steps accept several tokens "
            "per decode step, which the backend's decode-state tracks and finish states do not model, and "
            "it cannot be tested on the project's CPU machines; serve without it or with the default cache"
        )
    if getattr(server_args, "enable_two_batch_overlap", False):
        out.append(
            "--enable-two-batch-overlap is not supported (SGLang tracks no Mamba states under two-batch "
            "overlap: schedule_batch.py, prepare_for_extend)"
        )
    return out


def _grid_option_problems(config: Any, page: int) -> list[str]:
    """``SGLANG_SPARSE_GRID``, ``_BRANCH_GRID`` and ``_TAIL_GRID`` against ``--page-size`` (launcher
    and factory alike; against the state grid: ``config.resolve_defaults``, once the capture mode is
    resolved)."""
    out = []
    for env, value in (
        ("GRID", config.grid),
        ("BRANCH_GRID", config.branch_grid),
        ("TAIL_GRID", config.tail_grid),
    ):
        if value is not None and value % page:
            out.append(
                f"SGLANG_SPARSE_{env}={value} must be a multiple of --page-size {page} "
                "(the KV match is page-aligned)"
            )
    return out


def _server_args_hook(result, *args, **kwargs):
    """Fail fast in the launcher (SGLang only logs plugin exceptions, and a factory exception in the
    scheduler SIGKILLs the process group): a bad option or flag combination ends ``launch_server`` /
    ``sglang serve`` here, before any subprocess starts, message on stderr, exit code 2."""
    if getattr(result, "radix_cache_backend", None) == BACKEND_NAME:
        problems = launcher_problems(result)
        if problems:
            sys.stderr.write("error: --radix-cache-backend sparse: " + "; ".join(problems) + "\n")
            sys.stderr.flush()
            raise SystemExit(2)
    return result


def _adder_class_hook(original_fn, self, *args, **kwargs):
    if getattr(getattr(self, "tree_cache", None), "is_sparse", False):
        from .cache import sparse_prefill_adder_class

        if _metrics_enabled():  # Prometheus gauges (.metrics)
            from .metrics import maybe_update

            maybe_update(self.tree_cache)
        return sparse_prefill_adder_class()
    return original_fn(self, *args, **kwargs)


def _metrics_enabled() -> bool:
    """``--enable-metrics`` is on (scheduler process); False when it cannot be told."""
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:  # noqa: BLE001 - older/newer SGLang layouts: no metrics, never a failure
        return False


def _internal_state_hook(result, self, state, *args, **kwargs):
    """Add ``state["sparse_cache"]`` (this rank's statistics), ``state["sparse_cache_ranks"]`` (every
    TP rank's, in rank order: SGLang replies from TP rank 0 only) and
    ``state["sparse_cache_ranks_agree"]`` to ``/server_info``'s ``internal_states``."""
    cache = getattr(getattr(self, "scheduler", None), "tree_cache", None)
    if not getattr(cache, "is_sparse", False):
        return result
    try:
        stats = cache.sparse_stats()
    except Exception:  # noqa: BLE001 - a stats failure must not break /server_info
        logger.exception("sparse cache statistics failed")
        stats = {"error": "statistics failed (see the scheduler log)"}
    state["sparse_cache"] = stats
    try:
        ranks = gather_rank_stats(stats, _request_group())
    except Exception:  # noqa: BLE001 - never break /server_info; say why instead
        logger.exception("gathering the sparse cache statistics of every TP rank failed")
        return result
    state["sparse_cache_ranks"] = ranks
    state["sparse_cache_ranks_agree"] = ranks_disagree(ranks) == []
    return result


#: statistics every TP rank must share: the cache decisions are a function of the request stream
RANK_AGREEMENT_KEYS = (
    "states_held",
    "states_inserted",
    "states_evicted",
    "kv_leaves_evicted",
    "alpha",
    "alpha_tunes",
    "finished",
    "ckpt_admitted",
    "ckpt_rejected",
    "cuts_applied",
    "resume_tokens",
)


def ranks_disagree(ranks: list[dict]) -> list[str]:
    """The keys of :data:`RANK_AGREEMENT_KEYS` whose values differ across ``ranks``."""
    return [k for k in RANK_AGREEMENT_KEYS if len({repr(r.get(k)) for r in ranks}) > 1]


def _request_group():
    """The CPU process group of the ranks that all process a control request (so a collective
    inside its handler is matched on every one of them), or ``None`` with one rank: the whole TP
    group, or the attention-TP group when DP attention broadcasts control requests locally
    (``managers/scheduler_components/request_receiver.py``)."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    par = get_parallel()
    group = par.tp_group
    if par.attn_dp_enabled:
        local = getattr(par, "enable_dp_attention_local_control_broadcast", False)
        try:
            local = local or bool(get_exec().moe.is_ep_scale_joiner)
        except Exception:  # noqa: BLE001 - older layouts: no EP scale joiner
            pass
        if local:
            group = par.attn_tp_group
    if group is None or group.world_size <= 1:
        return None
    return group.cpu_group


def gather_rank_stats(stats: dict, group: Any) -> list[dict]:
    """Every rank's ``stats`` in rank order (``all_gather_object`` over ``group``; ``[stats]``
    when ``group`` is None). Every rank of ``group`` must call this at the same point."""
    if group is None:
        return [stats]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(out, stats, group=group)
    return out


def _prefill_kernel_has_states(server_args: Any) -> bool:
    """Whether the GDN prefill kernel SGLang will pick returns states inside an extend: all but
    the CuTe DSL kernel on SM10x (``linear/kernels/gdn_cutedsl.py``: ``h`` is None; on other GPUs
    SGLang falls back to Triton for prefill). Mamba2 models always do (their scan)."""
    name = getattr(server_args, "linear_attn_prefill_backend", None) or getattr(
        server_args, "linear_attn_backend", None
    )
    if name != "cutedsl":
        return True
    try:
        import torch

        return not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10)
    except Exception:  # noqa: BLE001 - no CUDA: SGLang refuses cutedsl itself
        return True


class SparseBackendError(ValueError):
    """The server configuration cannot run the ``sparse`` backend."""


def _cost_model(ctx: Any):
    from .model_cost import model_cost

    return model_cost(ctx.model_config.hf_config)


def engine_state_bytes(req_to_token_pool: Any) -> int | None:
    """Bytes of one recurrent state (one Mamba pool slot, all recurrent layers of this rank) as
    SGLang's device pool holds it (so its dtypes and TP sharding): the conv and temporal tensors'
    row per slot plus any side state riding on the slot, the sum ``MambaPoolHost.get_size_per_token``
    takes. ``None`` when the pool has no Mamba tensors to read (not a SGLang hybrid pool)."""
    pool = getattr(req_to_token_pool, "mamba_pool", None)
    if pool is None:
        return None
    extra: tuple = ()
    infos = getattr(pool, "get_device_pool_infos", None)
    if infos is not None:
        info = infos()[0].buffer_info
        temporal, conv, extra = info.temporal, tuple(info.conv), tuple(info.extra_checkpoint_buffers)
    else:
        cache = getattr(pool, "mamba_cache", None)
        if cache is None:
            return None
        temporal, conv = cache.temporal, tuple(cache.conv)
    # [layer, slot, ...]: one slot's row over every layer
    per_slot = sum(t[:, 0].numel() * t.element_size() for t in (temporal, *conv))
    per_slot += sum(t[0].numel() * t.element_size() for t in extra)  # [slot, ...]
    return int(per_slot)


def engine_kv_bytes_per_token(token_to_kv_pool_allocator: Any) -> int | None:
    """KV-cache bytes of one token (every full-attention layer of this rank) as SGLang's KV pool
    holds it: ``get_kv_size_bytes()`` (K + V) over the pool's rows (``size + page_size``, the padding page
    included), so ``--kv-cache-dtype`` and TP sharding are the pool's. ``None`` when the allocator
    has no such pool."""
    get = getattr(token_to_kv_pool_allocator, "get_kvcache", None)
    kv = get() if get is not None else None
    full = getattr(kv, "full_kv_pool", kv)  # HybridLinearKVPool: the full-attention layers' pool
    if full is None or not hasattr(full, "get_kv_size_bytes"):
        return None
    size = full.get_kv_size_bytes()  # (K bytes, V bytes) for MHA pools, one number for others
    total = sum(int(x) for x in size) if isinstance(size, (tuple, list)) else int(size)
    k = getattr(full, "k_buffer", None)
    if isinstance(k, (list, tuple)) and k:
        rows = int(k[0].shape[0])
    else:
        rows = int(full.size) + int(getattr(full, "page_size", 1) or 1)
    return int(round(total / rows))


def measure_load_bandwidth(device: Any, nbytes: int = 8 << 20, repeats: int = 5) -> tuple[float, bool]:
    """Host-to-device copy bandwidth (bytes/s) and whether the host buffer was pinned: the median
    of ``repeats`` timed copies of ``nbytes`` from host memory to ``device`` (one untimed warm-up
    copy first). Pinned where the device has pinned memory (CUDA); on the CPU device the copy is
    a memcpy between two host buffers. What SGLang's HiCache load-back does per byte, short of its
    io kernels and page layout."""
    import statistics
    import time

    import torch

    dev = torch.device(device)
    pinned = dev.type == "cuda" and torch.cuda.is_available()
    src = torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    dst.copy_(src, non_blocking=pinned)
    sync()
    times = []
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        sync()
        times.append(time.perf_counter() - t0)
    return int(nbytes) / max(statistics.median(times), 1e-9), pinned


def measure_device_flops(device: Any, n: int | None = None, repeats: int = 3) -> tuple[float, str]:
    """Dense FLOP/s of ``device`` and the dtype it was timed in: the median of ``repeats`` timed
    ``n x n @ n x n`` matmuls (``2 n^3`` FLOPs each; one untimed warm-up), bf16 with ``n = 4096`` on
    an accelerator, fp32 with ``n = 1024`` on the CPU. Taken with :func:`measure_load_bandwidth` (same
    device and moment), their ratio prices a host load in prefill FLOPs; a matmul's rate is an upper
    bound on prefill's, so the charge errs high by at most prefill's efficiency (~0.4-0.6 on a
    GPU)."""
    import statistics
    import time

    import torch

    dev = torch.device(device)
    accel = dev.type != "cpu"
    n = int(n or (4096 if accel else 1024))
    dtype = torch.bfloat16 if accel else torch.float32
    a = torch.randn(n, n, dtype=torch.float32).to(device=dev, dtype=dtype)
    b = torch.randn(n, n, dtype=torch.float32).to(device=dev, dtype=dtype)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    torch.matmul(a, b)
    sync()
    times = []
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / max(statistics.median(times), 1e-9), str(dtype).removeprefix("torch.")


def host_pool_sizes(host_pool_group: Any) -> dict[str, tuple[int, int]]:
    """SGLang's HiCache host pools of this rank: pool name -> (slots, bytes per slot), slots being
    tokens for a KV pool and states for the Mamba pool (``MambaPoolHost``: page size 1, one slot per
    state); bytes per slot is the pool's own ``size_per_token`` (what it allocated by)."""
    out: dict[str, tuple[int, int]] = {}
    for entry in getattr(host_pool_group, "entries", ()):
        pool = entry.host_pool
        name = getattr(entry.name, "value", entry.name)
        out[str(name)] = (int(pool.size), int(pool.size_per_token))
    return out


def host_tier_config(cache: Any, ctx: Any, config: Any, device: Any) -> Any:
    """The policy's :class:`~sglang_sparse.policy.host_tier.HostTierConfig` for SGLang's HiCache
    below ``cache`` (``None`` when SGLang attached no host pool): budget = the host pools' bytes,
    write policy ``write_back`` or (any of SGLang's write-through variants) ``write_through``, load
    bandwidth and device FLOP/s from the options or measured."""
    from sglang_sparse.policy.host_tier import HostTierConfig

    group = getattr(cache, "host_pool_group", None)
    pools = host_pool_sizes(group) if group is not None else {}
    host_bytes = sum(n * b for n, b in pools.values())
    if host_bytes <= 0:
        return None
    wp = getattr(ctx.server_args, "hicache_write_policy", None) or "write_through"
    bandwidth = config.host_bandwidth
    how = "SGLANG_SPARSE_HOST_BANDWIDTH"
    if bandwidth is None:
        bandwidth, pinned = measure_load_bandwidth(device)
        how = f"measured on {device}: median of 5 copies of 8 MiB, {'pinned' if pinned else 'pageable'}"
    flops = config.device_flops
    flops_how = "SGLANG_SPARSE_DEVICE_FLOPS"
    if flops is None:
        flops, dtype = measure_device_flops(device)
        flops_how = f"measured on {device}: median of 3 square {dtype} matmuls"
    host = HostTierConfig(
        budget_bytes=int(host_bytes),
        load_bandwidth=float(bandwidth),
        device_flops=float(flops),
        write_policy="write_back" if wp == "write_back" else "write_through",
    )
    logger.info(
        "sparse cache: HiCache host tier %d B (%s), %s; load bandwidth %.2f GB/s (%s), device %.3g FLOP/s "
        "(%s): a loaded byte costs %.3g prefill FLOPs",
        host_bytes,
        ", ".join(f"{k} {n} x {b} B" for k, (n, b) in pools.items()),
        host.write_policy,
        bandwidth / 1e9,
        how,
        host.device_flops,
        flops_how,
        host.flops_per_byte,
    )
    return host


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
    from .config import SparseConfig, SparseConfigError, resolve_capture, resolve_defaults
    from .tree_policy import TreePolicy

    config = SparseConfig.from_env()  # SparseConfigError names the variable
    p = ctx.params
    problems = []
    if not ctx.is_hybrid_ssm:
        problems.append("the model has no recurrent (Mamba/GDN) layers; use the default backend")
    extra_buffer = bool(getattr(p, "enable_mamba_extra_buffer", False))
    if extra_buffer and _lazy_extra_buffer():
        problems.append("--mamba-radix-cache-strategy extra_buffer_lazy is not supported")
    if ctx.disable_radix_cache or getattr(p, "disable", False):
        problems.append("--disable-radix-cache contradicts --radix-cache-backend sparse")
    page = int(getattr(p, "page_size", 1) or 1)
    if not extra_buffer and page != 1:
        problems.append(f"no_buffer needs --page-size 1 (got {page})")
    state_grid = _state_grid(page)
    problems += _grid_option_problems(config, page)
    if not p.chunked_prefill_size or p.chunked_prefill_size <= 0:
        problems.append("needs chunked prefill (--chunked-prefill-size N > 0): cuts are chunk ends")
    elif extra_buffer and p.chunked_prefill_size % state_grid:
        problems.append(
            f"--chunked-prefill-size {p.chunked_prefill_size} must be a multiple of the state grid "
            f"{state_grid} with extra_buffer (SGLang snapshots states only on it)"
        )
    if p.enable_session_radix_cache or get_memory().enable_session_radix_cache:
        problems.append("--enable-session-radix-cache is not supported")
    problems += unsupported_modes(ctx.server_args)
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
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        if spec.flop_aware:
            raise SparseBackendError(
                f"--radix-cache-backend sparse: policy {spec.name!r} is FLOP-aware but the model's cost "
                f"model cannot be built ({e}); set SGLANG_SPARSE_POLICY to a non-FLOP-aware policy"
            ) from None
        cost = None
    # Bytes are SGLang's (its pools as allocated); the cost model gives FLOPs only.
    kv_bytes = engine_kv_bytes_per_token(p.token_to_kv_pool_allocator)
    if kv_bytes is None:
        kv_bytes = cost.kv_bytes_per_token if cost is not None else 1
    state_bytes = engine_state_bytes(p.req_to_token_pool)
    if state_bytes is None:
        state_bytes = cost.state_bytes if cost is not None else 1
    mamba_slots = int(p.req_to_token_pool.mamba_allocator.available_size())
    kv_tokens = int(p.token_to_kv_pool_allocator.available_size())
    budget = kv_tokens * kv_bytes + mamba_slots * state_bytes
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

    cache_class = SparseRadixCache
    write_policy = getattr(ctx.server_args, "hicache_write_policy", None) or "write_through"
    capture, capture_reason = resolve_capture(
        config.capture,
        interior_states=_prefill_kernel_has_states(ctx.server_args),
        hicache_write_policy=write_policy if ctx.enable_hierarchical_cache else None,
    )
    if capture == "forward":
        from .capture import CaptureMambaComponent, CaptureRadixCache

        if not _capture_hooks_applied():
            raise SparseBackendError(
                "--radix-cache-backend sparse: SGLANG_SPARSE_CAPTURE=forward needs the plugin's capture "
                "hooks, which SGLang did not apply in the scheduler (is the 'sparse' plugin loaded?)"
            )
        p.component_registry_override[ComponentType.MAMBA] = CaptureMambaComponent
        cache_class = CaptureRadixCache

    try:  # every auto option settled (config.resolve_defaults)
        config = resolve_defaults(
            config, capture=capture, page=page, state_grid=state_grid, extra_buffer=extra_buffer
        )
    except SparseConfigError as exc:
        raise SparseBackendError(f"--radix-cache-backend sparse: {exc}") from None
    policy = TreePolicy(
        config,
        budget_bytes=budget,
        cost=cost,
        kv_bytes_per_token=kv_bytes,
        state_bytes=state_bytes,
        fit_tokens=kv_tokens,  # KV and states live in separate pools: no prefix longer than the KV pool fits
    )

    def build(params):
        return cache_class(params, policy=policy, kv_bytes_per_token=kv_bytes, state_bytes=state_bytes)

    cache = create_unified_radix_cache(ctx, cache_class=build)
    cache.capture_reason = capture_reason
    if ctx.enable_hierarchical_cache:
        kvcache = p.token_to_kv_pool_allocator.get_kvcache()
        host = host_tier_config(cache, ctx, config, getattr(kvcache, "device", "cpu"))
        if host is not None:
            policy.set_host_tier(host)
            logger.info(
                "sparse cache: two tiers scored: logical cache %d B (device %d B), host share %.2f, "
                "load cost %s",
                policy.budget_bytes,
                policy.device_bytes,
                host.host_share(policy.device_bytes),
                "on" if policy.snapshot().get("host_cost") else "off",
            )
    if extra_buffer:
        from .capture import set_decode_grid

        # Decode tracks on the policy's grid; refine_decode_tracks keeps only the rows that want one.
        set_decode_grid(config.grid)
        cache.decode_tracking = True
    overlap = not getattr(getattr(ctx, "server_args", None), "disable_overlap_schedule", True)
    logger.info(
        "sparse radix cache: %s; KV pool %d tokens, %d state slots, %d B/state; %s",
        config.as_dict(),
        kv_tokens,
        mamba_slots,
        state_bytes,
        startup_summary(extra_buffer, overlap, page, capture, config.grid, capture_reason),
    )
    return cache


def startup_summary(
    extra_buffer: bool, overlap: bool, page: int, capture: str, grid: int, reason: str = "default"
) -> str:
    """The start-up log's account of which state path the backend runs on, and why."""
    if extra_buffer:
        on = "on" if overlap else "off"
        path = (
            f"mamba strategy extra_buffer (SGLang's fast path: overlap schedule {on}, page size {page}); "
            f"SGLang snapshots one state per extend at its last {grid}-token grid point and the policy "
            f"keeps it only if planned; decode states on the {grid}-token grid are tracked only for "
            "requests whose plan wants a state past the prompt"
        )
    else:
        path = (
            "mamba strategy no_buffer (asked for: overlap schedule off, page size 1); SGLang offers the "
            "exact state at every chunk end, prompt end and finish and the policy keeps the planned ones"
        )
    how = (
        "planned positions inside a prefill are written during the forward by SGLang's track copies"
        if capture == "forward"
        else "each planned position inside a prefill ends a chunk: one more forward"
    )
    return f"{path}; capture={capture} ({reason}: {how})"


def _state_grid(page: int) -> int:
    """SGLang's state grid: ``lcm(GDN cache chunk, page)`` (``mamba_checkpoint_grid``); 64 (the
    FLA chunk) when SGLang's runtime context cannot tell (unit tests without a server)."""
    try:
        from sglang.srt.runtime_context import mamba_checkpoint_grid

        return int(mamba_checkpoint_grid(page))
    except Exception:  # noqa: BLE001 - not inside a resolved SGLang process
        import math

        from sglang_sparse.placement import DEFAULT_GRID

        return math.lcm(DEFAULT_GRID, max(int(page), 1))


def _lazy_extra_buffer() -> bool:
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().mamba.enable_mamba_extra_buffer_lazy)
    except Exception:  # noqa: BLE001 - older layouts
        return False

"""Forward side of the in-forward capture: a capture plan's states written by SGLang's own track
copies, on every device and both recurrent families (this module imports SGLang lazily).

A :class:`CapturePlan` (built by :meth:`~.capture.CaptureRadixCache.build_capture_plan` in the
scheduler, handed to its forward by the ``ForwardBatch.init_new`` hook) becomes, once per forward,
extra entries of SGLang's prefill track lists (:func:`attach`, AFTER the linear-attention backend's
``init_forward_metadata``: ``GDNAttnBackend`` and ``Mamba2AttnBackend``). The index arithmetic is
:mod:`.track_lists`; all index lists of a forward travel to the device in one non-blocking copy
(SGLang's own ``_track_indices_to_device``). SGLang's code then writes, in every recurrent layer:

* the conv state of each capture (``conv_states[mask] = x[track_conv_indices]``, before the conv);
* the SSM state: an ``h`` row of the extend kernel (SGLang's Triton GDN kernel, the project's CPU
  stand-in, FlashInfer's checkpoints when requested, Mamba2's per-chunk states), the final state at
  the extend end, or (Mamba2) the scan's exact recompute at any position.

Mamba2 layers without a track of SGLang's own in the forward (no_buffer) skip SGLang's copies;
AROUND ``MambaMixer2.forward`` (:func:`mixer_hook`) runs them for the plan.

A capture fewer than ``W - 1`` tokens after its extend start has a conv window that reaches into
the state before the extend: SGLang's gather writes its last columns, the extend hook (GDN) or the
mixer hook (Mamba2) then copies the first ones from the row's initial window, read for every layer
when the plan was attached (:func:`fix_conv`).

What SGLang's lists cannot express, a GDN position off the state grid, is a *tail*: AROUND
``GDNKernelDispatcher.extend`` (:func:`extend_hook`) the tail's slot gets the ``h`` row at the grid
point below it (or, for FlashInfer below its first checkpoint, the initial state, copied before
the kernel overwrites it) and is advanced in place by SGLang's ``fused_recurrent_gated_delta_rule
_update`` over the ``< grid`` remaining tokens (one batched launch per layer; the project's CPU
stand-in on the CPU). AFTER ``MambaAttnBackendBase._track_mamba_state_extend`` (:func:`done_hook`)
counts the layers whose copies ran: a plan is :attr:`CapturePlan.complete` once every recurrent
layer did (and ran its tails), and only a complete plan's slots are published.

Per-process state: one *forward plan* (:func:`set_forward_plan`): SGLang builds a forward's
``ForwardBatch`` (``init_new``) right before running it, in one thread, with or without the overlap
schedule, so the plan of forward N is never seen by forward N+1 (the next ``init_new`` replaces or
clears it). A full prefill CUDA graph replays fixed-size track buffers, so a forward that carries a
plan never replays one (:func:`graph_veto_hook`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .track_lists import Layout, TrackAdditions, track_additions

logger = logging.getLogger("sglang_sparse")


@dataclass
class ForwardLists:
    """The device tensors of one forward's tails (the other captures are in SGLang's lists).

    ``pre_src`` / ``pre_dst``: working slots copied into tail slots before the kernel (FlashInfer
    tails below the first checkpoint); ``tail_h_src`` / ``tail_h_dst``: ``h`` rows copied into tail
    slots after it; ``tail_dst`` / ``tail_tokens`` / ``tail_cu``: the recurrence over the tails'
    tokens (CSR), in place on ``tail_dst``. All physical slots; ``None`` when empty."""

    metadata: Any
    req_to_token_pool: Any
    #: the backend, and whether SGLang's forward skips its track copies (Mamba2 without SGLang's
    #: own tracks: ``Mamba2AttnBackend.forward`` copies only when ``mamba_track_mask`` is set)
    backend: Any = None
    copy_ourselves: bool = False
    pre_src: torch.Tensor | None = None
    pre_dst: torch.Tensor | None = None
    tail_h_src: torch.Tensor | None = None
    tail_h_dst: torch.Tensor | None = None
    tail_dst: torch.Tensor | None = None
    tail_tokens: torch.Tensor | None = None
    tail_cu: torch.Tensor | None = None
    #: conv fixes (captures within ``W - 1`` tokens of their extend start): slots ``[F]``, the
    #: columns to take from the initial window ``[F, 1, W - 1]`` (bool) and those columns, shifted
    #: into place, per pool layer ``[L, F, D, W - 1]``, read before any layer ran; the pool layer of
    #: a layer's conv tensor by its storage address
    fix_dst: torch.Tensor | None = None
    fix_mask: torch.Tensor | None = None
    fix_cols: torch.Tensor | None = None
    fix_layer_of: dict[int, int] = field(default_factory=dict)

    def pool(self, layer_id: int) -> torch.Tensor:
        """The SSM state pool of ``layer_id`` (the pool itself, never a gathered copy)."""
        return self.req_to_token_pool.mamba2_layer_cache(layer_id).temporal


@dataclass
class CapturePlan:
    """Captures of one extend forward, sorted by (row, offset).

    ``rows[j]``: batch row (index into ``ScheduleBatch.reqs``; prefill rows come first);
    ``offsets[j]``: tokens of that row's extend before the captured state
    (``conv_len <= offset <= extend_len``); ``slots[j]``: virtual Mamba pool slot (allocator id).
    ``geometry``: ``row -> (prefix_len, extend_len)`` as the scheduler built the extend (a forward
    whose rows differ is not this plan's). ``n_layers``: recurrent layers of the model; ``stats``:
    the cache's counters (tails, graph vetoes). The plan is :attr:`complete` once every recurrent
    layer's track copies ran with its entries (and, with tails, every layer's tails ran)."""

    rows: list[int]
    offsets: list[int]
    slots: list[int]
    geometry: dict[int, tuple[int, int]]
    n_layers: int
    stats: dict[str, Any] = field(default_factory=dict)
    lists: ForwardLists | None = None
    n_tails: int = 0
    n_conv_fixes: int = 0
    copies_done: int = 0
    tail_layers: set[int] = field(default_factory=set)
    fix_layers: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return (
            self.lists is not None
            and self.copies_done >= self.n_layers
            and (self.n_tails == 0 or len(self.tail_layers) >= self.n_layers)
            and (self.n_conv_fixes == 0 or len(self.fix_layers) >= self.n_layers)
        )

    @property
    def started(self) -> bool:
        """Its forward has begun: its entries are in a forward's track lists."""
        return self.lists is not None

    def remove(self, slot: int) -> None:
        """Take ``slot``'s capture out of a plan whose forward has not begun (its copies will not
        write the slot, which goes back to the allocator)."""
        assert not self.started, "a started plan's slots are written by its forward"
        j = self.slots.index(int(slot))
        del self.rows[j], self.offsets[j], self.slots[j]


# ---------------------------------------------------------------------- the forward plan

_FORWARD_PLAN: list[CapturePlan | None] = [None]


def set_forward_plan(plan: CapturePlan | None) -> None:
    _FORWARD_PLAN[0] = plan


def forward_plan() -> CapturePlan | None:
    return _FORWARD_PLAN[0]


# ---------------------------------------------------------------------- kernel layouts


def kernel_layout(backend: Any) -> tuple[Layout, int]:
    """Where the extend kernel of ``backend`` (a linear-attention backend) returns its per-chunk
    states, and their grid in tokens (:class:`~.track_lists.Layout`)."""
    chunk = int(backend.mamba_chunk_size)
    if any(c.__name__ == "Mamba2AttnBackend" for c in type(backend).__mro__):
        return Layout.FLAT, chunk
    kernel = getattr(getattr(backend, "kernel_dispatcher", None), "extend_kernel", None)
    if getattr(kernel, "uses_state_checkpoints", False):  # FlashInfer's GDN prefill
        from sglang.srt.runtime_context import mamba_cache_chunk_size

        return Layout.CHECKPOINTS, int(mamba_cache_chunk_size())
    if getattr(kernel, "supports_track_state_snapshot", False) or type(kernel).__name__ == "CuteDSLGDNKernel":
        # one fp32 snapshot per row (KDA kernels), or no per-chunk states at all (CuTe DSL)
        return Layout.NONE, chunk
    return Layout.CHUNKS, chunk


def _plain_extend(mode: Any) -> bool:
    return bool(
        (mode.is_extend() or mode.is_mixed())
        and not mode.is_target_verify()
        and not mode.is_draft_extend_v2()
    )


# ---------------------------------------------------------------------- attach (once per forward)


def attach(
    backend: Any, forward_batch: Any, plan: CapturePlan, layout: tuple[Layout, int] | None = None
) -> bool:
    """Append ``plan``'s captures to the track lists of ``backend.forward_metadata`` (built by
    SGLang's ``init_forward_metadata`` for ``forward_batch``); False (nothing changed) when the
    forward is not the plan's: not a plain extend, MIS, or rows whose prefix/extend lengths differ
    from the plan's geometry. ``layout``: the extend kernel's (:func:`kernel_layout` by default).
    Idempotent per metadata object."""
    md = backend.forward_metadata
    if plan.lists is not None and plan.lists.metadata is md:
        return True
    if not plan.slots or not _plain_extend(forward_batch.forward_mode):
        return False
    if getattr(backend, "mis_metadata", None) is not None:
        return False
    prefix, lens = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    if prefix is None or lens is None:
        return False
    prefix, lens = [int(x) for x in prefix], [int(x) for x in lens]
    for row, (p, n) in plan.geometry.items():
        if row >= len(lens) or prefix[row] != p or lens[row] != n:
            return False
    layout, grid = kernel_layout(backend) if layout is None else layout
    conv_len = int(backend.conv_states_shape[-1])
    starts = [0] * len(lens)
    for i in range(1, len(lens)):
        starts[i] = starts[i - 1] + lens[i - 1]
    try:
        adds = track_additions(
            plan.rows, plan.offsets, plan.slots, starts, lens, conv_len=conv_len, layout=layout, grid=grid
        )
    except ValueError as e:  # a plan the scheduler should not have built: never write a slot
        logger.error("sparse capture: plan not attached (%s)", e)
        return False
    plan.lists = _merge(backend, md, adds, conv_len, layout, grid)
    if adds.conv_fix_dst:
        _conv_fixes(backend, plan.lists, adds, [prefix[n] > 0 for n in adds.conv_fix_rows])
    plan.lists.backend = backend
    plan.lists.copy_ourselves = (
        layout is Layout.FLAT and getattr(forward_batch, "mamba_track_mask", None) is None
    )
    plan.n_tails = adds.n_tails
    plan.n_conv_fixes = len(adds.conv_fix_dst)
    st = plan.stats
    if st:
        st["capture_tails"] = st.get("capture_tails", 0) + adds.n_tails
        st["capture_conv_fixes"] = st.get("capture_conv_fixes", 0) + len(adds.conv_fix_dst)
        st["capture_layout"] = layout.value
    return True


def _merge(
    backend: Any, md: Any, adds: TrackAdditions, conv_len: int, layout: Layout, grid: int
) -> ForwardLists:
    """Put ``adds`` on the device (one copy) and into ``md``'s track lists; returns the tails."""
    slot_lists = (adds.conv_dst, adds.h_dst, adds.final_dst, adds.recompute_dst, adds.pre_dst, adds.tail_dst)
    row_lists = (adds.final_rows, adds.recompute_rows, adds.pre_rows)
    tail_h = [j for j, s in enumerate(adds.tail_src) if s >= 0]
    index_lists = (
        [x for w in adds.conv_idx for x in w],
        adds.h_src,
        adds.recompute_end_locs,
        [adds.tail_src[j] for j in tail_h],
        tail_h,
        adds.tail_tokens,
        adds.tail_cu,
    )
    from .track_lists import checkpoint_cu_starts

    ckpt_cu = checkpoint_cu_starts(adds.checkpoint_counts) if adds.checkpoint_counts is not None else []
    flat: list[int] = [x for lst in (*slot_lists, *row_lists, *index_lists, ckpt_cu) for x in lst]
    dev = backend._track_indices_to_device(flat) if flat else None  # int64, pinned, non-blocking
    parts = iter(_split(dev, [len(x) for x in (*slot_lists, *row_lists, *index_lists, ckpt_cu)]))
    n_slots = sum(len(x) for x in slot_lists)
    slots_virtual = [next(parts) for _ in slot_lists]
    if n_slots:
        physical = backend._translate_mamba_indices(torch.cat(slots_virtual)).to(torch.int64)
        slots_phys = _split(physical, [len(x) for x in slot_lists])
    else:
        slots_phys = slots_virtual
    conv_dst, h_dst, final_dst, recompute_dst, pre_dst, tail_dst = slots_phys
    final_rows, recompute_rows, pre_rows = (next(parts) for _ in row_lists)
    conv_flat, h_src, end_locs, tail_h_src, tail_h_pos, tail_tokens, tail_cu = (
        next(parts) for _ in index_lists
    )
    ckpt = next(parts)

    working = md.mamba_cache_indices
    if conv_len > 0 and conv_dst.numel():
        idx = conv_flat.view(-1, conv_len)
        md.track_conv_indices = _cat(md.track_conv_indices, idx)
        md.conv_states_mask_indices = _cat(md.conv_states_mask_indices, conv_dst)
    md.track_ssm_h_src = _cat(md.track_ssm_h_src, h_src)
    md.track_ssm_h_dst = _cat(md.track_ssm_h_dst, h_dst)
    md.track_ssm_final_src = _cat(md.track_ssm_final_src, working.index_select(0, final_rows).to(torch.int64))
    md.track_ssm_final_dst = _cat(md.track_ssm_final_dst, final_dst)
    if layout is Layout.FLAT and recompute_dst.numel():
        md.track_ssm_seq_idx = _cat(md.track_ssm_seq_idx, recompute_rows)
        md.track_ssm_end_locs = _cat(md.track_ssm_end_locs, end_locs)
        md.track_ssm_recompute_dst = _cat(md.track_ssm_recompute_dst, recompute_dst)
    if ckpt.numel() and not getattr(md, "num_state_checkpoints", 0):
        # FlashInfer writes checkpoints only when asked: the layout SGLang's own plan uses
        # (maybe_build_flashinfer_checkpoint_plan), every `grid` tokens of every row.
        md.state_checkpoint_cu_starts = ckpt
        md.num_state_checkpoints = int(ckpt_cu[-1])
        md.state_checkpoint_every_n_tokens = grid
    elif ckpt.numel() and int(md.state_checkpoint_every_n_tokens) != grid:
        raise RuntimeError(
            f"FlashInfer checkpoints every {md.state_checkpoint_every_n_tokens} tokens, captures need {grid}"
        )
    md.has_mamba_track_mask = True
    lists = ForwardLists(metadata=md, req_to_token_pool=backend.req_to_token_pool)
    if pre_dst.numel():
        lists.pre_src = working.index_select(0, pre_rows).to(torch.int64)
        lists.pre_dst = pre_dst
    if tail_dst.numel():
        lists.tail_dst = tail_dst
        lists.tail_tokens = tail_tokens
        lists.tail_cu = tail_cu
        if tail_h_src.numel():
            lists.tail_h_src = tail_h_src
            lists.tail_h_dst = tail_dst.index_select(0, tail_h_pos)
    return lists


def _conv_fixes(backend: Any, lists: ForwardLists, adds: TrackAdditions, has_prefix: list[bool]) -> None:
    """The conv fixes of a forward (see :class:`ForwardLists`): columns ``r ..`` of each row's
    initial conv window (zeros for a row without a prefix, as SGLang's conv kernel takes it), read
    now, before any layer's conv overwrites the working slots, for every pool layer at once."""
    stack = backend.req_to_token_pool.mamba_pool.mamba_cache.conv[0]  # [L, S, D, W - 1]
    width = int(stack.shape[-1])
    dev = stack.device
    rows = torch.tensor(adds.conv_fix_rows, dtype=torch.int64, device=dev)
    working = lists.metadata.mamba_cache_indices.to(torch.int64).index_select(0, rows)
    init = stack.index_select(1, working)  # [L, F, D, W - 1]
    keep = torch.tensor(has_prefix, dtype=torch.bool, device=dev)
    init = init * keep.view(1, -1, 1, 1).to(init.dtype)
    r = torch.tensor(adds.conv_fix_offsets, dtype=torch.int64, device=dev)
    cols = torch.arange(width, device=dev)
    src = (cols.view(1, -1) + r.view(-1, 1)).clamp(max=width - 1)  # [F, W - 1]: column c <- c + r
    shifted = init.gather(-1, src.view(1, len(adds.conv_fix_rows), 1, width).expand_as(init))
    lists.fix_mask = (cols.view(1, -1) < (width - r).view(-1, 1)).unsqueeze(1)  # [F, 1, W - 1]
    lists.fix_cols = shifted
    lists.fix_dst = backend._translate_mamba_indices(
        torch.tensor(adds.conv_fix_dst, dtype=torch.int64, device=dev)
    ).to(torch.int64)
    lists.fix_layer_of = {int(stack[i].data_ptr()): i for i in range(stack.shape[0])}


def fix_conv(lists: ForwardLists, conv: torch.Tensor) -> int | None:
    """Apply the conv fixes to one layer's conv pool ``conv`` after SGLang's gather wrote the
    captures' windows; returns its pool layer (None: no fixes, or not a pool layer)."""
    if lists.fix_dst is None:
        return None
    layer = lists.fix_layer_of.get(int(conv.data_ptr()))
    if layer is None:
        return None
    cur = conv[lists.fix_dst]
    conv[lists.fix_dst] = torch.where(lists.fix_mask, lists.fix_cols[layer].to(cur.dtype), cur)
    return layer


def _split(t: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor]:
    if t is None:
        return [torch.empty(0, dtype=torch.int64) for _ in sizes]
    return list(torch.split(t, sizes))


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    if old is None:
        return new
    if new.numel() == 0:
        return old
    return torch.cat([old, new.to(device=old.device, dtype=old.dtype)])


# ---------------------------------------------------------------------- per-layer hooks


def metadata_hook(result: Any, self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``GDNAttnBackend.init_forward_metadata`` / ``Mamba2AttnBackend.init_forward_metadata``."""
    plan = forward_plan()
    if plan is not None:
        attach(self, forward_batch, plan)
    return result


def tail_kernel(device: torch.device) -> Any:
    """SGLang's ``fused_recurrent_gated_delta_rule_update`` for tensors on ``device`` (the
    project's CPU stand-in, ``sgl_kernel.mamba``, for CPU tensors)."""
    if device.type == "cpu":
        from sgl_kernel.mamba import fused_recurrent_gated_delta_rule_update_cpu

        return fused_recurrent_gated_delta_rule_update_cpu
    from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_gated_delta_rule_update

    return fused_recurrent_gated_delta_rule_update


def extend_hook(original: Any, self: Any, q, k, v, g, beta, **kwargs: Any) -> Any:
    """AROUND ``GDNKernelDispatcher.extend``: the tails of the forward plan around SGLang's kernel."""
    plan = forward_plan()
    lists = None if plan is None else plan.lists
    layer_id = kwargs.get("layer_id")
    if lists is None or layer_id is None:
        return original(self, q, k, v, g, beta, **kwargs)
    if lists.fix_dst is not None:  # SGLang's conv gather of this layer ran before its extend
        layer = fix_conv(lists, lists.req_to_token_pool.mamba2_layer_cache(int(layer_id)).conv[0])
        if layer is not None:
            plan.fix_layers.add(layer)
    if lists.tail_dst is None and lists.pre_dst is None:
        return original(self, q, k, v, g, beta, **kwargs)
    pool = lists.pool(int(layer_id))
    if lists.pre_dst is not None:  # before the kernel overwrites the working slots
        pool[lists.pre_dst] = pool[lists.pre_src]
    out = original(self, q, k, v, g, beta, **kwargs)
    if lists.tail_h_dst is not None:
        h = out[2]
        if h is None:
            raise RuntimeError("sparse capture: the GDN extend kernel returned no per-chunk states")
        pool[lists.tail_h_dst] = h.squeeze(0)[lists.tail_h_src].to(pool.dtype)
    tok = lists.tail_tokens
    tail_kernel(q.device)(
        q=q[:, tok],
        k=k[:, tok],
        v=v[:, tok],
        g=g[:, tok],
        beta=beta[:, tok],
        initial_state_source=pool,
        initial_state_indices=lists.tail_dst,
        cu_seqlens=lists.tail_cu,
        use_qk_l2norm_in_kernel=True,
        disable_output_calculation=True,
    )
    plan.tail_layers.add(int(layer_id))
    return out


def mixer_hook(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``MambaMixer2.forward`` (keyword arguments): where SGLang's ``Mamba2AttnBackend
    .forward`` skips the track copies (no track of its own this forward: no_buffer), run SGLang's
    ``_track_mamba_state_extend`` on the mixer's per-chunk and recomputed states for the plan."""
    out = original(self, *args, **kwargs)
    plan = forward_plan()
    lists = None if plan is None else plan.lists
    md = kwargs.get("metadata")
    if lists is not None and lists.metadata is md and lists.fix_dst is not None:
        layer = fix_conv(lists, kwargs["layer_cache"].conv[0])
        if layer is not None:
            plan.fix_layers.add(layer)
    if lists is not None and lists.copy_ourselves and lists.metadata is md and out[1] is not None:
        base = next(c for c in type(lists.backend).__mro__ if c.__name__ == "MambaAttnBackendBase")
        base._track_mamba_state_extend(
            lists.backend, None, out[1], kwargs["layer_cache"].temporal, md, track_states=out[2]
        )
    return out


def done_hook(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``MambaAttnBackendBase._track_mamba_state_extend(forward_batch, h, ssm_states,
    forward_metadata, ...)``: one recurrent layer's track copies (ours included) ran; the last one
    completes the plan."""
    plan = forward_plan()
    md = kwargs.get("forward_metadata", args[3] if len(args) > 3 else None)
    if plan is not None and plan.lists is not None and plan.lists.metadata is md:
        plan.copies_done += 1
        if plan.complete:
            set_forward_plan(None)  # every layer wrote it: nothing later may write these slots
    return result


def graph_veto_hook(original: Any, self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``PrefillCudaGraphRunner.can_run_graph``: a full prefill graph replays the track
    buffers it captured (fixed sizes), so a forward that carries captures runs eagerly."""
    plan = forward_plan()
    if plan is not None and plan.slots and _full_prefill_graph(self):
        if plan.stats is not None:
            plan.stats["capture_graph_vetoes"] = plan.stats.get("capture_graph_vetoes", 0) + 1
        return False
    return original(self, forward_batch, *args, **kwargs)


def _full_prefill_graph(runner: Any) -> bool:
    from sglang.srt.model_executor.cuda_graph_config import Backend

    return getattr(runner, "prefill_backend_name", None) == Backend.FULL

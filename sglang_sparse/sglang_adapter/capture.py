"""In-forward state capture of the ``sparse`` backend (``SGLANG_SPARSE_CAPTURE=forward``).

With ``cut`` (the default path of :mod:`.cache`) every planned position strictly inside a prefill
extend ends the chunk there (one more forward, a closed batch) and SGLang's ``no_buffer`` strategy
checkpoints the live state at the chunk end. With ``forward`` the extend is not cut: the states at
those positions are written *during* the forward into Mamba pool slots reserved for them, and the
next checkpoint of the request publishes them into the tree, in increasing position order, before
its own (chunk-end / prompt-end / final) state. Chunk ends, prompt ends and finishes are still
no_buffer's own checkpoints.

Data flow (one scheduler step, no overlap schedule, page size 1 -- both required by no_buffer):

1. ``ScheduleBatch.prepare_for_extend`` (AFTER hook, :func:`_prepare_for_extend_hook`):
   :meth:`CaptureRadixCache.build_capture_plan` turns each request's planned positions ``p`` with
   ``prefix_len < p < extend_end`` into ``(row, p - prefix_len, slot)``, allocating one pool slot per
   capture (evicting tree states if the pool is short, else dropping the deepest captures of the
   batch: deterministic, a pure function of the batch and the pool). The slots are *pending*
   (``cache._capture_pending[rid]``), owned by the cache until published or freed.
2. ``ForwardBatch.init_new`` (AFTER hook): the plan is popped from the ScheduleBatch and becomes
   the process's *forward plan* (the hand-offs below) for exactly this forward (SGLang's eager
   runner copies the ForwardBatch, so the plan cannot ride on it as an attribute).
3. ``GDNAttnBackend._convolve_prefill`` (AROUND): before the conv kernel overwrites the working
   slots, the conv state at every capture (the last ``W - 1`` pre-conv inputs, spliced from the
   initial window when the offset is ``< W - 1``) goes to the capture slots
   (:func:`~sglang_sparse_kernels.sgl_kernel_cpu.conv.capture_conv_states`).
4. ``GDNKernelDispatcher.extend`` (AROUND): the list-capture form of the CPU GDN prefill op writes
   the SSM state at every capture offset into the same slots, in the pool's layout and dtype
   (:func:`~sglang_sparse_kernels.sgl_kernel_cpu.delta_rule.chunk_gated_delta_rule`).
5. The request's next ``checkpoint`` (:meth:`CaptureRadixCache.checkpoint`) publishes the pending
   slots with ``checkpoint_into_tree(req, up_to=p)``; :class:`CaptureMambaComponent` hands the
   pre-filled slot to the insert (no allocation, no copy). A slot whose node already holds a state
   is freed by SGLang's own cleanup (``mamba_exist``).

Invariants:

* every pending slot is either published into the tree or returned to the allocator: at the
  next checkpoint, at ``on_release`` (finish, abort, retraction), at ``reset`` (flush), or when
  one of SGLang's own allocations finds the pool short after its eviction
  (:meth:`CaptureRadixCache.evict_for_alloc`: SGLang budgets the pool per running request and
  does not count capture slots); so at idle every Mamba slot is free or held by the tree
  (SGLang's idle checker holds);
* a slot is published only if *every* GDN layer wrote both its conv and SSM state in the forward
  (``CapturePlan.complete``); otherwise it is freed (``capture_incomplete``), never published with
  a stale state;
* capture slots never equal a working slot of the batch (they come from the allocator), so the
  kernels never overwrite an input state.

Only the CPU path (the project's pure-torch ``sgl_kernel`` shim) implements steps 3-4; GPU kernels
(Triton/FlashInfer list capture) are Step 2, and the factory refuses ``forward`` elsewhere.

Per-process hand-offs
---------------------

Per-process hand-offs of an in-forward capture plan (no SGLang import; the plugin's thin hook
wrappers consult them on every call).

* The *forward plan*: set by the ``ForwardBatch.init_new`` hook for the forward being built (cleared
  by the next ``init_new`` without a plan, or once every GDN layer wrote it). It cannot ride on the
  ForwardBatch: SGLang's eager runner (``EagerRunner.load_batch``) copies the live batch into its
  static buffers, a new object without our attribute. A batch's ``init_new`` is followed by its own
  forward before the next ``init_new``, with or without the overlap schedule: SGLang's overlap loop
  is single-threaded (``run_batch`` builds the ForwardBatch and launches every layer of forward N,
  then processes the result of N-1), so the plan of forward N is never seen by N+1.
* :class:`Active`: layers run one at a time in the scheduler's forward thread, so one slot suffices:
  the conv hook of layer ``L`` sets it, the kernel hook of the same layer consumes it.
* The *decode grid* (``extra_buffer`` only): set once by the backend factory in the scheduler
  process; SGLang's ``mamba_track_grid`` returns it instead of ``lcm(grid, --mamba-track-interval)``
  so decode states can be tracked on the policy's grid (which rows track is the policy's choice).

Decode-time state tracks (:func:`refine_decode_tracks`)
-------------------------------------------------------

SGLang snapshots a decoding request's recurrent state into its ping-pong buffer whenever its length
crosses ``mamba_track_grid`` (``lcm(state grid, --mamba-track-interval)``, 256 tokens by default),
for every request, and at finish inserts the latest snapshot that fits the key. With the sparse
backend the grid is the policy's (the plugin's hook on ``mamba_track_grid``), and after
``ScheduleBatch.prepare_for_decode`` built the per-row masks, :func:`refine_decode_tracks`

* clears them for the requests whose plan wants no state past the prompt (no copy is made);
* for the others keeps every grid point, and for those whose plan holds a *normal* (not probation)
  state past the prompt (a session's next turn is expected: ``TreePolicy.wants_exact_finish``)
  adds one **exact finish track**: the step whose state covers ``final_track_depth`` tokens, the
  deepest page-aligned depth of the key SGLang inserts when the request finishes at
  ``max_new_tokens`` (``prompt + max_new_tokens - 1``: the last sampled token is never fed). A
  request that runs to its length (every benchmark client's default, ``ignore_eos``) then leaves
  the state at the end of its key instead of up to one grid step (64 tokens) below it, so the next
  turn of a conversation resumes where this one ended. One state copy per request, in the forward
  SGLang runs anyway. A request that stops earlier (EOS, stop string, abort) never reaches that
  step and finishes on its last grid point, as before. A request whose only state past the prompt
  is the unplanned last token (on probation) gets no exact copy: its grid finish is often dominated
  by a prompt state and not inserted at all, while an exact one would be, and under pool pressure
  it would push out other requests' first-sight states (``test_interleaved_groups.py``).

Off-grid tracks reuse SGLang's ping-pong bookkeeping unchanged (the result processor names the
snapshot ``mamba_last_track_seqlen = kv_committed_len - lookahead`` from the mask); the one place
that assumes grid alignment, the assertion in ``_mamba_prefix_cache_update``'s known-boundary
branch, is bypassed for off-grid depths by :func:`prefix_cache_update_hook`, which performs the
same slot flip.

Invariant: a row's mask (this step) and next-mask (the step after, read by the overlap scheduler
when it processes a result one step late) agree: the next-mask at depth ``d - 1`` is set exactly
when the mask at ``d`` will be, and a request's choice never changes while it decodes (its plan and
``max_new_tokens`` are fixed at admission), so the result processor's view of a boundary always
matches what the forward did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import SparseMambaComponent, SparseRadixCache, key_length

logger = logging.getLogger("sglang_sparse")


@dataclass
class CapturePlan:
    """Captures of one extend forward, sorted by (row, offset).

    ``rows[j]``: batch row (index into ``ScheduleBatch.reqs``, prefill rows come first);
    ``offsets[j]``: tokens of that row's extend before the captured state (``0 < offset < extend_len``);
    ``slots[j]``: virtual Mamba pool slot (allocator id). ``n_layers``: GDN layers of the model; the
    plan is ``complete`` once every one of them wrote conv and SSM states."""

    rows: list[int]
    offsets: list[int]
    slots: list[int]
    n_layers: int
    conv_layers: set[int] = field(default_factory=set)
    ssm_layers: set[int] = field(default_factory=set)
    _csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def complete(self) -> bool:
        return len(self.conv_layers) == len(self.ssm_layers) == self.n_layers

    @property
    def started(self) -> bool:
        """Its forward has begun (a GDN layer wrote, or the kernels' index tensors exist)."""
        return bool(self.conv_layers or self.ssm_layers) or self._csr is not None

    def remove(self, slot: int) -> None:
        """Take ``slot``'s capture out of a plan whose forward has not begun (its kernels will not
        write the slot, which goes back to the allocator)."""
        assert not self.started, "a started plan's slots are written by its forward"
        j = self.slots.index(int(slot))
        del self.rows[j], self.offsets[j], self.slots[j]

    def csr(self, n_seq: int, translate: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cu [n_seq + 1], offsets [P], physical slots [P])`` int64 CPU tensors (built once)."""
        if self._csr is None:
            counts = [0] * n_seq
            for r in self.rows:
                counts[r] += 1
            cu = torch.zeros(n_seq + 1, dtype=torch.int64)
            cu[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
            slots = torch.tensor(self.slots, dtype=torch.int64)
            if translate is not None:
                slots = translate(slots).to(torch.int64).reshape(-1)
            self._csr = (cu, torch.tensor(self.offsets, dtype=torch.int64), slots)
        return self._csr


@dataclass
class _Pending:
    """A reserved slot awaiting publication: absolute position, slot tensor ``[1]``, its plan."""

    position: int
    slot: torch.Tensor
    plan: CapturePlan


class _MidRequest:
    """A request as SGLang's insert (``checkpoint_into_tree``) should see it while it publishes a
    captured state: not finished (``req.finished()`` picks a mid-request checkpoint over the final
    insert there). Every other attribute is the request's own, read and written through."""

    __slots__ = ("_req",)

    def __init__(self, req: Any) -> None:
        object.__setattr__(self, "_req", req)

    def finished(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._req, name, value)


class CaptureMambaComponent(SparseMambaComponent):
    """While the cache publishes a captured state, hand the pre-filled slot to the insert."""

    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        pub = getattr(self.cache, "_capture_publishing", None)
        if pub is not None:
            insert_params.mamba_value = pub.slot
            return pub.position
        return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)


class CaptureRadixCache(SparseRadixCache):
    """:class:`SparseRadixCache` with in-forward capture: no voluntary cuts, capture plans per
    extend, publication at the next checkpoint, and no slot leak (see the module docstring)."""

    capture_forward = True

    def __init__(self, params, **kwargs: Any) -> None:
        self._capture_pending: dict[str, list[_Pending]] = {}
        self._capture_publishing: _Pending | None = None
        self.capture_stats = {
            "captures_planned": 0,  # planned interior positions seen by build_capture_plan
            "captures_reserved": 0,  # slots reserved (planned minus dropped)
            "captures_dropped": 0,  # no slot even after eviction
            "captures_published": 0,  # handed to the tree (incl. duplicates freed by SGLang)
            "captures_rejected": 0,  # admission said no at publish time
            "captures_freed": 0,  # freed unpublished (abort, retraction, flush, not reached)
            "captures_incomplete": 0,  # freed: not every layer wrote the slot
            "captures_reclaimed": 0,  # freed unpublished: SGLang's own allocation needed the slot
            "capture_forwards": 0,  # forwards that carried a plan
        }
        super().__init__(params, **kwargs)
        self._n_gdn_layers = int(self.req_to_token_pool.mamba_pool.mamba_cache.temporal.shape[0])

    # ------------------------------------------------------------------ planning

    def next_cut(self, req, prefix_len: int) -> int | None:
        """No voluntary cut: interior positions are captured in the forward."""
        return None

    def planned_positions(self, req) -> tuple[int, ...]:
        """The request's planned capture positions (absolute token counts, increasing)."""
        plan = self.policy.get_plan(req.rid)
        return () if plan is None else tuple(sorted(plan.positions))

    def build_capture_plan(self, batch) -> CapturePlan | None:
        """Reserve one slot per planned position each row's extend computes and SGLang does not
        snapshot itself (step 1): ``prefix_len < p < extend_end`` with no_buffer (its checkpoint
        copies the live state at ``extend_end``); with extra_buffer also ``p == extend_end``, except
        the one grid point SGLang's own track takes in this extend (``mamba_last_track_seqlen``,
        offered to admission at the next checkpoint like a no_buffer chunk end)."""
        want: list[tuple[int, int, int]] = []  # (row, offset, absolute position)
        decoding = getattr(batch, "decoding_reqs", None) or ()
        extra = self.enable_mamba_extra_buffer
        tracked = getattr(batch, "mamba_prefill_track_mask_cpu", None) if extra else None
        for row, req in enumerate(batch.reqs):
            if req in decoding or getattr(req, "skip_radix_cache_insert", False):
                continue
            if not self.policy.has_plan(req.rid):
                continue
            lo, hi = int(req.prefix_len), int(req.extend_end)
            own = None  # SGLang's own snapshot in this extend (extra_buffer)
            if tracked is not None and row < len(tracked) and tracked[row]:
                own = req.kv.mamba_last_track_seqlen
            for p in self.planned_positions(req):
                if lo < p < hi or (extra and p == hi):
                    if p != own and p % self.page_size == 0:
                        want.append((row, p - lo, p))
        if not want:
            return None
        self.capture_stats["captures_planned"] += len(want)
        alloc = self.req_to_token_pool.mamba_allocator
        # Keep one slot per row for the chunk-end / prompt-end checkpoint of this step.
        reserve = len(batch.reqs)
        short = len(want) + reserve - int(alloc.available_size())
        if short > 0:
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            # A plan never evicts its own earlier states to store later ones: the deepest
            # captures are dropped instead (below) if nothing else can go.
            own = self.policy.own_states(batch.reqs[w[0]].rid for w in want)
            with self.policy.protecting(own):
                self.evict(EvictParams(mamba_num=short))
        n = min(len(want), max(int(alloc.available_size()) - reserve, 0))
        if n < len(want):
            # Deterministic drop: keep the shallowest positions (they serve the most later
            # requests), ties in batch row order; drop the deepest.
            want.sort(key=lambda w: (w[2], w[0]))
            self.capture_stats["captures_dropped"] += len(want) - n
            want = sorted(want[:n])
        if not want:
            return None
        slots = alloc.alloc(len(want))
        if slots is None:
            self.capture_stats["captures_dropped"] += len(want)
            return None
        slots = slots.reshape(-1)
        plan = CapturePlan(
            rows=[w[0] for w in want],
            offsets=[w[1] for w in want],
            slots=[int(s) for s in slots.tolist()],
            n_layers=self._n_gdn_layers,
        )
        for j, (row, _, p) in enumerate(want):
            rid = batch.reqs[row].rid
            self._capture_pending.setdefault(rid, []).append(_Pending(p, slots[j : j + 1].clone(), plan))
        self.capture_stats["captures_reserved"] += len(want)
        return plan

    # ------------------------------------------------------------------ publish / free

    def _free_slot(self, slot: torch.Tensor) -> None:
        self.req_to_token_pool.mamba_allocator.free(slot)

    def _free_pending(self, rid: str, key: str = "captures_freed") -> None:
        for e in self._capture_pending.pop(rid, ()):
            self._free_slot(e.slot)
            self.capture_stats[key] += 1

    # ------------------------------------------------------------------ reclaim

    def evict_for_alloc(self, params, **kwargs):
        """SGLang's eviction for one of its own allocations (a request's working and ping-pong
        slots in ``alloc_req_slots``, a checkpoint's donated slot, a HiCache load-back), then, if
        the state pool is still short of what it asked for, the pending capture slots
        (:meth:`reclaim_capture_slots`).

        SGLang sizes the state pool per request (``--max-running-requests`` is capped at the pool
        over the slots one request may need: its working state, its ping-pong track slots, the
        tree state it locks and a checkpoint's) and allocates without an admission check: a slot
        held neither by a request nor by a locked tree node must be free or evictable. A pending
        capture slot is neither, and it outlives its step: it is published at the request's next
        checkpoint, i.e. when the scheduler processes its batch's result, after the next batch was
        prepared and allocated (overlap schedule). Unreclaimable, the captures reserved in one
        step ran ``alloc_req_slots`` out of ping-pong slots in the next ("Not enough space for
        mamba ping pong idx"). A capture is an optional copy of a state: SGLang's allocations
        come first."""
        want = int(getattr(params, "mamba_num", 0) or 0)
        alloc = self.req_to_token_pool.mamba_allocator
        target = int(alloc.schedulable_available_size()) + want
        result = super().evict_for_alloc(params, **kwargs)
        if want > 0:
            short = target - int(alloc.schedulable_available_size())
            if short > 0:
                self.reclaim_capture_slots(short)
        return result

    def reclaim_capture_slots(self, n: int) -> int:
        """Free up to ``n`` pending capture slots, the deepest positions first (ties in reservation
        order; the shallow ones serve the most later requests, as in :meth:`build_capture_plan`'s
        drop), and return how many. A slot whose forward ran is freed; one whose forward has not
        begun also leaves its plan (the kernels will not write it). Deterministic: a function of
        the pending captures, the same on every TP rank."""
        if n <= 0 or not self._capture_pending:
            return 0
        pending = [(rid, e) for rid, es in self._capture_pending.items() for e in es]
        # A plan that started and did not complete is left to the checkpoint, which frees it.
        order = sorted(
            (i for i, (_, e) in enumerate(pending) if e.plan.complete or not e.plan.started),
            key=lambda i: (-pending[i][1].position, i),
        )
        freed = 0
        for i in order[:n]:
            rid, e = pending[i]
            rest = [x for x in self._capture_pending[rid] if x is not e]
            if rest:
                self._capture_pending[rid] = rest
            else:
                del self._capture_pending[rid]
            if not e.plan.started:
                e.plan.remove(int(e.slot[0]))
            self._free_slot(e.slot)
            self.capture_stats["captures_reclaimed"] += 1
            freed += 1
        return freed

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        # Insert in increasing depth: captures below the state SGLang offers now, that state (the
        # live one at up_to with no_buffer, the named snapshot with extra_buffer), the rest.
        offered = up_to
        if getattr(self, "enable_mamba_extra_buffer", False):
            offered = req.kv.mamba_last_track_seqlen or 0
        self.publish_captures(req, min(offered, up_to), keep_rest=True)
        super().checkpoint(req, up_to=up_to, **kwargs)
        self.publish_captures(req, up_to)

    def publish_captures(self, req, up_to: int, *, keep_rest: bool = False) -> None:
        """Insert the request's captured states at positions ``<= up_to`` in increasing order;
        ``keep_rest``: deeper ones stay pending (published later in the same checkpoint), else they
        are freed (the request will not reach them in this extend)."""
        pending = self._capture_pending.pop(req.rid, None)
        if not pending:
            return
        if keep_rest:
            rest = [e for e in pending if e.position > up_to]
            pending = [e for e in pending if e.position <= up_to]
            if rest:
                self._capture_pending[req.rid] = rest
        alloc = self.req_to_token_pool.mamba_allocator
        for e in sorted(pending, key=lambda e: e.position):
            if not e.plan.complete:
                if not self.capture_stats["captures_incomplete"]:
                    logger.warning(
                        "sparse capture: plan incomplete (conv layers %d, ssm layers %d, of %d); "
                        "freeing its slots",
                        len(e.plan.conv_layers),
                        len(e.plan.ssm_layers),
                        e.plan.n_layers,
                    )
                self._free_slot(e.slot)
                self.capture_stats["captures_incomplete"] += 1
                continue
            if e.position > up_to or e.position <= int(req.kv.cache_protected_len):
                self._free_slot(e.slot)
                self.capture_stats["captures_freed"] += 1
                continue
            if not self.policy.admit(
                req.rid, e.position, finished=False, free_slots=int(alloc.available_size())
            ):
                self._free_slot(e.slot)
                self.capture_stats["captures_rejected"] += 1
                continue
            # A captured state is a mid-request checkpoint (KV stays with the request, the slot is
            # the capture's), also when the finishing request's release publishes it: the insert
            # sees the request through _MidRequest. Its cleanup forgets the request's named
            # extra_buffer snapshots, which are not this insert's.
            extra = getattr(self, "enable_mamba_extra_buffer", False)
            tracks = (req.kv.mamba_last_track_seqlen, req.kv.mamba_prev_track_seqlen) if extra else None
            self._capture_publishing = e
            try:
                self.checkpoint_into_tree(_MidRequest(req), up_to=e.position)
            finally:
                self._capture_publishing = None
                if tracks is not None:
                    req.kv.mamba_last_track_seqlen, req.kv.mamba_prev_track_seqlen = tracks
            self.capture_stats["captures_published"] += 1
            if req.finished():
                self._end_sequence_at(req, e.position)

    def _end_sequence_at(self, req, position: int) -> None:
        """A finished request's capture at ``position`` holds its whole cache key (prompt + output
        but the last token, page-aligned): the sequence ended at the node it was published on."""
        page = int(self.page_size)
        if position != key_length(req) // page * page:
            return
        node_id = getattr(getattr(req, "lock", None), "node", None)
        if node_id is not None and self.policy.node_end(node_id) == position:
            self.policy.on_insert(node_id, finished=True, seq_len=position)

    def on_release(self, req, *, checkpointed: bool) -> None:
        self._free_pending(req.rid)
        super().on_release(req, checkpointed=checkpointed)

    def reset(self) -> None:
        pending = getattr(self, "_capture_pending", None)
        if pending:
            for rid in list(pending):
                self._free_pending(rid)
        super().reset()

    def pending_capture_slots(self) -> int:
        return sum(len(v) for v in self._capture_pending.values())

    def sparse_stats(self) -> dict[str, Any]:
        d = super().sparse_stats()
        d.update(self.capture_stats, capture_mode="forward", captures_pending=self.pending_capture_slots())
        return d


# ---------------------------------------------------------------------- hooks


def _prepare_for_extend_hook(result, self, *args, **kwargs):
    cache = getattr(self, "tree_cache", None)
    if not getattr(cache, "capture_forward", False):
        return result
    if not self.forward_mode.is_extend() or self.is_dllm():
        return result
    plan = cache.build_capture_plan(self)
    if plan is not None:
        self.sparse_capture = plan
    return result


def _init_new_hook(result, cls, batch, *args, **kwargs):
    plan = batch.__dict__.pop("sparse_capture", None) if hasattr(batch, "__dict__") else None
    if plan is not None and not plan.slots:  # every capture reclaimed before its forward
        plan = None
    set_forward_plan(plan)
    if plan is not None:
        cache = getattr(batch, "tree_cache", None)
        if cache is not None and hasattr(cache, "capture_stats"):
            cache.capture_stats["capture_forwards"] += 1
    return result


def _convolve_prefill_hook(original, self, layer, forward_batch, mixed_qkv, conv_states, cache_indices):
    plan: CapturePlan | None = forward_plan()
    clear_active()
    mode = forward_batch.forward_mode
    if (
        plan is not None
        and plan.slots
        and (mode.is_extend() or mode.is_mixed())
        and not mode.is_target_verify()
        and getattr(self, "mis_metadata", None) is None
    ):
        from sglang_sparse_kernels.sgl_kernel_cpu.conv import capture_conv_states

        qsl = self.forward_metadata.query_start_loc
        n_seq = int(qsl.numel()) - 1
        if max(plan.rows) >= n_seq:  # not this plan's forward: leave it incomplete (slots freed)
            return original(self, layer, forward_batch, mixed_qkv, conv_states, cache_indices)
        cu, offs, slots = plan.csr(n_seq, getattr(self.req_to_token_pool, "translate_mamba_indices", None))
        pool = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id).conv[0]
        capture_conv_states(
            mixed_qkv,
            conv_states,
            qsl,
            cache_indices,
            forward_batch.extend_prefix_lens > 0,
            cu,
            offs,
            slots,
            capture_pool=pool,
        )
        plan.conv_layers.add(int(layer.layer_id))
        Active.layer_id, Active.plan, Active.n_seq = int(layer.layer_id), plan, n_seq
    return original(self, layer, forward_batch, mixed_qkv, conv_states, cache_indices)


def _extend_hook(original, self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs):
    plan = Active.plan
    layer_id = kwargs.get("layer_id")
    if plan is None or layer_id is None or int(layer_id) != Active.layer_id:
        return original(
            self, q, k, v, g, beta,
            ssm_states=ssm_states, cache_indices=cache_indices, query_start_loc=query_start_loc, **kwargs,
        )  # fmt: skip
    n_seq = Active.n_seq
    clear_active()
    from sglang_sparse_kernels.sgl_kernel_cpu import delta_rule

    # extra_buffer: SGLang snapshots its own track state from the per-chunk states ``h`` (as from
    # the Triton kernel it replaces); the same call computes them, capture and outputs unchanged.
    with_h = _sglang_tracks_prefill_states()
    op = delta_rule.chunk_gated_delta_rule_with_h if with_h else delta_rule.chunk_gated_delta_rule
    cu, offs, slots = plan.csr(n_seq)
    out = op(
        q,
        k,
        v,
        g,
        beta,
        ssm_states,
        True,
        query_start_loc,
        False,
        True,
        cache_indices,
        capture_cu=cu,
        capture_offsets=offs,
        capture_slots=slots,
        capture_pool=ssm_states,
    )
    o, final = out[0], out[1]
    h = out[2] if with_h else None
    plan.ssm_layers.add(int(layer_id))
    if plan.complete:
        set_forward_plan(None)  # every GDN layer wrote it: nothing later may write these slots
    return o, final, h


def _sglang_tracks_prefill_states() -> bool:
    """Whether SGLang reads per-chunk states ``h`` from a prefill (its extra_buffer strategy)."""
    from sgl_kernel.mamba import sglang_tracks_prefill_states

    return bool(sglang_tracks_prefill_states())


# ---------------------------------------------------------------------- per-process hand-offs


class Active:
    """``layer_id``: GDN layer whose kernel call must capture; ``plan``: its ``CapturePlan``;
    ``n_seq``: sequences (rows) of the forward."""

    layer_id: int | None = None
    plan: Any = None
    n_seq: int = 0


_FORWARD_PLAN: list[Any] = [None]


def set_forward_plan(plan: Any) -> None:
    _FORWARD_PLAN[0] = plan


def forward_plan() -> Any:
    return _FORWARD_PLAN[0]


def active() -> bool:
    return Active.plan is not None


def clear_active() -> None:
    Active.layer_id, Active.plan, Active.n_seq = None, None, 0


_DECODE_GRID: list[int | None] = [None]


def set_decode_grid(grid: int | None) -> None:
    _DECODE_GRID[0] = None if grid is None else int(grid)


def decode_grid() -> int | None:
    return _DECODE_GRID[0]


# ---------------------------------------------------------------------- decode-time tracks


def refine_decode_tracks(batch: Any) -> int:
    """Adjust the decode-track masks of ``batch`` (see the module docstring); returns the number of
    rows whose mask changed. Cost per row: one dict lookup (finish depths are computed at planning,
    ``cache.finish_tracks``); the policy is asked only about rows at (or one before) a grid point."""
    mask = batch.mamba_track_mask_cpu
    if not mask:
        return 0
    nxt = batch.mamba_track_mask_next_cpu
    cache = batch.tree_cache
    wants = cache.wants_decode_state
    finals = cache.finish_tracks
    seq_lens = batch.seq_lens_cpu.tolist() if finals else None
    changed = 0
    for i, req in enumerate(batch.reqs):
        final = finals.get(req.rid) if finals else None
        at_final = final is not None and seq_lens[i] == final
        before_final = final is not None and nxt is not None and seq_lens[i] == final - 1
        grid_row = mask[i] or (nxt is not None and nxt[i])
        if not (grid_row or at_final or before_final):
            continue
        if grid_row and not wants(req.rid):
            if mask[i]:
                mask[i] = False
                changed += 1
            if nxt is not None:
                nxt[i] = False
        if at_final or before_final:  # a finish track implies wants(): nothing was cleared
            if at_final and not mask[i]:
                mask[i] = True
                changed += 1
            if before_final:
                nxt[i] = True
    if changed:
        batch.mamba_track_mask = torch.tensor(mask, dtype=torch.bool).to(batch.device, non_blocking=True)
    return changed


def prefix_cache_update_hook(original, self, req, batch, result, i, known_boundary: bool = False):
    """AROUND ``SchedulerBatchResultProcessor._mamba_prefix_cache_update``: for a known boundary off
    SGLang's track grid (only an exact finish track is; the sparse backend is the only one that sets
    such a mask) flip the ping-pong slot the next track writes, as SGLang's non-lazy branch does,
    without its grid assertion. Everything else is SGLang's own code."""
    grid = decode_grid()  # what SGLang's mamba_track_grid returns in this process
    if (
        known_boundary
        and grid
        and getattr(self.tree_cache, "decode_tracking", False)
        and req.kv.mamba_ping_pong_track_buffer is not None
        and req.kv.kv_committed_len % grid
    ):
        pool = batch.req_to_token_pool
        req.kv.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(req.kv.mamba_next_track_idx)
        return None
    return original(self, req, batch, result, i, known_boundary=known_boundary)

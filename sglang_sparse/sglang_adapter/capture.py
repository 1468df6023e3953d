"""In-forward state capture of the ``sparse`` backend (``SGLANG_SPARSE_CAPTURE=forward``, the
default on every device and both state strategies).

With ``cut`` every planned position strictly inside a prefill extend ends the chunk there (one more
forward, a closed batch). With ``forward`` the extend is not cut: the states at those positions are
written *during* the forward into Mamba pool slots reserved for them, by SGLang's own prefill track
copies (:mod:`.track_capture`), and the next checkpoint of the request publishes them into the tree,
in increasing position order, around its own (chunk-end / prompt-end / final) state.

Data flow (one scheduler step):

1. ``ScheduleBatch.prepare_for_extend`` (AFTER hook, :func:`_prepare_for_extend_hook`):
   :meth:`CaptureRadixCache.build_capture_plan` turns each request's planned positions ``p`` inside
   its extend into ``(row, p - prefix_len, slot)``, allocating one pool slot per capture (evicting
   tree states if the pool is short, else dropping the deepest captures of the batch:
   deterministic, a pure function of the batch and the pool). The slots are *pending*
   (``cache._capture_pending[rid]``), owned by the cache until published or freed.
2. ``ForwardBatch.init_new`` (AFTER hook): the plan leaves the ScheduleBatch and becomes the
   process's *forward plan* for exactly this forward (:func:`.track_capture.set_forward_plan`).
3. The forward: the plan's captures become entries of SGLang's own track lists (conv rows, ``h``
   rows, final states, Mamba2 recomputes) and GDN tails off the state grid
   (:mod:`.track_capture`); SGLang's copy code writes them in every recurrent layer.
4. The request's next ``checkpoint`` (:meth:`CaptureRadixCache.checkpoint`) publishes the pending
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
* a slot is published only if *every* recurrent layer's copies wrote it in the forward
  (``CapturePlan.complete``); otherwise it is freed (``captures_incomplete``), never published
  with a stale state;
* capture slots never equal a working slot of the batch (they come from the allocator), so the
  copies never overwrite an input state.

Where a position is not captured (counted in :meth:`CaptureRadixCache.sparse_stats`):
``captures_dropped``, no free slot even after eviction. Whole-mode
cuts (``capture=cut``, with the reason in ``capture_reason``): an explicit
``SGLANG_SPARSE_CAPTURE=cut``, a GDN prefill kernel that returns no per-chunk states (CuTe DSL),
HiCache with write-back (see ``docs/sparse_backend.md``).

Per-process hand-offs: the forward plan (:mod:`.track_capture`) and the *decode grid*
(``extra_buffer`` only): set once by the backend factory in the scheduler process; SGLang's
``mamba_track_grid`` returns it instead of ``lcm(grid, --mamba-track-interval)`` so decode states
can be tracked on the policy's grid (which rows track is the policy's choice).

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
from dataclasses import dataclass
from typing import Any

import torch

from .cache import SparseMambaComponent, SparseRadixCache, key_length
from .track_capture import CapturePlan, set_forward_plan

logger = logging.getLogger("sglang_sparse")


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
    capture_mode = "forward"

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
            "capture_conv_fixes": 0,  # captures within W - 1 tokens of the extend start (conv fix)
            "capture_forwards": 0,  # forwards that carried a plan
            "capture_tails": 0,  # captures off the state grid advanced by the recurrent kernel (GDN)
            "capture_graph_vetoes": 0,  # full prefill CUDA graph replays refused for a plan's forward
            "capture_layout": None,  # where the extend kernel's per-chunk states were (track_lists)
        }
        super().__init__(params, **kwargs)
        #: recurrent layers (one SSM pool per layer)
        self._n_state_layers = int(self.req_to_token_pool.mamba_pool.mamba_cache.temporal.shape[0])

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
        offered to admission at the next checkpoint like a no_buffer chunk end). Positions off the
        page grid are never captured."""
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
        rows = sorted({w[0] for w in want})
        plan = CapturePlan(
            rows=[w[0] for w in want],
            offsets=[w[1] for w in want],
            slots=[int(s) for s in slots.tolist()],
            geometry={r: _extend_of(batch.reqs[r]) for r in rows},
            n_layers=self._n_state_layers,
            stats=self.capture_stats,
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
                        "sparse capture: plan incomplete (attached %s, layers copied %d, with tails "
                        "%d, of %d); freeing its slots",
                        e.plan.started,
                        e.plan.copies_done,
                        len(e.plan.tail_layers),
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
        d.update(self.capture_stats, captures_pending=self.pending_capture_slots())
        return d


def _extend_of(req) -> tuple[int, int]:
    """``(prefix_len, extend_len)`` of the request's extend this step (tokens)."""
    lo = int(req.prefix_len)
    return lo, int(req.extend_end) - lo


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

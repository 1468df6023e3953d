"""``offline``: a reference policy that knows the future, inside the same byte budget and tree.

Simulator only (it reads the whole trace, like ``oracle`` and the ``*_published`` baselines; it is
not a :class:`~sglang_sparse.policy.PolicySpec`, so the serving adapter cannot select it). It uses
the simulator's :class:`~sglang_sparse.tree.RadixTree` and cost model unchanged: bytes =
``kv_tokens * kv_bytes_per_token + states * state_bytes``, a request resumes at the deepest state at
or before its KV match, token hit = resume depth, and after every request the cache is within
``budget_bytes`` (checked by :attr:`SimResult.max_bytes_used`).

**Admission** (request ``i`` inserts its input + output ``F`` after resuming at ``r``): a state at
every depth ``p`` of ``F`` with ``r < p <= len(F)`` where some later request leaves ``F`` or stops
(:meth:`FutureIndex.demands`: its KV match on ``F``, the depth it would resume at), at the exact
depth by default (the engine's in-forward capture writes states at any position; the simulated
policies also hold off-grid states); ``grid=g`` floors every depth but the last token to a multiple
of ``g`` instead (SGLang's chunk-end states). A depth whose state cannot stay cached with its prefix
(``p * kv_bytes_per_token + state_bytes > budget_bytes``) is replaced by the deepest one that can
(``fit_tokens``; the ``sparse`` policy's fit state). A depth inside the request's output (not its
last token) moves to the prompt end: the engine's decode keeps only the finish state (SGLang
``no_buffer``; none of the four benchmark traces has such a demand). Whether a captured state is
worth its bytes is left to eviction, right after the insert (capturing is free in the simulator, so
this equals admitting only what eviction would keep).

**Eviction** (Belady-style, byte-weighted, with dependencies; until ``bytes_used <= budget``):

* *KV* has no use of its own: a hit needs a state, and a state needs the KV of its whole prefix. So
  KV is never scored. KV below the deepest state of a leaf (and a leaf without states) is dead: no
  request can resume in it; it goes first. Otherwise KV leaves only with the last state that needs
  it: evicting a state frees ``state_bytes`` plus the KV that becomes dead (from the state up to
  the next state or branch above it): the state's ``bytes`` below.
* The *next use* of a state ``s`` at depth ``p`` is the first later request ``j`` that would resume
  exactly at ``s`` in the current cache: ``j``'s input starts with ``s``'s prefix and with no
  deeper state's prefix (those would serve ``j`` instead). Its *benefit* is ``p - f`` tokens, ``f``
  the next state up the path (what ``j`` resumes at without ``s``).
* Order: states that can never stay cached with their prefix first, then states with no next use
  (largest ``bytes`` first), then by ``benefit / (bytes * (j - now))`` ascending (tokens per byte per
  request of waiting): Belady's furthest-next-use rule weighted by what a hit saves and what keeping
  it costs. Scores are recomputed after every eviction (one pass over the tree: it holds only
  states, their prefixes and branch points, a few hundred nodes at these budgets).

This is a strong heuristic reference, not an optimum: caching with sizes, values and prefix
dependencies is NP-hard in general (byte-weighted caching alone is), Belady's rule is optimal only
for unit sizes and values, and states are placed at the demand depths only (the policy never keeps a
shallower prefix of a sequence as a partial hit unless the sequence does not fit the cache). The
headroom bound (:mod:`.bound`) stays the upper bound; ``offline`` is a reachable schedule below it.
Everything is deterministic (ties by node uid and position). The ranking is
:meth:`OfflineCache._rank` (:mod:`.ablation` hides parts of the future through it). The alternatives
measured against this rule: ``docs/offline_reference.md``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sglang_sparse.policy import ModelCostModel
from sglang_sparse.tree import Freed, Node, RadixTree

from .common import Observer, RequestRecord, SimResult, prepare_requests, progress_range
from .future import FutureIndex, after, first_bit
from .trace import SimRequest

#: state kinds (see :class:`StateInfo`)
FINISH, BRANCH, FIT = "finish", "branch", "fit"


@dataclass(frozen=True, slots=True)
class StateInfo:
    """What the offline policy knows about one captured state.

    ``mask``: requests whose input starts with the state's prefix (bit ``j`` = request ``j``);
    ``request``: the request that captured it; ``pos``: its depth (tokens); ``kind``: ``finish``
    (after the last token of that request's input + output), ``branch`` (a depth where a later
    request leaves the sequence or stops, floored to the grid in grid mode) or ``fit`` (the deepest
    depth that fits the cache, standing in for deeper unservable demands)."""

    mask: int
    request: int
    pos: int
    kind: str


@dataclass(frozen=True, slots=True)
class Served:
    """One request's outcome (tokens): resume depth, KV match depth, states captured."""

    resume_depth: int
    kv_depth: int
    captured: int


class OfflineCache:
    """The ``offline`` policy on a :class:`RadixTree` of ``budget_bytes`` bytes (module docstring).
    Drive it with :meth:`serve` for requests ``0, 1, ...`` of the trace ``future`` was built from, in
    order (the future is indexed by request position)."""

    def __init__(
        self,
        future: FutureIndex,
        budget_bytes: int,
        kv_bytes_per_token: int,
        state_bytes: int,
        *,
        grid: int | None = None,
    ) -> None:
        if state_bytes <= 0 or kv_bytes_per_token <= 0:
            raise ValueError(f"need positive byte sizes, got {kv_bytes_per_token}, {state_bytes}")
        if budget_bytes < state_bytes:
            raise ValueError(
                f"budget_bytes={budget_bytes} is smaller than one recurrent state ({state_bytes} bytes)"
            )
        if grid is not None and grid < 1:
            raise ValueError(f"grid must be >= 1 token or None, got {grid}")
        self.future = future
        self.budget_bytes = int(budget_bytes)
        self.kvb, self.sb = int(kv_bytes_per_token), int(state_bytes)
        self.grid = grid
        #: the deepest state position whose prefix KV fits next to the state (tokens)
        self.fit_tokens = (self.budget_bytes - self.sb) // self.kvb
        self.tree = RadixTree(self.kvb, self.sb)
        self.info: dict[int, StateInfo] = {}
        self._ids = itertools.count(1)
        self._next = 0
        #: state handle -> the last request that resumed from it (for ablations and analysis)
        self.last_use: dict[int, int] = {}
        #: states evicted per kind, and how many of them still had a next use
        self.evicted: dict[str, int] = {FINISH: 0, BRANCH: 0, FIT: 0}
        self.evicted_useful = 0

    @property
    def bytes_used(self) -> int:
        return self.tree.bytes_used

    # ------------------------------------------------------------------ admission

    def _floor(self, p: int, total: int) -> int:
        g = self.grid
        return p if g is None or p == total else (p // g) * g

    def capture_positions(
        self, i: int, full: np.ndarray, input_len: int, resume: int
    ) -> dict[int, StateInfo]:
        """States request ``i`` captures on its sequence ``full`` (input of ``input_len`` tokens)
        when it resumes at ``resume``: positions in ``(resume, input_len]`` and ``len(full)``
        (module docstring)."""
        total = len(full)
        demands = self.future.demands(full, since=i)
        out: dict[int, StateInfo] = {}
        fit = self._floor(min(self.fit_tokens, total), total)
        for d in demands:
            p, kind = self._floor(d.depth, total), (FINISH if d.depth == total else BRANCH)
            if input_len < p < total:  # inside the output: decode keeps the finish state only
                p = input_len
            if p * self.kvb + self.sb > self.budget_bytes:
                p, kind = fit, FIT
            if p <= resume or p in out:
                continue
            mask = d.mask if p == d.depth else self.future.mask_at(full, p, demands)
            out[p] = StateInfo(mask, i, p, kind)
        return out

    # ------------------------------------------------------------------ per request

    def serve(self, inp: np.ndarray, full: np.ndarray, observer: Observer | None = None) -> Served:
        """Serve the next request of the trace: match, capture, insert ``full``, evict to budget.
        ``observer``: as in :func:`.simulate` (called after the eviction)."""
        i = self._next
        self._next += 1
        tree = self.tree
        m = tree.match(inp)
        if m.resume_depth > 0:
            self.last_use[m.ckpt_handle] = i
        plan = self.capture_positions(i, full, len(inp), m.resume_depth)
        handles = {}
        for p, st in plan.items():
            h = next(self._ids)
            self.info[h] = st
            handles[p] = h
        tree.lock(m.node)
        res = tree.insert(full, None, handles, hint=m)
        tree.unlock(m.node)
        for h in res.unused_states:  # a state already existed there
            del self.info[h]
        freed = self.evict_to_budget(i)
        if observer is not None:
            observer(i, m, handles, res, freed)
        return Served(m.resume_depth, m.kv_depth, len(plan) - len(res.unused_states))

    # ------------------------------------------------------------------ eviction

    def evict_to_budget(self, now: int) -> Freed:
        """Evict (module docstring) until ``bytes_used <= budget_bytes``; ``now``: the index of the
        request just served (later requests are the future)."""
        freed = Freed()
        tree = self.tree
        if tree.bytes_used <= self.budget_bytes:
            return freed
        for leaf in sorted(tree.leaves, key=lambda n: n.uid):
            if leaf.alive:
                self._trim(leaf, freed)
        fut = after(now)
        while tree.bytes_used > self.budget_bytes:
            victim = self._victim(now, fut)
            if victim is None:
                break
            node, pos, useful = victim
            h = node.checkpoints[pos]
            st = self.info.pop(h)
            self.last_use.pop(h, None)
            self.evicted[st.kind] += 1
            self.evicted_useful += useful
            freed.extend(tree.drop_checkpoint(node, pos))
            self._trim(node, freed)
        return freed

    def _trim(self, node: Node, freed: Freed) -> None:
        """Drop the dead KV at and above ``node`` (a stateless leaf, the tail of a leaf below its
        deepest state) and merge a stateless single-child node into its child."""
        tree = self.tree
        n = node
        while n.parent is not None and n.alive:
            if n.children:
                if len(n.children) == 1 and not n.checkpoints and n.lock_ref == 0:
                    tree.merge_with_child(n)
                return
            if n.checkpoints:
                last = n.checkpoints.peekitem(-1)[0]
                if last < n.end:
                    freed.extend(tree.truncate(n, last)[0])
                return
            parent = n.parent
            freed.extend(tree.drop_leaf(n))
            n = parent

    def _freed_bytes(self, node: Node, i: int, keys: list[int]) -> int:
        """Bytes evicting the state ``keys[i]`` of ``node`` frees: the state, plus the KV that no
        other state needs any more when it was the deepest state of a leaf."""
        kvb = self.kvb
        if i + 1 < len(keys) or node.children:
            return self.sb
        if i > 0:
            return self.sb + (keys[i] - keys[i - 1]) * kvb
        kv = keys[i] - node.start
        n = node.parent
        while n.parent is not None and len(n.children) == 1:
            if n.checkpoints:
                kv += n.end - n.checkpoints.peekitem(-1)[0]
                break
            kv += n.num_tokens
            n = n.parent
        return self.sb + kv * kvb

    def _rank(
        self, handle: int, nxt: int | None, passed: bool, now: int, benefit: int, nbytes: int
    ) -> tuple[int, float]:
        """``(class, score)`` of a servable state (lowest evicted first): class 1 when no later
        request resumes at it (``nxt is None``), else class 2 with ``benefit / (nbytes * (nxt -
        now))``: ``nxt`` the next request resuming there, ``benefit`` the tokens it saves over the
        next state up, ``nbytes`` what evicting it frees. ``passed``: some later request passes
        the state (it may resume deeper); ``handle``: the state. Subclasses change what is known
        (:mod:`.ablation`)."""
        if nxt is None:
            return 1, 0.0
        return 2, benefit / (nbytes * (nxt - now))

    def _victim(self, now: int, fut: int) -> tuple[Node, int, bool] | None:
        """The state to evict next: ``(node, position, it had a next use)`` (module docstring)."""
        tree = self.tree
        order = list(tree.nodes())  # parents before children
        above: dict[int, int] = {}  # node uid -> deepest state depth on its strict ancestors
        for n in order:
            p = n.parent
            pk = p.checkpoints
            above[n.uid] = pk.peekitem(-1)[0] if pk else above.get(p.uid, 0)
        below: dict[int, int] = {}  # node uid -> masks of every state in its subtree
        info, cap, kvb, sb = self.info, self.budget_bytes, self.kvb, self.sb
        best: tuple | None = None
        best_item: tuple[Node, int, bool] | None = None
        for n in reversed(order):
            run = 0
            for c in n.children.values():
                run |= below[c.uid]
            ck = n.checkpoints
            if ck and n.lock_ref == 0:
                keys = ck.keys()
                for k in range(len(keys) - 1, -1, -1):
                    p = keys[k]
                    st = info[ck[p]]
                    own = st.mask & ~run & fut
                    run |= st.mask
                    nbytes = self._freed_bytes(n, k, keys)
                    if p * kvb + sb > cap:
                        key = (0, 0.0, -nbytes, n.uid, p)
                    else:
                        fb = keys[k - 1] if k > 0 else above[n.uid]
                        rank = self._rank(ck[p], first_bit(own), bool(st.mask & fut), now, p - fb, nbytes)
                        key = (*rank, -nbytes, n.uid, p)
                    if best is None or key < best:
                        best, best_item = key, (n, p, key[0] == 2)
            elif ck:
                for p in ck.keys():
                    run |= info[ck[p]].mask
            below[n.uid] = run
        return best_item


def simulate_offline(
    requests: Sequence[SimRequest],
    cache_bytes: int,
    cost: ModelCostModel,
    *,
    grid: int | None = None,
    future: FutureIndex | None = None,
    keep_records: bool = True,
    progress: bool = False,
    check: bool = False,
    observer: Observer | None = None,
    cache_factory: Callable[..., OfflineCache] = OfflineCache,
    name: str | None = None,
) -> SimResult:
    """Replay ``requests`` through an :class:`OfflineCache` of ``cache_bytes`` bytes for ``cost``
    (same :class:`SimResult` fields and definitions as :func:`.simulate`). ``future``: a
    :class:`FutureIndex` of ``requests`` to reuse across sizes; ``check`` asserts tree invariants
    and the byte budget after every request; ``observer``: as in :func:`.simulate`;
    ``cache_factory``: the class (or a factory with its signature) to replay, ``name`` the result's
    policy name (default ``offline``, ``offline_gridG`` with a grid)."""
    future = FutureIndex(requests) if future is None else future
    if future.n != len(requests):
        raise ValueError(f"a future index of {future.n} requests for {len(requests)}")
    cache = cache_factory(future, cache_bytes, cost.kv_bytes_per_token, cost.state_bytes, grid=grid)
    name = name or ("offline" if grid is None else f"offline_grid{grid}")
    res = SimResult(name, int(cache_bytes))
    prepared = prepare_requests(requests)
    for i in progress_range(len(prepared), progress, name, cache_bytes):
        inp, full = prepared[i]
        s = cache.serve(inp, full, observer)
        if check:
            cache.tree.check()
            assert cache.bytes_used <= cache.budget_bytes, (i, cache.bytes_used)
            assert set(cache.info) == {h for _, _, h in cache.tree.iter_checkpoints()}
        c, kv = s.resume_depth, s.kv_depth
        saved = cost.flops_saved(len(inp), c)
        total = cost.prefill_flops(len(inp))
        rec = RequestRecord(i, len(inp), kv, c, kv - c, s.captured, saved, total, cache.bytes_used)
        res.add(rec, keep_records)
    return res

"""Radix tree over token ids with sparse recurrent-state checkpoints (no tensors, opaque handles).

The tree is the *mechanism*; which checkpoints to capture and what to evict is decided by
:mod:`sglang_sparse.policy`. It is designed to be driven by an SGLang ``UnifiedRadixCache`` subclass:

* :meth:`RadixTree.match` is **pure** (no splits, no clock, no recency update) so the scheduler may
  call it any number of times per request.
* :meth:`RadixTree.observe` is the separate, explicit "this request was admitted with this match"
  call: it advances the logical clock, refreshes recency, feeds the per-edge depth histograms and
  re-plans edges whose histogram is due.
* :meth:`RadixTree.insert` returns the KV slices and state handles it did *not* take (duplicates of
  what is already cached) so the caller frees them (SGLang ``cache_finished_req`` semantics).
* :meth:`RadixTree.lock` / :meth:`RadixTree.unlock` mirror ``inc_lock_ref`` / ``dec_lock_ref``.
* Eviction primitives (:meth:`drop_checkpoint`, :meth:`drop_leaf`, :meth:`merge_with_child`) return
  the freed handles; the policy layer orders them.

Units: depths/positions/lengths in **tokens** (absolute from the root), memory in **bytes**. The tree
holds ``kv_tokens * kv_bytes_per_token + num_states * state_bytes`` bytes (:attr:`bytes_used`).

Depth observations (what each edge's histogram sees). A request whose KV match reaches depth
``d`` observes ``d`` on the edge ``(a, b]`` containing ``d``; every strict ancestor edge
``(a', b']`` observes ``b'`` (its end, i.e. the depth clipped to the edge). Rationale: within the
per-edge model an edge's origin (its start) is assumed to be a free resume point; for an ancestor,
the best place to serve traffic that continues below it is its end, which is exactly where the
ancestor's DP then puts a checkpoint, making the assumption true for its children.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_sparse.placement import DEFAULT_GRID, DepthHistogram, grid_candidates, solve_dp

from .node import EMPTY_KEY, Node

Tokens = Sequence[int] | np.ndarray


def as_tokens(tokens: Tokens) -> np.ndarray:
    """Token ids as a contiguous 1-D int32 array (no copy when already one)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.dtype != np.int32:
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
    return arr


def _lcp(key: np.ndarray, tokens: np.ndarray, offset: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[offset:]`` (vectorised, no Python loop)."""
    m = min(len(key), len(tokens) - offset)
    neq = key[:m] != tokens[offset : offset + m]
    return int(neq.argmax()) if neq.any() else m


class KVOps:
    """How to split and join opaque KV handles. Default: sequence slicing; ``np.concatenate`` for
    numpy arrays, ``+`` for lists/tuples; ``None`` handles stay ``None`` (simulation without a pool).
    An engine adapter passes its own (e.g. torch slicing / ``torch.cat``)."""

    def split(self, handle: Any, k: int) -> tuple[Any, Any]:
        if handle is None:
            return None, None
        return handle[:k], handle[k:]

    def concat(self, left: Any, right: Any) -> Any:
        if left is None and right is None:
            return None
        if isinstance(left, np.ndarray):
            return np.concatenate([left, right])
        return left + right


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Result of :meth:`RadixTree.match` (pure).

    ``kv_depth``: tokens whose KV is cached (longest common prefix with the tree).
    ``resume_depth``: deepest checkpoint position ``<= kv_depth`` (0 if none) -- the usable prefix.
    ``node``: node whose edge contains ``kv_depth`` (the root when ``kv_depth == 0``).
    ``ckpt_node`` / ``ckpt_handle``: where that checkpoint lives (``None`` when ``resume_depth == 0``).
    ``path``: nodes from the root's child down to ``node`` (empty when nothing matched).
    """

    kv_depth: int
    resume_depth: int
    node: Node
    ckpt_node: Node | None
    ckpt_handle: Any
    path: tuple[Node, ...]


@dataclass(slots=True)
class InsertResult:
    """Result of :meth:`RadixTree.insert`.

    ``prefix_len``: tokens already cached before this insert. ``node``: node holding the last token.
    ``unused_kv``: KV slices the tree did not take (the caller frees them); ``unused_states``: state
    handles not taken because a checkpoint already existed at that position.
    """

    prefix_len: int
    node: Node
    unused_kv: list[Any] = field(default_factory=list)
    unused_states: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Freed:
    """Handles released by eviction (the caller returns them to its pools) and bytes freed."""

    kv: list[Any] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    kv_tokens: int = 0
    bytes: int = 0

    def extend(self, other: Freed) -> None:
        self.kv.extend(other.kv)
        self.states.extend(other.states)
        self.kv_tokens += other.kv_tokens
        self.bytes += other.bytes


def _split_hist(h: DepthHistogram, at: int) -> tuple[DepthHistogram, DepthHistogram]:
    """Split an edge histogram at depth ``at``: depths ``<= at`` go up, deeper ones go down and also
    count as pass-through mass at ``at`` on the upper part (the ancestor rule of this module)."""
    up = DepthHistogram(h.gamma, h.refresh)
    down = DepthHistogram(h.gamma, h.refresh)
    d, w = h.items()
    for hh, bins in ((up, {}), (down, {})):
        hh._n = h.observations  # noqa: SLF001 - placement exposes no split; documented open problem
        hh._since_refresh = h.refresh  # re-plan both halves at the next observation
        hh._bins = bins
    for di, wi in zip(d.tolist(), w.tolist(), strict=True):
        if di <= at:
            up._bins[di] = up._bins.get(di, 0.0) + wi
        else:
            up._bins[at] = up._bins.get(at, 0.0) + wi
            down._bins[di] = wi
    return up, down


def _merge_hist(upper: DepthHistogram | None, lower: DepthHistogram | None, at: int) -> DepthHistogram | None:
    """Histogram of a merged edge: the lower edge's depths plus the upper edge's depths ``< at`` (its
    mass at ``at`` is pass-through mass that the lower edge already records at the true depths)."""
    if upper is None:
        return lower
    merged = DepthHistogram(upper.gamma, upper.refresh)
    merged._n = upper.observations + (lower.observations if lower else 0)  # noqa: SLF001
    merged._since_refresh = merged.refresh  # noqa: SLF001
    bins: dict[int, float] = {}
    d, w = upper.items()
    for di, wi in zip(d.tolist(), w.tolist(), strict=True):
        if di < at:
            bins[di] = wi
    if lower is not None:
        d, w = lower.items()
        for di, wi in zip(d.tolist(), w.tolist(), strict=True):
            bins[di] = bins.get(di, 0.0) + wi
    merged._bins = bins  # noqa: SLF001
    return merged


LawProvider = Callable[[Node, "RadixTree"], tuple[np.ndarray, np.ndarray]]


class RadixTree:
    """Radix tree of cached token prefixes with KV handles and sparse recurrent checkpoints.

    Parameters: ``kv_bytes_per_token`` and ``state_bytes`` (one checkpoint, all recurrent layers)
    size the byte accounting; ``gamma``/``refresh`` configure each edge's :class:`DepthHistogram`;
    ``plan_budget`` is the per-edge checkpoint budget ``M`` handed to :func:`solve_dp`; ``grid`` the
    chunk size of candidate positions; ``law_provider`` (optional) replaces the online histogram by
    another law source (used by the simulator's oracle).
    """

    def __init__(
        self,
        kv_bytes_per_token: int,
        state_bytes: int,
        *,
        kv_ops: KVOps | None = None,
        gamma: float = 0.99,
        refresh: int = 10,
        plan_budget: int = 4,
        grid: int = DEFAULT_GRID,
        law_provider: LawProvider | None = None,
    ) -> None:
        if kv_bytes_per_token < 0 or state_bytes <= 0:
            raise ValueError(
                f"need kv_bytes_per_token >= 0 and state_bytes > 0, got {kv_bytes_per_token}, {state_bytes}"
            )
        if plan_budget < 0:
            raise ValueError(f"plan_budget must be >= 0 checkpoints per edge, got {plan_budget}")
        DepthHistogram(gamma, refresh)  # validate early
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        self.state_bytes = int(state_bytes)
        self.kv_ops = kv_ops or KVOps()
        self.gamma, self.refresh = float(gamma), int(refresh)
        self.plan_budget = int(plan_budget)
        self.grid = int(grid)
        self.law_provider = law_provider
        self.clock = 0
        self._uid = 0
        self.root = Node(self._next_uid(), EMPTY_KEY, 0, None, None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.kv_tokens = 0
        self.num_states = 0
        self.num_nodes = 0
        self.leaves: set[Node] = set()

    # ------------------------------------------------------------------ accounting

    def _next_uid(self) -> int:
        self._uid += 1
        return self._uid

    @property
    def bytes_used(self) -> int:
        """KV bytes of all cached tokens + bytes of all checkpoints."""
        return self.kv_tokens * self.kv_bytes_per_token + self.num_states * self.state_bytes

    def node_bytes(self, node: Node) -> int:
        """Bytes freed by dropping ``node`` as a leaf (its own KV + its checkpoints)."""
        return node.num_tokens * self.kv_bytes_per_token + len(node.checkpoints) * self.state_bytes

    def tick(self) -> int:
        """Advance and return the logical clock (one tick per request/operation)."""
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ match (pure)

    def match(self, tokens: Tokens) -> MatchResult:
        """Longest cached prefix of ``tokens`` and the deepest checkpoint at or before it. Pure."""
        t = as_tokens(tokens)
        n = len(t)
        node, d = self.root, 0
        path: list[Node] = []
        ck_node, ck_pos, ck_handle = None, 0, None
        children = node.children
        while d < n:
            child = children.get(int(t[d]))
            if child is None:
                break
            k = _lcp(child.key, t, d)
            path.append(child)
            d += k
            if child.checkpoints:
                hit = child.deepest_checkpoint_at_or_before(d)
                if hit is not None:
                    ck_node, (ck_pos, ck_handle) = child, hit
            if k < child.num_tokens:
                break
            children = child.children
        last = path[-1] if path else self.root
        return MatchResult(d, ck_pos, last, ck_node, ck_handle, tuple(path))

    def kv_handles(self, match: MatchResult, depth: int | None = None) -> list[Any]:
        """Per-edge KV handles covering tokens ``[0, depth)`` of a match (default ``resume_depth``)."""
        depth = match.resume_depth if depth is None else depth
        if not 0 <= depth <= match.kv_depth:
            raise ValueError(f"depth {depth} outside [0, kv_depth={match.kv_depth}]")
        out = []
        for node in match.path:
            if node.start >= depth:
                break
            if node.end <= depth:
                out.append(node.kv)
            else:
                out.append(self.kv_ops.split(node.kv, depth - node.start)[0])
        return out

    # ------------------------------------------------------------------ observe

    def observe(self, match: MatchResult) -> list[Node]:
        """Record an admitted request's match: clock, recency, depth histograms, re-plans.

        Returns the nodes whose plan was recomputed. Call once per request (not per match call).
        """
        now = self.tick()
        d = match.kv_depth
        if d == 0 or not match.path:
            return []
        replanned = []
        for node in match.path:
            if not node.alive:
                raise ValueError("stale MatchResult: the tree changed since match(); match again")
            node.last_access = now
            if node.hist is None:
                node.hist = DepthHistogram(self.gamma, self.refresh)
            due = node.hist.observe(min(d, node.end))
            if due or node.hist.observations <= self.refresh:  # plan early on young edges
                self.replan(node)
                replanned.append(node)
        if match.ckpt_node is not None and match.resume_depth in match.ckpt_node.ckpt_access:
            match.ckpt_node.ckpt_access[match.resume_depth] = now
        return replanned

    def edge_law(self, node: Node) -> tuple[np.ndarray, np.ndarray]:
        """Observed depths (tokens) and weights on ``node``'s edge (law provider or histogram)."""
        if self.law_provider is not None:
            return self.law_provider(node, self)
        if node.hist is None:
            return np.empty(0, dtype=np.int64), np.empty(0)
        return node.hist.items()

    def replan(self, node: Node) -> tuple[int, ...]:
        """Re-solve the edge's checkpoint plan with :func:`solve_dp` within ``plan_budget``."""
        from sglang_sparse.placement import DepthLaw

        cands = grid_candidates(node.end, self.grid, origin=node.start, include_end=True)
        d, w = self.edge_law(node)
        law = DepthLaw.from_depths(d, w, cands, node.start)
        node.plan = solve_dp(law, self.plan_budget).positions if cands.size else ()
        if node.hist is not None:
            node.hist.mark_refreshed()
        return node.plan

    def planned_captures(self, match: MatchResult) -> list[int]:
        """Planned positions on the matched path that a prefill resuming at ``resume_depth`` passes
        (``resume_depth < p <= kv_depth``) and that are not cached yet."""
        out = []
        lo, hi = match.resume_depth, match.kv_depth
        for node in match.path:
            if node.end <= lo:
                continue
            for p in node.plan:
                if lo < p <= hi and p not in node.checkpoints:
                    out.append(p)
        return out

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors (their KV and checkpoints) from eviction."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one :meth:`lock` of ``node``."""
        n = node
        while n is not None:
            if n.lock_ref <= (1 if n.parent is None else 0):
                raise ValueError(f"unlock without matching lock on {node!r}")
            n = n.parent
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ insert

    def _split(self, node: Node, k: int) -> Node:
        """Split ``node``'s edge after ``k`` tokens (0 < k < len); return the new upper node.
        Checkpoints at positions ``<= start + k`` move to the upper node, deeper ones stay (right side)."""
        at = node.start + k
        kv_up, kv_down = self.kv_ops.split(node.kv, k)
        up = Node(self._next_uid(), node.key[:k], node.start, node.parent, kv_up, node.last_access)
        up.lock_ref = node.lock_ref
        parent = node.parent
        parent.children[int(node.key[0])] = up
        node.key = node.key[k:]
        node.start = at
        node.kv = kv_down
        node.parent = up
        up.children[int(node.key[0])] = node
        ck = node.checkpoints
        while ck and ck.peekitem(0)[0] <= at:
            p, h = ck.popitem(0)
            up.checkpoints[p] = h
            up.ckpt_access[p] = node.ckpt_access.pop(p)
        if node.hist is not None:
            up.hist, node.hist = _split_hist(node.hist, at)
        up.plan = tuple(p for p in node.plan if p <= at)
        node.plan = tuple(p for p in node.plan if p > at)
        node.version += 1
        self.num_nodes += 1
        return up

    def insert(
        self,
        tokens: Tokens,
        kv: Any = None,
        checkpoints: Mapping[int, Any] | None = None,
        *,
        kv_offset: int = 0,
    ) -> InsertResult:
        """Cache ``tokens`` with KV handle ``kv`` covering ``tokens[kv_offset:]`` and checkpoints
        ``{position: state handle}`` (``0 < position <= len(tokens)``).

        Tokens before ``kv_offset`` must already be cached (the caller holds them locked, as SGLang
        does for ``req.prefix_indices``). Edges are split where ``tokens`` diverge. Returns the KV
        slices of tokens that were already cached from ``kv_offset`` on and the state handles whose
        position already had a checkpoint: the caller frees both.
        """
        t = as_tokens(tokens)
        n = len(t)
        if n == 0:
            raise ValueError("cannot insert an empty token sequence")
        if not 0 <= kv_offset <= n:
            raise ValueError(f"kv_offset must be in [0, {n}], got {kv_offset}")
        checkpoints = dict(checkpoints or {})
        for p in checkpoints:
            if not 0 < int(p) <= n:
                raise ValueError(f"checkpoint position {p} outside (0, {n}]")
        now = self.tick()
        node, d = self.root, 0
        path: list[Node] = []
        while d < n:
            child = node.children.get(int(t[d]))
            if child is None:
                break
            k = _lcp(child.key, t, d)
            if k < child.num_tokens:
                child = self._split(child, k)
            child.last_access = now
            path.append(child)
            d += k
            node = child
        prefix_len = d
        if prefix_len < kv_offset:
            raise ValueError(
                f"tokens[:kv_offset={kv_offset}] must already be cached, only {prefix_len} are (lock them)"
            )
        res = InsertResult(prefix_len, node)
        if prefix_len > kv_offset:
            dup, kv = self.kv_ops.split(kv, prefix_len - kv_offset)
            res.unused_kv.append(dup)
        if prefix_len < n:
            leaf = Node(self._next_uid(), t[prefix_len:].copy(), prefix_len, node, kv, now)
            node.children[int(t[prefix_len])] = leaf
            self.leaves.discard(node)
            self.leaves.add(leaf)
            self.kv_tokens += leaf.num_tokens
            self.num_nodes += 1
            path.append(leaf)
            res.node = leaf
        ends = [p.end for p in path]
        for p, h in sorted(checkpoints.items()):
            holder = path[bisect.bisect_left(ends, p)]
            if p in holder.checkpoints:
                res.unused_states.append(h)
            else:
                holder.checkpoints[p] = h
                holder.ckpt_access[p] = now
                self.num_states += 1
        return res

    # ------------------------------------------------------------------ eviction primitives

    def drop_checkpoint(self, node: Node, pos: int) -> Freed:
        """Remove one checkpoint (thin the edge, keep its KV). The node must be unlocked."""
        if node.lock_ref > 0:
            raise ValueError(f"cannot drop a checkpoint of locked {node!r}")
        h = node.checkpoints.pop(pos)
        del node.ckpt_access[pos]
        self.num_states -= 1
        return Freed(states=[h], bytes=self.state_bytes)

    def drop_leaf(self, node: Node) -> Freed:
        """Remove an unlocked leaf: its KV and all its checkpoints."""
        if not node.is_leaf or not node.alive:
            raise ValueError(f"not a live leaf: {node!r}")
        if node.lock_ref > 0:
            raise ValueError(f"cannot evict locked {node!r}")
        parent = node.parent
        del parent.children[int(node.key[0])]
        freed = Freed(kv=[node.kv], states=list(node.checkpoints.values()), kv_tokens=node.num_tokens)
        freed.bytes = self.node_bytes(node)
        self.kv_tokens -= node.num_tokens
        self.num_states -= len(node.checkpoints)
        self.num_nodes -= 1
        node.alive = False
        node.version += 1
        self.leaves.discard(node)
        if parent.parent is not None and not parent.children:
            self.leaves.add(parent)
        return freed

    def merge_with_child(self, node: Node) -> Node:
        """Merge a single-child, unlocked node into its child (Marconi). Frees nothing; the child
        survives with the concatenated edge, KV, checkpoints and histogram. Returns the child."""
        if node.parent is None or len(node.children) != 1 or node.lock_ref > 0:
            raise ValueError(f"can only merge an unlocked single-child node, got {node!r}")
        (child,) = node.children.values()
        parent = node.parent
        child.hist = _merge_hist(node.hist, child.hist, node.end)
        child.plan = node.plan + child.plan
        child.key = np.concatenate([node.key, child.key])
        child.kv = self.kv_ops.concat(node.kv, child.kv)
        child.start = node.start
        child.parent = parent
        child.checkpoints.update(node.checkpoints)
        child.ckpt_access.update(node.ckpt_access)
        child.last_access = max(child.last_access, node.last_access)
        parent.children[int(child.key[0])] = child
        node.alive = False
        node.version += 1
        child.version += 1
        self.num_nodes -= 1
        return child

    # ------------------------------------------------------------------ inspection

    def nodes(self) -> Iterator[Node]:
        """All nodes except the root, parents before children (deterministic order)."""
        stack = list(reversed(list(self.root.children.values())))
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(list(n.children.values())))

    def path_tokens(self, node: Node) -> np.ndarray:
        """Tokens from the root to the end of ``node``'s edge."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return np.concatenate(keys[::-1]) if keys else EMPTY_KEY

    def fallback_depth(self, node: Node, pos: int) -> int:
        """Deepest checkpoint strictly before ``pos`` on the path to ``node`` (0 if none)."""
        ck = node.checkpoints
        i = ck.bisect_left(pos) - 1
        if i >= 0:
            return ck.peekitem(i)[0]
        n = node.parent
        while n is not None and n.parent is not None:
            if n.checkpoints:
                return n.checkpoints.peekitem(-1)[0]
            n = n.parent
        return 0

    def check(self) -> None:
        """Assert every structural and accounting invariant (tests call this after each step)."""
        kv_tokens = states = count = 0
        leaves = set()
        for n in self.nodes():
            count += 1
            assert n.alive and n.num_tokens > 0
            assert n.start == n.parent.end, n
            assert n.parent.children[int(n.key[0])] is n
            kv_tokens += n.num_tokens
            states += len(n.checkpoints)
            assert set(n.checkpoints) == set(n.ckpt_access)
            for p in n.checkpoints:
                assert n.start < p <= n.end, (n, p)
            lr = sum(c.lock_ref for c in n.children.values())
            assert n.lock_ref >= lr, n
            if not n.children:
                leaves.add(n)
        assert count == self.num_nodes, (count, self.num_nodes)
        assert kv_tokens == self.kv_tokens and states == self.num_states
        assert leaves == self.leaves

    def iter_checkpoints(self) -> Iterable[tuple[Node, int, Any]]:
        for n in self.nodes():
            for p, h in n.checkpoints.items():
                yield n, p, h

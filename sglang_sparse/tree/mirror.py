"""A token-free mirror of an engine's radix tree, driven by the engine's structural events.

The serving engine (SGLang's ``UnifiedTreeCore``) owns the real tree: token keys, KV indices, state
slots, locks. The policy needs its *shape* only: which node hangs under which, each edge's depth
span ``(start, end]``, which nodes hold a recurrent state. A :class:`MirrorTree` is a
:class:`~sglang_sparse.tree.core.CheckpointTree` (the structure every policy function runs on)
whose nodes are created, split and removed by the engine's events, keyed by the engine's node ids,
and that holds **no token sequence**: a node's ``key`` is a :class:`Span` (edge length + first
token, for the ``children`` dict). Memory is O(nodes), independent of prompt lengths.

Correspondence (an invariant; :meth:`MirrorTree.check_against` verifies it against a description of
the engine's tree):

* one mirror node per engine node (same id as ``uid``), same parent, same edge length;
* the engine keeps at most one recurrent state per node, at the node's end: the mirror node has a
  checkpoint at ``end`` (handle = the engine node id) iff the engine node holds a state;
* mirror ``lock_ref`` is 0 everywhere but the root: the engine enforces locks itself, the mirror only
  scores.

Events (all O(1) except :meth:`MirrorTree.touch_path`, O(depth), iterative):
:meth:`add_node` (a new child edge), :meth:`split_node` (the engine split ``child`` at ``k`` tokens: a
new upper node takes the first ``k`` tokens, ``child`` keeps its id and the lower part),
:meth:`remove_leaf`, :meth:`set_state` / :meth:`drop_state`, :meth:`reset`. Every node an event
changes is passed to ``on_change`` (the evictor's incremental candidate index listens there).

Units: depths and lengths in tokens, memory in bytes (as :class:`CheckpointTree`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .core import CheckpointTree, MatchResult, Node, _make_match


class Span:
    """The key of a mirror edge: its length (tokens) and ``first``, the engine's child key of the edge
    (its first token, or a hashable tuple when the engine namespaces keys); no token sequence. Supports
    what :class:`CheckpointTree`'s shape-only code uses of a key: ``len``, ``item(0)`` and ``[0]`` (the
    ``children`` dict key)."""

    __slots__ = ("n", "first")

    def __init__(self, n: int, first: int) -> None:
        if n <= 0:
            raise ValueError(f"an edge has at least one token, got {n}")
        self.n = int(n)
        self.first = first

    def __len__(self) -> int:
        return self.n

    def item(self, i: int) -> Any:
        if i != 0:
            raise IndexError("a mirror edge stores its first token only")
        return self.first

    def __getitem__(self, i: int) -> Any:
        return self.item(i)

    def __repr__(self) -> str:
        return f"Span(n={self.n}, first={self.first})"


class MirrorError(RuntimeError):
    """An engine event does not fit the mirror (the mirror drifted from the engine's tree)."""


class MirrorTree(CheckpointTree):
    """A :class:`~sglang_sparse.tree.core.CheckpointTree` whose structure follows an engine tree's
    events (module docstring).

    ``root_id``: the engine's root node id. ``on_change``: called with every node an event changed
    (created, split, removed, state set/dropped, recency refreshed by :meth:`touch_path`). Other
    arguments as :class:`~sglang_sparse.tree.core.CheckpointTree`. No ``match`` / ``insert`` (no
    tokens): :meth:`match_result` builds a match from the engine's."""

    def __init__(
        self,
        kv_bytes_per_token: int,
        state_bytes: int,
        *,
        root_id: int = 0,
        on_change: Callable[[Node], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(kv_bytes_per_token, state_bytes, **kwargs)
        self.on_change = on_change
        self._set_root(root_id)

    def _set_root(self, root_id: int) -> None:
        self.root.uid = int(root_id)
        self._uid = max(self._uid, int(root_id))
        self.by_id: dict[int, Node] = {int(root_id): self.root}
        #: ids of the nodes holding a state at their end (what the engine holds)
        self.state_ids: set[int] = set()

    def reset(self, root_id: int) -> None:
        """Forget every node (the engine rebuilt its tree with root ``root_id``); keeps the
        configuration and the logical clock."""
        clock, uid, listener = self.clock, self._uid, self.listener
        CheckpointTree.__init__(self, self.kv_bytes_per_token, self.state_bytes, kv_ops=self.kv_ops)
        self.clock, self._uid, self.listener = clock, uid, listener
        self._set_root(root_id)
        if listener is not None:
            listener.on_reset()

    #: Not every edge end is a divergence point (``PlanTable.planned_captures`` captures none at
    #: the end of a *structural* edge): SGLang splits an edge at every state it ever inserted and
    #: keeps the boundary after the state is evicted, and the per-edge DP would plan each such end
    #: (its pass-through mass). An edge end that is neither a branch point (several children) nor
    #: where a sequence ended (``seq_end``) is structural (``docs/sparse_backend.md``, "Admission").
    edge_ends_diverge = False

    # ------------------------------------------------------------------ lookup

    def node(self, node_id: int) -> Node:
        """The mirror node of engine node ``node_id`` (:class:`MirrorError` if unknown)."""
        n = self.by_id.get(node_id)
        if n is None:
            raise MirrorError(f"engine node {node_id} is not in the mirror")
        return n

    def get(self, node_id: int) -> Node | None:
        return self.by_id.get(node_id)

    def _changed(self, *nodes: Node) -> None:
        cb = self.on_change
        if cb is not None:
            for n in nodes:
                cb(n)

    # ------------------------------------------------------------------ structural events

    def add_node(self, node_id: int, parent_id: int, length: int, first: Any) -> Node:
        """A new edge of ``length`` tokens with child key ``first`` (see :class:`Span`) under
        ``parent_id``."""
        if node_id in self.by_id:
            raise MirrorError(f"engine node {node_id} is already in the mirror")
        parent = self.node(parent_id)
        if first in parent.children:
            raise MirrorError(f"node {parent_id} already has a child starting with token {first}")
        node = Node(int(node_id), Span(length, first), parent.end, parent, None, self.clock)
        parent.children[first] = node
        self.by_id[node.uid] = node
        if node.uid > self._uid:
            self._uid = node.uid
        self.kv_tokens += node.num_tokens
        self.num_nodes += 1
        self.leaves.discard(parent)
        self.leaves.add(node)
        self._sync_evictable(parent)
        self._sync_evictable(node)
        self._changed(parent, node)
        return node

    def split_node(self, child_id: int, upper_id: int, k: int, lower_first: Any) -> Node:
        """The engine split ``child_id``'s edge after ``k`` tokens (``0 < k < len``): a new node
        ``upper_id`` holds the first ``k`` tokens; ``child_id`` keeps its identity, children and
        state and now has child key ``lower_first``. Returns the upper node."""
        node = self.node(child_id)
        if upper_id in self.by_id:
            raise MirrorError(f"engine node {upper_id} is already in the mirror")
        n = node.num_tokens
        if not 0 < k < n:
            raise MirrorError(f"split of node {child_id} ({n} tokens) at {k}")
        at = node.start + k
        parent = node.parent
        up = Node(int(upper_id), Span(k, node.key.first), node.start, parent, None, node.last_access)
        parent.children[node.key.first] = up
        node.key = Span(n - k, lower_first)
        node.start = at
        node.parent = up
        up.children[node.key.first] = node
        self._split_state(node, up, at)  # (states stay below: the engine keeps them at node ends)
        self.by_id[up.uid] = up
        if up.uid > self._uid:
            self._uid = up.uid
        self.num_nodes += 1
        self._sync_evictable(up)
        self._sync_evictable(node)
        self._changed(up, node)
        return up

    def remove_leaf(self, node_id: int) -> Node:
        """The engine deleted leaf ``node_id`` (its KV and any state with it)."""
        node = self.node(node_id)
        if node.children:
            raise MirrorError(f"engine removed node {node_id}, which has children in the mirror")
        parent = node.parent
        if parent.children.get(node.key.first) is not node:
            raise MirrorError(f"node {node_id} is not its parent's child")
        del self.by_id[node.uid]
        self.state_ids.discard(node.uid)
        self._unlink_leaf(node)
        self._changed(node, parent)
        return node

    def set_state(self, node_id: int, handle: Any | None = None) -> bool:
        """The engine now holds a state at the end of ``node_id`` (handle defaults to the id).
        Returns False if the mirror already had it (nothing changes)."""
        node = self.node(node_id)
        p = node.end
        if p in node.checkpoints:
            return False
        node.checkpoints[p] = node.uid if handle is None else handle
        node.ckpt_access[p] = self.clock
        self.num_states += 1
        self.state_ids.add(node.uid)
        self._sync_evictable(node)
        self._changed(node)
        return True

    def drop_state(self, node_id: int) -> bool:
        """The engine freed the state of ``node_id``. Returns False if the mirror had none."""
        node = self.by_id.get(node_id)
        if node is None or node.end not in node.checkpoints:
            return False
        del node.checkpoints[node.end]
        del node.ckpt_access[node.end]
        self.num_states -= 1
        self.state_ids.discard(node.uid)
        self._sync_evictable(node)
        self._changed(node)
        return True

    def touch_path(
        self, node_id: int, seq_end: bool = False, *, tick: bool = True, seq_len: int | None = None
    ) -> Node:
        """Refresh the recency of the path root -> ``node_id`` (an insert through it): advance the
        clock (``tick``) and write ``last_access`` on every path node, as :meth:`RadixTree.insert`
        does; ``seq_end``: the insert was a whole sequence, ending at ``node_id``'s end (see
        :attr:`Node.seq_end`), ``seq_len`` tokens long (default: ``node_id``'s end; a longer one is
        recorded in :attr:`Node.seq_tail`). Iterative; O(depth)."""
        node = self.node(node_id)
        if seq_end:
            node.seq_end = True
            node.seq_tail = max(0, int(seq_len) - node.end) if seq_len is not None else 0
        now = self.tick() if tick else self.clock
        n = node
        while n.parent is not None:
            n.last_access = now
            if not n.children:
                self._sync_evictable(n)
            n = n.parent
        if node.end in node.ckpt_access:
            node.ckpt_access[node.end] = now
        self._changed(node)
        return node

    # ------------------------------------------------------------------ matches

    def path_to(self, node_id: int) -> tuple[Node, ...]:
        """Nodes from the root's child down to ``node_id`` (empty for the root). Iterative."""
        node = self.node(node_id)
        out: list[Node] = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return tuple(out)

    def match_result(self, kv_node_id: int | None, kv_depth: int, resume_depth: int) -> MatchResult:
        """A :class:`MatchResult` of the engine's match: its KV match ends at ``kv_depth`` on the
        edge of ``kv_node_id`` (``None``/root: nothing matched) or, if that edge was split since,
        on the upper part holding ``kv_depth``; it resumes from the deepest state at or before
        ``resume_depth`` on that path. Raises :class:`MirrorError` if the engine's depths do not
        fit the mirror's path."""
        if kv_node_id is None or kv_node_id == self.root.uid or kv_depth <= 0:
            return _make_match(0, 0, self.root, None, None, (), None, ())
        node = self.node(kv_node_id)
        while node.parent is not None and kv_depth <= node.start:
            node = node.parent  # split since the engine's match: the depth is in an upper part
        if node.parent is None:
            return _make_match(0, 0, self.root, None, None, (), None, ())
        path = self.path_to(node.uid)
        last = path[-1]
        if not last.start < kv_depth <= last.end:
            raise MirrorError(
                f"engine match depth {kv_depth} is outside node {kv_node_id}'s edge "
                f"({last.start}, {last.end}]"
            )
        ck_node, ck_pos, ck_handle = None, 0, None
        for n in reversed(path):
            hit = n.deepest_checkpoint_at_or_before(min(resume_depth, kv_depth))
            if hit is not None:
                ck_node, (ck_pos, ck_handle) = n, hit
                break
        return _make_match(kv_depth, ck_pos, last, ck_node, ck_handle, path, None, ())

    # ------------------------------------------------------------------ checks

    def check_against(self, engine_nodes: Iterable[tuple[int, int | None, int, bool]]) -> None:
        """Assert the correspondence invariant against the engine's tree, described as
        ``(node_id, parent_id, edge_length, holds_state)`` for every non-root node; then the
        mirror's own invariants (:meth:`CheckpointTree.check`). Raises :class:`MirrorError`."""
        seen = 0
        for nid, pid, length, has_state in engine_nodes:
            seen += 1
            m = self.by_id.get(nid)
            if m is None:
                raise MirrorError(f"engine node {nid} is missing from the mirror")
            if m.parent is None or m.parent.uid != pid:
                raise MirrorError(
                    f"node {nid}: engine parent {pid}, mirror parent {m.parent and m.parent.uid}"
                )
            if m.num_tokens != length:
                raise MirrorError(f"node {nid}: engine edge {length} tokens, mirror {m.num_tokens}")
            mine = m.end in m.checkpoints
            if mine != bool(has_state) or len(m.checkpoints) > 1:
                raise MirrorError(
                    f"node {nid}: engine holds a state={bool(has_state)}, mirror checkpoints "
                    f"{list(m.checkpoints)} (end {m.end})"
                )
        held = {nid for nid, m in self.by_id.items() if m.checkpoints}
        if held != self.state_ids:
            raise MirrorError(f"state ids out of step: {sorted(held ^ self.state_ids)[:8]}")
        if seen != self.num_nodes or len(self.by_id) != self.num_nodes + 1:
            raise MirrorError(
                f"engine has {seen} nodes, mirror {self.num_nodes} ({len(self.by_id) - 1} by id)"
            )
        try:
            self.check()
        except AssertionError as e:  # CheckpointTree.check asserts
            raise MirrorError(f"mirror invariant broken: {e}") from None

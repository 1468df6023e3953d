"""Online sessions without session ids: *chains* of leaves continued from their end.

A multi-turn session (an agent, a chat) sends turn ``k + 1`` as turn ``k``'s whole sequence (input +
output) plus new tokens. In a radix tree that is visible from structure alone: the request's KV
match ends **exactly at the end of a leaf where a sequence ended** (:attr:`Node.seq_end`) and its
insert hangs a new leaf below it. :class:`ChainTracker` names such a run of leaves a *chain*, from
the structural events both the simulator and an engine mirror see (no tokens, no session ids):

* :meth:`ChainTracker.continuation` (at ``observe``, before the tree's): the request continues the
  leaf ``L`` its match ends on when ``kv_depth == L.end``, ``L`` has no children, and ``L`` is a
  sequence end or already on a chain (a chain's tip cut back to a state still ends the session's
  cached prefix); matches shallower than one grid step count for nothing (a shared chat header).
  :meth:`ChainTracker.arrive` (after the tree's ``observe``): the first continuation
  of ``L`` creates a chain (``L.chain``); every continuation records an arrival of the chain at the
  logical clock and marks ``L`` as the tip the request's sequence will hang from.
* :meth:`ChainTracker.end_sequence` (when a sequence ends at node ``N``: the simulator's insert, an
  engine's final insert): ``N`` joins the chain of the nearest ancestor that is on a chain or a
  sequence end (walking at most :data:`MAX_WALK` nodes up, through nodes an engine created for the
  same request's earlier chunks), if that ancestor is the chain's pending tip. One continuation adds
  one node: a chain is linear (a second request forking from the same turn does not join it).
* The upper part of a split keeps the chain of the node it was split from
  (:func:`~sglang_sparse.tree.radix.split_node_state`); a merge keeps the surviving child's.

Per chain (logical ticks of the tree's clock, the unit of eviction recency): ``last`` (the tick of
its latest arrival), ``gap_sum`` / ``gaps`` (the sum and count of its inter-arrival gaps; the first
gap is measured from the continued leaf's last access). Its **due** tick is ``last + gap_sum /
gaps``: when the session is expected back, from its own past only (on the agent trace a session's
mean gap in its first half predicts its second half). Invariants: ``gaps >= 1`` for every chain;
every live node's ``chain`` is ``-1`` or a key of :attr:`ChainTracker.chains`; the live chain nodes
of one chain lie on one root path and the chain's arrivals are exactly the requests that continued
it. All of them are on the path a continuing request observes, so the eviction index refreshes
every row whose due tick changed without a tree scan.

Prior (:meth:`ChainTracker.prior_gap`): a sequence-end leaf no chain holds (a session's first
turn, or a session whose chain was evicted and which starts over) is expected back after the mean
gap of all chains, while at least half of the requests whose match reaches such a leaf continue
it (:attr:`ChainTracker.continuation_share`, EW). The share ignores requests that miss everything,
so a thrashing cache does not switch its own prior off.

Use (:mod:`.eviction`, ``EvictionConfig.chain_recency``): a candidate on a chain is scored by how
soon its session is due back; superseded states of older turns keep their own recency, set back.
What the sessions know in the simulator and on an engine mirror is the same: the test
``tests/test_tree_mirror_sessions.py`` checks equal chains and arrival statistics.

Cost: :meth:`~ChainTracker.arrive` O(1), :meth:`~ChainTracker.end_sequence` O(:data:`MAX_WALK`),
:meth:`~ChainTracker.collect` O(nodes) once the table doubles (amortised O(1) per chain created).
Chain ids are never reused, so a stale id can only miss, never name another session. Everything is
a deterministic function of the event stream (ints; the due tick is one float division).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sglang_sparse.placement import DEFAULT_GRID
from sglang_sparse.tree import MatchResult, Node, sequence_leaf

#: how many nodes :meth:`ChainTracker.end_sequence` walks up from a sequence's last node
MAX_WALK = 64
#: decay per observation of the continuation share (:attr:`ChainTracker.continuation_share`)
PRIOR_GAMMA = 0.99


@dataclass(slots=True)
class Chain:
    """One online session: ``last`` arrival tick, ``gap_sum`` ticks over ``gaps`` gaps (>= 1),
    ``pending``: uid of the tip the next sequence end joins from (``-1``: none)."""

    last: int
    gap_sum: int
    gaps: int
    pending: int = -1

    @property
    def due(self) -> float:
        """The tick the session is expected back: ``last + gap_sum / gaps``."""
        return self.last + self.gap_sum / self.gaps

    @property
    def mean_gap(self) -> float:
        """Mean ticks between its arrivals."""
        return self.gap_sum / self.gaps


class ChainTracker:
    """Chains and their arrival statistics (module docstring). Plain data: copies with
    ``copy.deepcopy`` / ``pickle`` (no node references; tips are kept by uid)."""

    def __init__(self, gamma: float = PRIOR_GAMMA, grid: int = DEFAULT_GRID) -> None:
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must be in (0, 1), got {gamma}")
        #: matches shallower than this (tokens) are neither continuations nor evidence (a shared
        #: chat header is not a session)
        self.grid = int(grid)
        #: chain id -> its statistics (ids are never reused)
        self.chains: dict[int, Chain] = {}
        self.next_id = 0
        #: table size that triggers the next :meth:`collect` (amortised garbage collection)
        self.collect_at = 64
        #: continuations seen / sequence ends that joined a chain (diagnostics)
        self.arrivals = 0
        self.joins = 0
        #: every chain's gaps so far: sum (ticks) and count (the prior of a chain-less leaf)
        self.gap_sum = 0
        self.gaps = 0
        #: EW share of the requests reaching a sequence-end leaf that continued it from its end:
        #: numerator and denominator (decay ``gamma`` per such request)
        self.gamma = float(gamma)
        self._cont = 0.0
        self._reach = 0.0

    # ------------------------------------------------------------------ queries

    def due(self, chain: int) -> float | None:
        """The due tick of chain ``chain`` (``None``: no chain, or one already collected)."""
        c = self.chains.get(chain) if chain >= 0 else None
        return None if c is None else c.due

    @property
    def continuation_share(self) -> float:
        """EW share (decay ``gamma`` per observation) of the requests whose KV match ended on a
        sequence-end leaf (or a chain's leaf) that continued it from its end; 0 before any. A
        workload property more than a cache one: requests that miss everything do not count, so a
        thrashing cache does not switch the prior off (measured: agent at 10% of the footprint,
        0.18 with a share over all requests, 0.24 with this one)."""
        return self._cont / self._reach if self._reach else 0.0

    def prior_gap(self) -> float | None:
        """The gap (ticks) after its last access at which a leaf no chain holds yet is expected
        back: the mean gap of every chain so far, while :attr:`continuation_share` is at least 1/2
        (a session workload: a new sequence is likely a session's first turn, or one whose chain
        was evicted); ``None`` otherwise (such leaves keep their own recency)."""
        if not self.gaps or 2.0 * self._cont < self._reach:
            return None
        return self.gap_sum / self.gaps

    # ------------------------------------------------------------------ events

    def continuation(self, match: MatchResult) -> Node | None:
        """The leaf ``match`` continues from its end (a session's next turn), else ``None``. Call
        once per request, before the tree's ``observe`` (it counts the request for
        :attr:`continuation_share`; it does not change the tree)."""
        node = match.node
        if match.kv_depth < self.grid or node.parent is None:
            return None
        leaf = sequence_leaf(node, chains=True)  # the match may end one engine split above it
        if leaf is None:
            return None
        g = self.gamma
        cont = match.kv_depth == leaf.end
        self._reach = g * self._reach + 1.0
        self._cont = g * self._cont + (1.0 if cont else 0.0)
        return leaf if cont else None

    def arrive(self, leaf: Node, now: int, previous_access: int) -> int:
        """Record that a request continued ``leaf`` at tick ``now``; ``previous_access``: the leaf's
        ``last_access`` before this request's ``observe`` (the first gap of a new chain). Returns
        the chain id. Makes ``leaf`` the chain's pending tip."""
        self.arrivals += 1
        c = self.chains.get(leaf.chain) if leaf.chain >= 0 else None
        if c is None:
            cid = self.next_id
            self.next_id += 1
            gap = max(1, int(now) - int(previous_access))
            c = Chain(last=int(now), gap_sum=gap, gaps=1)
            self.chains[cid] = c
            leaf.chain = cid
        else:
            gap = max(1, int(now) - c.last)
            c.gap_sum += gap
            c.gaps += 1
            c.last = int(now)
        self.gap_sum += gap
        self.gaps += 1
        c.pending = leaf.uid
        return leaf.chain

    def end_sequence(self, node: Node) -> int:
        """A sequence ended at ``node``: it joins the chain of its pending tip above it, if any
        (module docstring), with the nodes between them (an engine's nodes for the same request's
        earlier checkpoints, which the simulator's insert holds on one edge). Returns
        ``node.chain``."""
        if node.chain >= 0 or node.parent is None:
            return node.chain
        between: list[Node] = []
        u = node.parent
        for _ in range(MAX_WALK):
            if u.parent is None or u.chain >= 0 or u.seq_end:
                break
            between.append(u)
            u = u.parent
        if u.parent is None or u.chain < 0:
            return -1
        c = self.chains.get(u.chain)
        if c is None or c.pending != u.uid:
            return -1
        node.chain = u.chain
        for b in between:
            b.chain = u.chain
        c.pending = -1
        self.joins += 1
        return node.chain

    def collect(self, nodes: Iterable[Node], *, force: bool = False) -> int:
        """Drop the chains no live node references, once the table has doubled since the last
        collection (``force``: now). ``nodes``: every live node. Returns the number dropped."""
        if not force and len(self.chains) < self.collect_at:
            return 0
        live = {n.chain for n in nodes if n.chain >= 0}
        dead = [cid for cid in self.chains if cid not in live]
        for cid in dead:
            del self.chains[cid]
        self.collect_at = max(64, 2 * len(self.chains))
        return len(dead)

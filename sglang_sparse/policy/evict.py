"""Evict: candidate enumeration, scoring, the incremental candidate index and the evict-to-budget loop.

The one module for *what leaves the cache*: every candidate's terms are defined once
(:meth:`CandidateTerms.node_terms`), the index caches them in numpy columns, and one round loop
(:meth:`Evictor.evict`) removes the lowest-scored candidates.

Candidate kinds (what one eviction step removes):

* ``leaf``: an unlocked leaf edge with its KV and all its checkpoints.
* ``node_states``: all checkpoints of an unlocked single-child node, which is then merged into its
  child (Marconi's treatment of intermediate nodes).
* ``ckpt``: one checkpoint (thins an edge, keeps its KV). ``ckpt_scope`` says which ones are
  candidates: ``"all"`` or ``"interior"`` (all but the deepest checkpoint of each edge, which the
  ``leaf``/``node_states`` candidates cover).

Score (lowest evicted first; :func:`candidate_score`), over the candidates present when the round
starts, with the efficiency ``e`` min-max normalised to ``[0, 1]`` and ``t`` a candidate's clock:

* Marconi (``recency_scale=None``): ``S = t' + alpha * e`` with ``t'`` min-max normalised too (no
  bound on how long an efficient item outlives newer ones).
* Decayed recency (``recency_scale=tau``, logical ticks): ``S = (t - t_min) / tau + ln(1 + alpha *
  e)``, the log of ``exp(-age / tau) * (1 + alpha * e)``: a reuse chance that decays with age times
  the value of a hit. Invariant (servable candidates of one round): a candidate is evicted before
  every candidate whose clock is more than ``tau * ln(1 + alpha)`` ticks newer, whatever their
  efficiencies.

``alpha = 0`` is pure LRU in both forms. Recency is a logical clock: ``node.last_access`` for
leaf/node candidates; for checkpoints either their own clock (``ckpt_recency="own"``: created or
last used as resume point; SGLang's per-component LRU) or the edge's (``"node"``). With
``chain_recency`` a candidate on an online session (:mod:`.choose`) is scored with the clock of
:func:`effective_recency` (its session's predicted return; a superseded state of an older turn keeps
its own clock, set back ``superseded_demotion`` ticks). Efficiency is FLOPs saved per byte
(Marconi's): each checkpoint at ``c`` saves ``prefill_flops(c - f, past=f)`` per hit, ``f`` the next
checkpoint up the path (the cost model's :meth:`node_flops_saved`).

Candidates exposed during a round (a parent becoming a leaf) are scored with the round's constants
(and its ``now``); single-child checkpoint-free unlocked nodes left behind are merged into their
child. Everything is deterministic (ties broken by node uid and position).

Implementation. ``ReferenceEvictor`` (tests/eviction_reference.py) is the specification: it
re-enumerates and re-scores every candidate each round (O(n) Python). :class:`Evictor` makes the
same decisions (same items freed in the same order, same tree afterwards;
``tests/test_policy_eviction.py``) from :class:`CandidateIndex`: a round scores the rows vectorised
and pops them in ``(score, uid, pos, kind)`` order (:meth:`CandidateIndex.order`, a lazy partial
sort), merged with a heap of the candidates exposed during the round -- exactly the reference heap's
order. Cost of a round: the changed nodes' refresh plus a few O(n) numpy passes (back-to-back
rounds: step 3 below plus a few counter comparisons); after an eviction primitive called from
outside, an O(n) signature rescan; the first round after construction or a copy builds the index
(O(n) scoring, as one reference round).

The candidate index (:class:`CandidateIndex`: exact, no tree hook needed)
-----------------------------------------------------------------------

Rows hold, for every live node, the raw terms of its candidates (:data:`Terms`, as ``node_terms``
defines them: the index computes no term). A node's rows depend on the node itself (its
:func:`_signature`, ``last_access``, its membership in the tree's ``evictable_leaves`` /
``evictable_ckpt_nodes``), on its session (:meth:`CandidateTerms.chain_terms`, in the signature: a
chain's due tick changes only when a request continues the chain, and every node of the chain is
then on that request's observed path, so step 2 below finds them; a child joins its parent's chain
at the end of an insert through both; the round-time parts -- ``now``, the demotion, the prior gap,
whether chain recency is on -- are applied by :meth:`CandidateIndex.effective_recency`), and on the
*inherited fallback* of its first checkpoint: the deepest checkpoint of the nearest ancestor holding
one (``tree.fallback_depth``). Each node caches ``down``, the fallback it passes to its children
(its deepest checkpoint, else its own inherited fallback); when a refreshed node's ``down`` changes,
its children are refreshed too (transitively, stopping where it is unchanged).

How :meth:`CandidateIndex.sync` finds changed nodes, relying on these properties of
:class:`~sglang_sparse.tree.RadixTree` (checked by the differential tests):

1. nodes the evictor itself changes during a round are recorded (:meth:`CandidateIndex.touch`);
2. ``insert`` and ``observe`` advance ``tree.clock`` and write ``last_access = clock`` on a whole
   path from the root, which contains every node they change. So the nodes with ``last_access``
   newer than the previous sync form a subtree hanging from the root: a descent through it (and
   through nodes never seen) finds them, at the cost of the children of those paths' nodes;
3. locks also cover whole root paths: a descent through locked nodes lists them; its difference with
   the previous list is the set of nodes whose lock state changed;
4. consistency check: the index's totals (nodes, states, KV tokens) and newest uid must equal the
   tree's. Anything else -- an eviction primitive called from outside (``drop_checkpoint`` /
   ``drop_leaf`` / ``split_at`` / ``truncate`` / ``merge_with_child``) -- breaks it and triggers a
   signature rescan (O(n)); should the totals still disagree, the index is rebuilt.

A found node is not refreshed when nothing its rows read changed
(:meth:`CandidateIndex._needs_refresh`): every request rewrites ``last_access`` on its whole path,
but with ``ckpt_recency="own"`` only the leaf's rows read it. A node's inherited fallback is its
parent's cached ``down`` (parents are refreshed before children), so a refresh is O(1) however long
the checkpoint-free path above it. Unsupported: writing node fields directly instead of calling
``RadixTree`` methods -- call :meth:`Evictor.invalidate` afterwards.

Exactness: the rows are ``node_terms``'s values, so a from-scratch enumeration
(:meth:`CandidateIndex.verify`: fallbacks walked up the path, not inherited) holds bit-identical
values; the normalisation and score (:meth:`CandidateIndex.round_scores`) apply the reference's
float operations elementwise (IEEE-exact in numpy, no fused operations).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sglang_sparse.tree import CheckpointTree, Freed, Node

if TYPE_CHECKING:
    from .choose import ChainTracker
    from .cost_model import ModelCostModel


#: Candidate kinds (see the module docstring).
LEAF, NODE_STATES, CKPT = 0, 1, 2
#: the per-row numpy columns (see :class:`CandidateIndex`)
_COLUMNS = ("rec", "val", "dead", "prob", "chn", "due", "sup", "prv", "uid", "pos", "kind")
_UNKNOWN = -2  # ``down`` of a node that was never computed (forces its children to refresh)


class _Info:
    """What the index knows about one registered node (its state at the last refresh)."""

    __slots__ = ("version", "last", "nch", "nck", "ntok", "down", "inh", "sig", "slots")

    def __init__(self) -> None:
        self.version = -1
        self.last = -1
        self.nch = 0  # len(children)
        self.nck = 0  # len(checkpoints)
        self.ntok = 0  # KV tokens of the edge
        self.down = _UNKNOWN  # fallback depth (tokens) inherited by the children
        self.inh = _UNKNOWN  # fallback depth this node inherited at its last refresh
        self.sig: tuple | None = None  # _signature() at the last refresh
        self.slots: list[int] = []  # column rows of this node's candidates


def _signature(node: Node, probation: Mapping[Any, int], chain: tuple[float | None, bool]) -> tuple:
    """Everything a node's rows depend on besides ``last_access`` and its inherited fallback:
    identity/edge (``version``), children count, lock, liveness, checkpoints, their clocks, which of
    them are on probation (a handful per node) and its chain terms (``chain_terms``)."""
    items = node.checkpoints.items()
    return (
        node.version,
        len(node.children),
        node.lock_ref > 0,
        node.alive,
        tuple(items),
        tuple(node.ckpt_access.items()),
        tuple(probation.get(h, 0) for _, h in items),
        chain,
    )


#: Probation tiers (values of ``CandidateTerms.probation``): a plan's first-sight guess, and a state
#: the engine offered that no plan asked for (kept because it cost nothing; goes before the guesses).
PROBATION, SPARE = 1, 2
#: Heap key of a candidate all of whose states are on probation: ``PROBATION_KEY + recency``
#: (finite, below every servable candidate's score, which is >= 0 in both score forms, and above an
#: unservable one's ``-inf``), so they go first, oldest first; spare ones before them (``SPARE_KEY +
#: recency``). Ticks stay exact up to 2**52 - 2e15 (~2.5e15).
PROBATION_KEY = -1e15
SPARE_KEY = -2e15


class ChainClock(NamedTuple):
    """What a round with chain recency needs besides the terms (:func:`effective_recency`): ``now``
    (the tree's clock when the round starts), ``demote`` and ``prior`` (ticks;
    :meth:`~.choose.ChainTracker.prior_gap`, ``None``: no prior)."""

    now: float
    demote: float
    prior: float | None


#: ``(rmin, rspan, vmin, vspan, clock)``: a round's constants (see :func:`round_constants`);
#: ``clock`` is ``None`` without chain recency
Constants = tuple[float, float, float, float, ChainClock | None]

#: A candidate's raw terms (``Evictor.node_terms``): ``(recency tick, FLOPs/byte, bytes, unservable,
#: probation, due tick of its chain or None, superseded, provisional)``
Terms = tuple[float, float, int, bool, bool, float | None, bool, bool]


def round_constants(
    rec_min: float,
    rec_max: float,
    val_min: float,
    val_max: float,
    recency_scale: float | None,
    clock: ChainClock | None = None,
) -> Constants:
    """A round's constants: recency ``(t - rmin) / rspan`` (``t`` the :func:`effective_recency`;
    ``rspan`` = ``recency_scale`` ticks when set, else the recency range), efficiency ``(v - vmin)
    / vspan`` (its range); a zero range is replaced by 1; ``clock``: see :class:`ChainClock`."""
    rspan = recency_scale if recency_scale is not None else (rec_max - rec_min) or 1.0
    return rec_min, rspan, val_min, (val_max - val_min) or 1.0, clock


def effective_recency(
    rec: float, due: float | None, sup: bool, prov: bool, clock: ChainClock | None
) -> float:
    """The recency tick a candidate is scored with (the one definition; float operations in this order,
    which :meth:`CandidateIndex.effective_recency` repeats vectorised). ``rec`` without chain recency
    (``clock is None``) or off a chain (``due is None``). On a chain, ``now - w`` with ``w = due - now``
    the ticks until its session is due back (``2 - w`` once ``w < 1``: it ages one tick per tick
    overdue): a session due soon ranks as just used, the slowest sessions go first and sessions that
    stopped coming back age out. A provisional candidate (``prov``: a sequence-end leaf no chain holds,
    i.e. a first turn or a session whose chain was evicted) counts as on a chain with ``due = rec +
    prior`` when the tracker has a prior gap. A superseded state (``sup``, only on a chain: an older
    turn's, on a node whose only child continues its chain or above a deeper state on its node) is not
    what the session's return resumes from: it keeps its own ``rec`` (its last use as a resume point: a
    fork from that turn, a fit state below a tip the device cannot hold), set back ``demote`` ticks."""
    if clock is None:
        return rec
    now, demote, prior = clock
    if sup:
        return rec - demote
    if due is None:
        if not prov or prior is None:
            return rec
        due = rec + prior
    w = due - now
    if not w >= 1.0:
        w = 2.0 - w
    return now - w


_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
#: ``1 / (2k + 1)``, k = 11 .. 0: the atanh series of :func:`det_log1p`, Horner order
_ATANH_COEFFS = tuple(1.0 / (2 * k + 1) for k in range(11, -1, -1))


def det_log1p(x: np.ndarray) -> np.ndarray:
    """``ln(1 + x)`` for ``x >= 0`` (float64 array) from IEEE basic operations only (``frexp``, ``+``,
    ``-``, ``*``, ``/``, each correctly rounded), so bitwise identical on every machine and for every
    array length: numpy's own ``log1p`` may use SIMD kernels (SVML) that differ from libm in the
    last bit by CPU generation, and a score that differs by one ulp across TP ranks could order two
    candidates differently. ``1 + x = m * 2**e`` with ``m`` in ``[sqrt(1/2), sqrt(2))``,
    ``ln m = 2 atanh(s)``, ``s = (m - 1) / (m + 1)`` in ``(-0.172, 0.172)``, 12 series terms:
    absolute error below ``1e-15`` (``x = 0`` gives exactly 0)."""
    m, e = np.frexp(1.0 + x)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)
    e = e - low
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    acc = np.full_like(s, _ATANH_COEFFS[0])
    for c in _ATANH_COEFFS[1:]:
        acc *= s2
        acc += c
    return e * _LN2 + 2.0 * s * acc


def candidate_score(c: Terms, k: Constants, alpha: float, decayed: bool) -> float:
    """Score of one candidate's terms ``c`` (:data:`Terms`) under the round's constants ``k``:
    ``-inf`` if unservable, ``PROBATION_KEY`` / ``SPARE_KEY`` + its own recency tick if on probation,
    else the normalised :func:`effective_recency` plus ``alpha * e``, or ``ln(1 + alpha * e)`` when
    ``decayed`` (``e`` clamped at 0: a candidate exposed during a round can lie below the round's
    minimum). :meth:`CandidateIndex.round_scores` repeats the float operations vectorised."""
    if c[3]:
        return -math.inf
    if c[4]:
        return (SPARE_KEY if c[4] == SPARE else PROBATION_KEY) + c[0]
    rmin, rspan, vmin, vspan, clock = k
    r = (effective_recency(c[0], c[5], c[6], c[7], clock) - rmin) / rspan
    if decayed:
        return r + float(det_log1p(np.array([max(0.0, alpha * (c[1] - vmin) / vspan)]))[0])
    return r + alpha * (c[1] - vmin) / vspan


class CandidateIndex:
    """Columns of the raw candidate terms, kept equal to ``node_terms`` of every live node.

    Invariant after :meth:`sync`: rows ``0 .. n-1`` are exactly the candidates of
    ``Evictor.candidates()``, one row each: ``rec``, ``val`` (0.0 while values are off), ``dead``,
    ``prob``, ``due`` (with ``chn``: on a session; 0.0 off one), ``sup``, ``prv`` its :data:`Terms`,
    ``uid``/``pos``/``kind`` the tie-break keys, ``node``/``ver`` the node and its ``version``. Row
    order is arbitrary (swap-remove).
    """

    def __init__(self, ev: CandidateTerms) -> None:
        self.ev = ev
        self.built = False
        self.pending: set[Node] = set()
        #: full rebuilds / signature rescans so far (diagnostics: both are O(n))
        self.builds = self.rescans = 0

    # ------------------------------------------------------------------ columns

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self.n = 0
        self.rec = np.empty(cap, dtype=np.float64)
        self.val = np.empty(cap, dtype=np.float64)
        self.dead = np.empty(cap, dtype=np.bool_)
        self.prob = np.empty(cap, dtype=np.int8)
        self.chn = np.empty(cap, dtype=np.bool_)
        self.due = np.empty(cap, dtype=np.float64)
        self.sup = np.empty(cap, dtype=np.bool_)
        self.prv = np.empty(cap, dtype=np.bool_)
        self.uid = np.empty(cap, dtype=np.int64)
        self.pos = np.empty(cap, dtype=np.int64)
        self.kind = np.empty(cap, dtype=np.int64)
        self.node: list[Node] = []
        self.ver: list[int] = []
        self._scratch()

    def _scratch(self) -> None:
        """Per-round work arrays, reused (a fresh 100+ KB array per round costs page faults)."""
        cap = self.cap
        self._score, self._key, self._rem, self._tmp, self._eff, self._wait = (
            np.empty(cap, dtype=np.float64) for _ in range(6)
        )

    def _grow(self) -> None:
        cap = self.cap * 2
        for name in _COLUMNS:
            old = getattr(self, name)
            new = np.empty(cap, dtype=old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)
        self.cap = cap
        self._scratch()

    def _add_row(
        self,
        node: Node,
        info: _Info,
        kind: int,
        pos: int,
        r: float,
        v: float,
        d: bool,
        pb: int,
        due: float | None = None,
        sup: bool = False,
        prv: bool = False,
    ) -> None:
        i = self.n
        if i == self.cap:
            self._grow()
        self.rec[i] = r
        self.val[i] = v
        self.dead[i] = d
        self.prob[i] = pb
        self.chn[i] = due is not None
        self.due[i] = 0.0 if due is None else due
        self.sup[i] = sup
        self.prv[i] = prv
        self.uid[i] = node.uid
        self.pos[i] = pos
        self.kind[i] = kind
        self.node.append(node)
        self.ver.append(node.version)
        info.slots.append(i)
        self.n = i + 1

    def _drop_rows(self, info: _Info) -> None:
        """Remove a node's rows (swap-remove, highest row first so the moved row is never its own)."""
        for i in sorted(info.slots, reverse=True):
            last = self.n - 1
            if i != last:
                for name in _COLUMNS:
                    col = getattr(self, name)
                    col[i] = col[last]
                moved = self.node[last]
                self.node[i] = moved
                self.ver[i] = self.ver[last]
                ms = self.nodes[moved].slots
                ms[ms.index(last)] = i
            self.node.pop()
            self.ver.pop()
            self.n = last
        info.slots = []

    # ------------------------------------------------------------------ per-node terms

    def _params(self) -> tuple:
        """What every row depends on besides the tree's contents (compared by identity/value). The
        config's ``recency_scale`` is not among them: it changes how a round combines the terms,
        not the terms."""
        ev = self.ev
        c = ev.config
        terms = (c.node_states, c.ckpt_scope, c.ckpt_recency, c.drop_unservable)
        return (ev.tree, terms, ev.cost, ev.capacity_bytes)

    def _params_changed(self) -> bool:
        old, new = self.params, self._params()
        return old[0] is not new[0] or old[1] != new[1] or old[2] is not new[2] or old[3] != new[3]

    def _needs_refresh(self, node: Node, info: _Info, inherited: int) -> bool:
        """Whether ``node``'s rows may differ from the ones computed at its last refresh. False only
        when nothing they depend on changed: same signature and inherited fallback, and no
        ``last_access`` the rows read (this spares a long path's interior nodes, whose only change
        is the recency every request writes on its whole path)."""
        ev = self.ev
        if (
            info.sig is None
            or inherited != info.inh
            or _signature(node, ev.probation, ev.chain_terms(node)) != info.sig
        ):
            return True
        cfg = self.ev.config
        if node.last_access == info.last:
            return False
        children, ck = node.children, node.checkpoints
        return (
            not children
            or (cfg.node_states and len(children) == 1 and bool(ck))
            or (cfg.ckpt_scope != "none" and bool(ck) and cfg.ckpt_recency != "own")
        )

    def _refresh(self, node: Node, info: _Info, inherited: int | None = None) -> bool:
        """Recompute ``node``'s rows and record its state; True if the fallback its children
        inherit (``down``) changed. ``inherited``: ``tree.fallback_depth(node, node.start + 1)`` when
        the caller knows it (the parent's ``down``), else it is computed (a walk up the path)."""
        ev = self.ev
        tree = ev.tree
        if info.slots:
            self._drop_rows(info)
        ck = node.checkpoints
        keys = ck.keys()
        if inherited is None:
            inherited = tree.fallback_depth(node, node.start + 1)
        chain = ev.chain_terms(node)
        # -- the candidates of this node (``node_terms``: the one definition)
        for kind, p, (r, v, _, d, pb, due, sup, prv) in ev.node_terms(
            node, inherited, need_value=self.values_on, chain=chain
        ):
            self._add_row(node, info, kind, p, r, v, d, pb, due, sup, prv)
        # -- bookkeeping (totals for the consistency check, eviction-index copies)
        nck, ntok = len(ck), node.num_tokens
        self.num_states += nck - info.nck
        self.kv_tokens += ntok - info.ntok
        info.version, info.last, info.nch, info.nck, info.ntok = (
            node.version,
            node.last_access,
            len(node.children),
            nck,
            ntok,
        )
        down = keys[-1] if keys else inherited
        changed = down != info.down
        info.down = down
        info.inh = inherited
        info.sig = _signature(node, ev.probation, chain)
        return changed

    def _register(self, node: Node) -> _Info:
        info = _Info()
        self.nodes[node] = info
        if node.uid > self.max_uid:
            self.max_uid = node.uid
        return info

    def _unregister(self, node: Node, info: _Info) -> None:
        if info.slots:
            self._drop_rows(info)
        self.num_states -= info.nck
        self.kv_tokens -= info.ntok
        self.locked.discard(node)
        del self.nodes[node]

    def _apply(self, work: Iterable[Node]) -> None:
        """Refresh ``work`` and what it implies: dead nodes are dropped, unknown parents (the upper
        half of a split) registered, children of nodes whose inherited fallback changed refreshed
        (all children of a new node)."""
        root = self.ev.tree.root
        nodes = self.nodes
        # Shallowest first (a node's children are pushed after it, so they come right after it):
        # a node's parent is then final when the node is reached, unless the parent is still
        # pending (an unknown parent pushed below, e.g. the upper half of a split).
        stack = sorted(work, key=lambda n: n.start, reverse=True)
        pending = set(stack)
        done: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in done or node is root:
                continue
            done.add(node)
            info = nodes.get(node)
            parent = node.parent
            if parent is not None and parent is not root and parent.alive and parent not in nodes:
                stack.append(parent)  # e.g. the upper half of a split (also of a truncated leaf)
                pending.add(parent)
            if not node.alive:
                if info is not None:
                    self._unregister(node, info)
                elif node.uid > self.max_uid:  # created and dropped since the last sync
                    self.max_uid = node.uid
                continue
            # The inherited fallback is the parent's ``down`` when that is final; else walk up.
            inherited = None
            if parent is root:
                inherited = 0  # (fallback_depth never looks at the root)
            elif parent is not None and (parent in done or parent not in pending):
                pinfo = nodes.get(parent)
                if pinfo is not None and pinfo.down != _UNKNOWN:
                    inherited = pinfo.down
            if info is None:
                info = self._register(node)
            elif inherited is not None and not self._needs_refresh(node, info, inherited):
                info.last = node.last_access
                continue
            if self._refresh(node, info, inherited):
                for c in node.children.values():
                    stack.append(c)
                    pending.add(c)

    # ------------------------------------------------------------------ sync

    def touch(self, node: Node) -> None:
        """Record that the evictor changed ``node`` (refreshed at the next :meth:`sync`)."""
        self.pending.add(node)

    def invalidate(self) -> None:
        """Forget everything; the next :meth:`sync` rebuilds from the tree."""
        self.built = False
        self.pending = set()

    def _totals_match(self) -> bool:
        tree = self.ev.tree
        return (
            len(self.nodes) == tree.num_nodes
            and self.num_states == tree.num_states
            and self.kv_tokens == tree.kv_tokens
            and self.max_uid >= tree._uid  # noqa: SLF001 - the uid counter: every new node bumps it
        )

    def build(self) -> None:
        """Register every node of the tree and compute all rows (O(n), the reference round's cost)."""
        ev = self.ev
        tree = ev.tree
        self.builds += 1
        self.params = self._params()
        self.values_on = ev.alpha > 0
        self._alloc(max(64, 2 * (tree.num_nodes + tree.num_states)))
        self.nodes: dict[Node, _Info] = {}
        self.num_states = self.kv_tokens = 0
        self.max_uid = tree._uid  # noqa: SLF001 - every live node has a uid <= the counter
        for node in tree.nodes():
            self._refresh(node, self._register(node))
        self.clock = tree.clock
        self.locked = self._locked()
        self.pending = set()
        self.built = True

    def _locked(self) -> set[Node]:
        """The locked nodes except the root (module docstring, step 3): cost ~ the children of
        locked nodes, not the tree."""
        out: set[Node] = set()
        stack = [self.ev.tree.root]
        while stack:
            for c in stack.pop().children.values():
                if c.lock_ref > 0:
                    out.add(c)
                    stack.append(c)
        return out

    def sync(self) -> None:
        """Bring the rows up to date with the tree (see the module docstring for how changes are found)."""
        ev = self.ev
        tree = ev.tree
        if not self.built or self._params_changed() or (ev.alpha > 0 and not self.values_on):
            self.build()
            return
        work = self.pending
        self.pending = set()
        nodes = self.nodes
        if tree.clock != self.clock:
            # insert / observe since the last sync (module docstring, step 2)
            t = self.clock
            stack = [tree.root]
            while stack:
                for c in stack.pop().children.values():
                    if c.last_access > t or c not in nodes:
                        work.add(c)
                        stack.append(c)
            self.clock = tree.clock
        locked = self._locked()
        if locked != self.locked:  # lock / unlock
            work.update(locked ^ self.locked)
            self.locked = locked
        if work:
            self._apply(work)
        if not self._totals_match():
            self._rescan()

    def _rescan(self) -> None:
        """Something changed the tree without advancing its clock (an external eviction primitive):
        compare every registered node's signature, register unknown nodes (new children of changed
        nodes or of the root, unknown parents); rebuild if the totals still disagree. O(n)."""
        tree = self.ev.tree
        nodes = self.nodes
        self.rescans += 1
        work = [
            n
            for n, i in nodes.items()
            if not n.alive
            or n.version != i.version
            or n.last_access != i.last
            or len(n.children) != i.nch
            or len(n.checkpoints) != i.nck
        ]
        for n in [tree.root, *work]:
            if n.alive:
                work.extend(c for c in n.children.values() if c not in nodes)
        self._apply(work)
        mine = (len(nodes), self.num_states, self.kv_tokens)
        if mine != (tree.num_nodes, tree.num_states, tree.kv_tokens):
            self.build()
            return
        self.max_uid = max(self.max_uid, tree._uid)  # noqa: SLF001 - nodes created and dropped since

    # ------------------------------------------------------------------ scoring

    def effective_recency(self, clock: ChainClock | None) -> np.ndarray:
        """:func:`effective_recency` of rows ``0 .. n-1`` (a work buffer, or the ``rec`` column
        itself when no row is on a chain or ``clock`` is ``None``), with the same float operations."""
        n = self.n
        rec = self.rec[:n]
        if clock is None:
            return rec
        now, demote, prior = clock
        chn = self.chn[:n]
        prv = self.prv[:n]
        use_prior = prior is not None and bool(prv.any())
        if use_prior:
            chn = chn | prv
        if not chn.any():
            return rec
        due = self.due[:n]
        if use_prior:
            due = np.where(prv, rec + prior, due)
        w = np.subtract(due, now, out=self._wait[:n])
        np.subtract(2.0, w, out=w, where=w < 1.0)
        r = np.subtract(now, w, out=w)
        sup = self.sup[:n]
        if sup.any():  # superseded (on a chain): its own recency, set back
            np.subtract(rec, demote, out=r, where=sup)
        eff = self._eff[:n]
        np.copyto(eff, rec)
        np.copyto(eff, r, where=chn)
        return eff

    def round_scores(self, alpha: float) -> tuple[np.ndarray, np.ndarray, Constants]:
        """``(score, key, constants)`` over rows ``0 .. n-1`` (``n > 0``; the arrays are work buffers,
        overwritten by the next call; ``constants`` as :func:`round_constants`, ``now`` = the tree's
        clock). ``score`` is :func:`candidate_score` of every row, probation and unservable parts aside,
        with the reference's constants and float operations (``val >= vmin`` on every row: the clamp is a
        no-op); ``key`` adds those parts (the round's heap key). With ``alpha == 0`` the efficiency term
        is exactly ``+0.0`` in the reference (``det_log1p(0.0) == 0.0``), so it is omitted (``x + 0.0 ==
        x`` for ``x >= 0``)."""
        n = self.n
        cfg = self.ev.config
        clock = self.ev.chain_clock()
        rec = self.effective_recency(clock)
        if alpha > 0:
            val = self.val[:n]
            vlo, vhi = float(val.min()), float(val.max())
        else:
            vlo = vhi = 0.0
        consts = round_constants(float(rec.min()), float(rec.max()), vlo, vhi, cfg.recency_scale, clock)
        rmin, rspan, vmin, vspan, _ = consts
        score = np.subtract(rec, rmin, out=self._score[:n])
        score /= rspan
        if alpha > 0:
            t = np.subtract(val, vmin, out=self._tmp[:n])
            t *= alpha
            t /= vspan
            if cfg.recency_scale is not None:
                t = det_log1p(t)
            score += t
        dead = self.dead[:n]
        key = self._key[:n]
        np.copyto(key, score)
        prob = self.prob[:n]
        if prob.any():
            np.copyto(key, self.rec[:n] + PROBATION_KEY, where=prob == PROBATION)
            np.copyto(key, self.rec[:n] + SPARE_KEY, where=prob == SPARE)
        if dead.any():
            np.putmask(key, dead, -np.inf)
        return score, key, consts

    def order(self, key: np.ndarray, exclude: np.ndarray | None = None) -> Iterator[int]:
        """Rows in ascending ``(key, uid, pos, kind)`` order, lazily: the first row costs one
        ``min`` pass; later rows come in chunks of geometrically growing size (``np.partition`` +
        ``lexsort`` of every row up to and including the chunk's largest key, so ties at a chunk
        boundary are never split). Requires finite or ``-inf`` keys (``+inf`` marks consumed rows).
        The returned arrays of :meth:`round_scores` and this iterator share work buffers: valid
        until the next round. ``exclude`` (bool mask over the rows): rows never yielded."""
        rem = self._rem[: len(key)]
        np.copyto(rem, key)
        left = len(rem)
        if exclude is not None:
            rem[exclude] = np.inf
            left -= int(np.count_nonzero(exclude))
        k = 1
        uid, pos, kind = self.uid, self.pos, self.kind
        while left:
            if k >= left:
                sel = np.flatnonzero(rem != np.inf)
            elif k == 1:
                sel = np.flatnonzero(rem == rem.min())
            else:
                sel = np.flatnonzero(rem <= np.partition(rem, k - 1)[k - 1])
            if len(sel) > 1:
                sel = sel[np.lexsort((kind[sel], pos[sel], uid[sel], rem[sel]))]
            rem[sel] = np.inf
            left -= len(sel)
            k *= 8
            yield from sel.tolist()

    # ------------------------------------------------------------------ testing

    def verify(self) -> None:
        """Assert the rows equal a from-scratch computation with ``Evictor.candidates()`` +
        ``Evictor._candidate()`` (tests call this after :meth:`sync`)."""
        ev = self.ev
        want = {}
        for kind, node, pos in ev.candidates():
            c = ev._candidate(kind, node, pos, need_value=self.values_on)  # noqa: SLF001
            if c is not None:
                want[(node.uid, pos, kind)] = (c[0], c[1], c[3], c[4], c[5], c[6], c[7], node.version)
        got = {}
        for i in range(self.n):
            key = (int(self.uid[i]), int(self.pos[i]), int(self.kind[i]))
            assert key not in got, f"duplicate row {key}"
            assert self.node[i].uid == key[0]
            got[key] = (
                float(self.rec[i]),
                float(self.val[i]),
                bool(self.dead[i]),
                int(self.prob[i]),
                float(self.due[i]) if self.chn[i] else None,
                bool(self.sup[i]),
                bool(self.prv[i]),
                self.ver[i],
            )
        assert got.keys() == want.keys(), (sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys()))
        for k, w in want.items():
            assert got[k] == w, (k, got[k], w)
        for node, info in self.nodes.items():
            assert node.alive
            for i in info.slots:
                assert self.node[i] is node
        assert len(self.nodes) == ev.tree.num_nodes


__all__ = ["CKPT", "LEAF", "NODE_STATES", "EvictionConfig", "Evictor", "ScoredCandidate"]


@dataclass(frozen=True)
class EvictionConfig:
    """Which candidates exist and how they are scored (see module docstring)."""

    node_states: bool = True
    ckpt_scope: str = "none"  # "none" | "interior" | "all"
    ckpt_recency: str = "node"  # "node" | "own"
    drop_unservable: bool = False  # evict candidates no request can ever resume from first
    recency_scale: float | None = None  # decayed recency time scale (ticks); None = min-max (Marconi)
    chain_recency: bool = False  # candidates on an online session: recency from its due tick
    superseded_demotion: float = 0.0  # ticks a superseded chain state's recency is set back

    def __post_init__(self) -> None:
        if self.recency_scale is not None and not self.recency_scale > 0:
            raise ValueError(f"recency_scale must be > 0 ticks or None, got {self.recency_scale!r}")
        if not 0.0 <= self.superseded_demotion < float("inf"):
            raise ValueError(
                f"superseded_demotion must be finite and >= 0 ticks, got {self.superseded_demotion!r}"
            )
        if self.ckpt_scope not in ("none", "interior", "all"):
            raise ValueError(f"ckpt_scope must be none|interior|all, got {self.ckpt_scope!r}")
        if self.ckpt_recency not in ("node", "own"):
            raise ValueError(f"ckpt_recency must be node|own, got {self.ckpt_recency!r}")


class ScoredCandidate(NamedTuple):
    """One eviction candidate and the score a round starting now gives it (see :meth:`Evictor.scores`).

    ``kind``: :data:`LEAF` / :data:`NODE_STATES` / :data:`CKPT`; ``pos``: the checkpoint depth
    (tokens) for ``CKPT``, -1 otherwise. ``score``: the round's score (module docstring;
    dimensionless, in ``[0, 1 + alpha]`` with min-max recency). ``unservable``: under
    ``drop_unservable`` evicted before every servable one whatever its score (key ``-inf``).
    """

    kind: int
    node: Node
    pos: int
    score: float
    unservable: bool


_Entry = tuple[float, int, int, int, Node, int]  # (score, uid, pos, kind, node, version): the heap key


class CandidateTerms:
    """Candidate enumeration and raw terms (:data:`Terms`) shared by :class:`Evictor` and its
    specification ``ReferenceEvictor`` in tests/eviction_reference.py (which differ only in how a
    round finds the lowest scores)."""

    def __init__(
        self,
        tree: CheckpointTree,
        config: EvictionConfig,
        cost: ModelCostModel | None,
        alpha: float = 0.0,
        capacity_bytes: int | None = None,
        probation: Mapping[Any, int] | None = None,
        chains: ChainTracker | None = None,
    ):
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if alpha > 0 and cost is None:
            raise ValueError("a FLOP-aware eviction (alpha > 0) needs a cost model")
        self.tree, self.config, self.cost, self.alpha = tree, config, cost, float(alpha)
        #: cache capacity (bytes); with ``config.drop_unservable`` a checkpoint at depth ``p`` whose
        #: path needs more (``p * kv_bytes_per_token + state_bytes > capacity_bytes``) is evicted first
        self.capacity_bytes = capacity_bytes
        #: state handle -> probation tier (:data:`PROBATION_KEY`), shared with the owner (e.g.
        #: :class:`~.cache.HybridCache`), which must :meth:`Evictor.touch` a node whose handles enter
        #: or leave it other than by an insert
        self.probation: Mapping[Any, int] = {} if probation is None else probation
        #: online sessions (shared with the owner; :func:`effective_recency`)
        self.chains = chains

    def _unservable(self, pos: int) -> bool:
        """Whether a checkpoint at depth ``pos`` can never be resumed from: its path KV plus the
        state exceed the whole cache, so it cannot stay cached together with its prefix."""
        cap = self.capacity_bytes
        if cap is None or not self.config.drop_unservable:
            return False
        return pos * self.tree.kv_bytes_per_token + self.tree.state_bytes > cap

    # ------------------------------------------------------------------ values

    def _ckpt_flops(self, node: Node, pos: int, fb: int | None = None) -> float:
        """FLOPs saved by the checkpoint at ``pos`` per hit. ``fb``: the fallback depth
        (``tree.fallback_depth(node, pos)``) when the caller knows it."""
        if fb is None:
            fb = self.tree.fallback_depth(node, pos)
        return self.cost.node_flops_saved(pos, fb)

    def chain_clock(self) -> ChainClock | None:
        """The chain part of a round starting now (``None`` without ``config.chain_recency``)."""
        cfg = self.config
        if not cfg.chain_recency:
            return None
        prior = self.chains.prior_gap() if self.chains is not None else None
        return ChainClock(float(self.tree.clock), float(cfg.superseded_demotion), prior)

    def chain_terms(self, node: Node) -> tuple[float | None, bool, bool]:
        """``(due, continued, provisional)`` of ``node`` (whatever ``config.chain_recency``: a
        round decides whether to use them, :meth:`chain_clock`): its chain's due tick (``None``: not
        on a chain, or no tracker), whether its only child is on the same chain (the session moved
        past this node: all its states are superseded), and whether it is a sequence-end leaf no
        chain holds (see :func:`effective_recency`)."""
        ch = self.chains
        if ch is None:
            return None, False, False
        due = ch.due(node.chain)
        children = node.children
        if due is None:
            return None, False, node.seq_end and not children
        if len(children) != 1:
            return due, False, False
        for c in children.values():
            return due, c.chain == node.chain, False
        return due, False, False  # pragma: no cover - one child

    def node_terms(
        self,
        node: Node,
        inherited: int | None = None,
        *,
        need_value: bool | None = None,
        chain: tuple[float | None, bool, bool] | None = None,
        leaf_only: bool = False,
    ) -> list[tuple[int, int, Terms]]:
        """The eviction candidates of ``node``, ``(kind, pos, terms)`` each (``pos`` -1 for the node
        kinds): the one definition the index's rows, :meth:`candidates` and the rounds read. Empty if
        ``node`` is the root, dead or locked. The kinds ``config`` enables (module docstring); a leaf's
        deepest ``CKPT`` also frees the KV below the checkpoint above it. ``terms``
        (:data:`~.evict.Terms`): recency (``ckpt_recency`` own: the checkpoint's), FLOPs saved per byte
        (computed iff ``need_value``, default ``alpha > 0``, else 0.0), bytes freed, unservable (every
        checkpoint it holds is: evicted first), probation tier (the lowest of its states: evicted next),
        its chain's due tick (``None`` off a chain), superseded (a checkpoint on a chain with a deeper
        state on its node or a continued node), provisional (a sequence-end leaf no chain holds; see
        :meth:`chain_terms`). ``inherited``: the fallback of the node's first checkpoint
        (``tree.fallback_depth(node, node.start + 1)``, walked when ``None``); ``chain``:
        ``chain_terms(node)`` when the caller has it; ``leaf_only``: just the ``LEAF`` candidate (a round
        exposing a new leaf)."""
        tree = self.tree
        if node.parent is None or not node.alive or node.lock_ref > 0:
            return []
        ck = node.checkpoints
        children = node.children
        if children and not ck:
            return []
        if need_value is None:
            need_value = self.alpha > 0
        keys = ck.keys()
        if need_value and keys:
            if inherited is None:
                inherited = tree.fallback_depth(node, node.start + 1)
            fbs = [inherited, *keys[:-1]]
            flops = [self._ckpt_flops(node, p, fb) for p, fb in zip(keys, fbs, strict=True)]
        else:
            flops = [0.0] * len(keys)
        prob = self.probation
        tiers = [prob.get(h, 0) for h in ck.values()] if prob else [0] * len(keys)
        lowest = min(tiers) if tiers else 0
        due, continued, prv = self.chain_terms(node) if chain is None else chain
        rec = float(node.last_access)
        out: list[tuple[int, int, Terms]] = []
        cfg = self.config
        if not children:
            nbytes = tree.node_bytes(node)
            dead = bool(ck) and self._unservable(keys[0])
            out.append((LEAF, -1, (rec, sum(flops) / max(nbytes, 1), nbytes, dead, lowest, due, False, prv)))
            if leaf_only:
                return out
        elif cfg.node_states and len(children) == 1:
            nbytes = len(ck) * tree.state_bytes
            dead = self._unservable(keys[0])
            out.append((NODE_STATES, -1, (rec, sum(flops) / nbytes, nbytes, dead, lowest, due, False, prv)))
        if cfg.ckpt_scope == "none" or not ck or leaf_only:
            return out
        own = cfg.ckpt_recency == "own"
        last = keys[-1]
        for i in range(len(keys) if cfg.ckpt_scope == "all" else len(keys) - 1):
            p = keys[i]
            nbytes = tree.state_bytes
            if not children and p == last:  # frees the dead KV tail as well
                above = keys[i - 1] if i > 0 else node.start
                nbytes += (node.end - above) * tree.kv_bytes_per_token
            sup = due is not None and (continued or p != last)
            r = float(node.ckpt_access[p]) if own else rec
            out.append(
                (CKPT, p, (r, flops[i] / nbytes, nbytes, self._unservable(p), tiers[i], due, sup, prv))
            )
        return out

    def _candidate(self, kind: int, node: Node, pos: int, *, need_value: bool | None = None) -> Terms | None:
        """The terms of one candidate of :meth:`node_terms` (``None``: not a candidate now)."""
        for k, p, terms in self.node_terms(node, need_value=need_value, leaf_only=kind == LEAF):
            if k == kind and p == pos:
                return terms
        return None

    def evict(self, target_bytes: int) -> Freed:
        """Evict until ``tree.bytes_used <= target_bytes`` or nothing evictable remains."""
        tree = self.tree
        freed = Freed()
        while tree.bytes_used > target_bytes:
            progressed = self._round(target_bytes, freed)
            if not progressed:
                break
        return freed

    def _round(self, target_bytes: int, freed: Freed) -> bool:
        """One eviction round (subclasses); ``False`` when nothing could be evicted."""
        raise NotImplementedError

    def candidates(self) -> list[tuple[int, Node, int]]:
        """Eligible candidates ``(kind, node, pos)`` in deterministic order (pos -1 for node kinds):
        the tree's eviction index enumerated (O(n)); only the reference rounds call it (scored
        candidates: :meth:`Evictor.scores`)."""
        tree = self.tree
        # only unlocked leaves and unlocked nodes holding checkpoints can be candidates (tree indexes)
        pool = sorted(tree.evictable_leaves | tree.evictable_ckpt_nodes, key=lambda n: n.uid)
        return [(k, node, p) for node in pool for k, p, _ in self.node_terms(node, need_value=False)]


class Evictor(CandidateTerms):
    """Scores candidates and evicts until a byte target is met: the decisions of ``ReferenceEvictor``
    from the incremental :class:`CandidateIndex` (module docstring). Copies (``copy.deepcopy``,
    pickling) drop the index; it is rebuilt at the copy's first round.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Arguments of :class:`CandidateTerms`."""
        super().__init__(*args, **kwargs)
        self._index = CandidateIndex(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_index"]  # rebuilt on demand: cheaper than copying it, and never stale
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index = CandidateIndex(self)

    def invalidate(self) -> None:
        """Drop the candidate index (rebuilt at the next round): needed only after changing the tree
        other than through :class:`~sglang_sparse.tree.RadixTree` methods."""
        self._index.invalidate()

    def touch(self, node: Node) -> None:
        """Record that ``node`` changed other than through the tree's clocked operations (an
        engine-driven mirror's structural events): refreshed at the next round without an O(n)
        rescan; exact when every changed node is touched."""
        self._index.touch(node)

    @property
    def index(self) -> CandidateIndex:
        """The incremental candidate index (read-only use: ``sync``, ``round_scores``, rows)."""
        return self._index

    def scores(self) -> list[ScoredCandidate]:
        """Every current candidate with the score an eviction round starting now would give it, in
        the order that round would pop them (ascending ``(score, uid, pos, kind)``, unservable ones
        first). Same candidates and normalisation as :meth:`evict`; does not change the tree.
        Cost: O(n) numpy + one Python object per candidate."""
        idx = self._index
        idx.sync()
        if idx.n == 0:
            return []
        score, key, _ = idx.round_scores(self.alpha)
        n = idx.n
        order = np.lexsort((idx.kind[:n], idx.pos[:n], idx.uid[:n], key))
        nodes = idx.node
        return [
            ScoredCandidate(k, nodes[i], p, s, d)
            for i, k, p, s, d in zip(
                order.tolist(),
                idx.kind[order].tolist(),
                idx.pos[order].tolist(),
                score[order].tolist(),
                idx.dead[:n][order].tolist(),
                strict=True,
            )
        ]

    # ------------------------------------------------------------------ loop

    def _round(self, target_bytes: int, freed: Freed) -> bool:
        """One round of the reference: rows from the index in key order (the round-start snapshot),
        merged with a heap of the candidates exposed during the round (same constants)."""
        tree = self.tree
        idx = self._index
        idx.sync()
        if idx.n == 0:
            return False
        _, key, consts = idx.round_scores(self.alpha)
        alpha, decayed = self.alpha, self.config.recency_scale is not None

        def score(c: Terms) -> float:
            return candidate_score(c, consts, alpha, decayed)

        # The index is not refreshed during the round: its rows stay the round-start snapshot.
        rows = idx.order(key)
        keys, uid, pos_, kind_, nodes, vers = key, idx.uid, idx.pos, idx.kind, idx.node, idx.ver

        def row_entry(i: int | None) -> _Entry | None:
            if i is None:
                return None
            return (float(keys[i]), int(uid[i]), int(pos_[i]), int(kind_[i]), nodes[i], vers[i])

        nxt = row_entry(next(rows, None))
        heap: list[_Entry] = []  # candidates exposed during the round
        touch = idx.touch
        progressed = False
        while (nxt is not None or heap) and tree.bytes_used > target_bytes:
            if nxt is not None and not (heap and heap[0] < nxt):
                entry = nxt
                nxt = row_entry(next(rows, None))
            else:
                entry = heapq.heappop(heap)
            _, _, pos, kind, node, version = entry
            if not node.alive or node.version != version or node.lock_ref > 0:
                continue
            if kind == LEAF:
                if node.children:
                    continue
                parent = node.parent
                freed.extend(tree.drop_leaf(node))
                touch(node)
                touch(parent)
                progressed = True
                self._after_change(parent, heap, score)
            elif kind == NODE_STATES:
                if len(node.children) != 1 or not node.checkpoints:
                    continue
                for p in list(node.checkpoints.keys()):
                    freed.extend(tree.drop_checkpoint(node, p))
                touch(node)
                progressed = True
                self._after_change(node, heap, score)
            else:
                if pos not in node.checkpoints:
                    continue
                deepest = pos == node.checkpoints.peekitem(-1)[0]
                freed.extend(tree.drop_checkpoint(node, pos))
                touch(node)
                progressed = True
                if deepest and not node.children:
                    self._drop_dead_tail(node, freed, heap, score)
                else:
                    self._after_change(node, heap, score)
        return progressed

    def _drop_dead_tail(
        self, leaf: Node, freed: Freed, heap: list[_Entry], score: Callable[[tuple], float]
    ) -> None:
        """After the deepest checkpoint of ``leaf`` was evicted, drop the leaf's KV below its new
        deepest checkpoint (all of the leaf if none is left): no request can resume there. As
        SGLang's MambaComponent (``_evict_device_next_node``: evicting a leaf's state evicts the leaf)."""
        tree = self.tree
        ck = leaf.checkpoints
        if ck:
            last = ck.peekitem(-1)[0]
            if last >= leaf.end:
                return
            dropped, up = tree.truncate(leaf, last)
            freed.extend(dropped)
            self._index.touch(up)
            self._after_change(up, heap, score)
            return
        parent = leaf.parent
        freed.extend(tree.drop_leaf(leaf))
        self._index.touch(parent)
        self._after_change(parent, heap, score)

    def _after_change(self, node: Node, heap: list[_Entry], score: Callable[[tuple], float]) -> None:
        """Merge a checkpoint-free single-child node; expose a new leaf as a candidate."""
        if node.parent is None or not node.alive or node.lock_ref > 0:
            return
        if len(node.children) == 1 and not node.checkpoints:
            child = self.tree.merge_with_child(node)
            self._index.touch(node)
            self._index.touch(child)
            c = self._candidate(LEAF, child, -1) if not child.children else None
            if c is not None:
                heapq.heappush(heap, (score(c), child.uid, -1, LEAF, child, child.version))
            return
        if not node.children:
            c = self._candidate(LEAF, node, -1)
            if c is not None:
                heapq.heappush(heap, (score(c), node.uid, -1, LEAF, node, node.version))

"""The published baselines of Marconi (Pan et al., MLSys '25), re-implemented from the authors' simulator.

Reference: github.com/ruipeterpan/marconi, commit ``08016617b1524e6bf6ac29b680641cc945bda7f0``
(CC BY-NC 4.0; not vendored here). Each class below follows one file of it line by line, including
its bookkeeping quirks (listed per class), so that replaying a trace gives the same per-request hits
as the reference (``benchmarks/baseline_fidelity.py`` checks this against the reference code itself).
The improved variants of the same ideas are the registry policies ``lru``, ``marconi``, ``block32``
(:mod:`sglang_sparse.policy.registry`); these are the ``*_published`` ones, simulator-only (the trace
replay is :mod:`.published`).

Common to all three (``policy_exploration.py: run_trace_with_config``): per request,
``match_prefix(input)`` then ``insert(input + output)``; the cache is a radix tree in which **every
node holds one recurrent state** at its end (so a prefix is reusable only up to the deepest node it
covers completely); logical clocks (one tick per ``match_prefix``, ``insert`` and ``evict`` call);
eviction runs *before* an insertion, sized by an estimate of the bytes the insertion adds, and the
insertion then happens whatever its real size (a soft cap: the tree may exceed the capacity).
Nothing is locked: eviction may remove the path the current request just matched.

Metrics (``radix_cache_hybrid.py: RadixCache.get_cache_stats``): token hit rate = reused input tokens
/ input tokens (a request whose whole input ends at a node reuses all of it); request hit rate =
share of requests reusing >= 1 token; FLOPs saved = per request
``L_ssm * mamba1(h) + L_attn * attn(h) + L_mlp * mlp(h)`` for ``h`` reused tokens (``utils.py``).

Units: tokens, bytes, FLOPs; clocks are logical ticks.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sglang_sparse.policy.cost_model import ModelCostModel
from sglang_sparse.policy.registry import get_published
from sglang_sparse.policy.tuner import AlphaTuner
from sglang_sparse.tree.lcp import lcp

#: ``config_tuner.py: ConfigTuner.tune_config`` default ``weights``
MARCONI_ALPHA_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(21))
#: ``radix_cache_hybrid.py: RadixCache.tuning_interval``: the tuner scores the last 500 replayed requests
MARCONI_TUNING_LAST_N = 500
#: ``radix_cache_hybrid.py: RadixCache.__init__`` default ``bootstrap_multiplier`` (15 for LMSys)
MARCONI_BOOTSTRAP_MULTIPLIER = 5

REFERENCE_COMMIT = "08016617b1524e6bf6ac29b680641cc945bda7f0"


# ---------------------------------------------------------------------------------------------- models


class PublishedModel(Protocol):
    """Byte and FLOP accounting the published caches need (bytes, FLOPs; counts may be fractional)."""

    def states_bytes(self, count: float) -> float:
        """Bytes of ``count`` recurrent states (all recurrent layers)."""
        ...

    def kv_bytes(self, tokens: float) -> float:
        """KV bytes of ``tokens`` tokens (all attention layers)."""
        ...

    def node_flops_saved(self, total: int, parent: int) -> float:
        """Marconi's eviction numerator: FLOPs a node ending at depth ``total`` saves over its parent
        ending at depth ``parent`` (tokens)."""
        ...

    def request_flops_saved(self, hit: int) -> float:
        """FLOPs saved by a request reusing ``hit`` tokens (also its prefill FLOPs for ``hit`` = input)."""
        ...


@dataclass(frozen=True)
class MarconiModel:
    """The reference's model config and formulas (``utils.py``; defaults of ``policy_exploration.py``:
    NVIDIA's Attention-Mamba2 hybrid 7B, arXiv 2406.07887: 24 SSM, 4 attention, 28 MLP layers,
    ``d = 4096``, ``n = 128``, fp16, conv kernel 4, expand 2).

    Bytes: a state is ``d*n*2 + (expand*d + 2n)*conv_kernel*2`` per SSM layer (1,116,160 B; 26.8 MB
    for 24 layers); KV is ``2*l*d*2`` per attention layer (64 KiB per token for 4 layers; no GQA).
    FLOPs (forward): ``attn(l) = 8 l d^2 + 4 l^2 d``, ``mlp(l) = 16 l d^2``,
    ``mamba1(l) = 12 l d^2 + 16 l d n + 10 l d``. Integer arithmetic in the reference's operation
    order, so that every comparison matches it bit for bit."""

    num_ssm_layers: int = 24
    num_attn_layers: int = 4
    num_mlp_layers: int = 28
    d: int = 4096
    n: int = 128
    conv_kernel: int = 4
    expand: int = 2

    @property
    def mamba_state_size(self) -> int:
        """``utils.get_mamba_state_size``: bytes of one SSM layer's state (SSM + conv)."""
        return self.d * self.n * 2 + (self.expand * self.d + 2 * self.n) * self.conv_kernel * 2

    @property
    def state_bytes(self) -> int:
        """Bytes of one state over all SSM layers."""
        return self.num_ssm_layers * self.mamba_state_size

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token over all attention layers (``num_attn_layers * get_kvs_size(1, d)``)."""
        return self.num_attn_layers * self.kvs_size(1)

    def kvs_size(self, l: float) -> float:  # noqa: E741 - the reference's name
        """``utils.get_kvs_size``: KV bytes of ``l`` tokens in one attention layer."""
        return 2 * l * self.d * 2

    def states_bytes(self, count: float) -> float:
        return count * self.num_ssm_layers * self.mamba_state_size

    def kv_bytes(self, tokens: float) -> float:
        return self.num_attn_layers * self.kvs_size(tokens)

    def attn_flops(self, l: int) -> int:  # noqa: E741
        """``utils.get_attn_flops`` (one layer)."""
        return 8 * l * self.d**2 + 4 * l**2 * self.d

    def mlp_flops(self, l: int) -> int:  # noqa: E741
        """``utils.get_mlp_flops`` (one layer)."""
        return 16 * l * self.d**2

    def mamba1_flops(self, l: int) -> int:  # noqa: E741
        """``utils.get_mamba1_flops`` (one layer, the corrected camera-ready formula)."""
        return 12 * l * self.d**2 + 16 * l * self.d * self.n + 10 * l * self.d

    def node_flops_saved(self, total: int, parent: int) -> int:
        """``radix_cache_hybrid.py: RadixCache.evict_v2`` numerator, verbatim: its MLP term subtracts
        the parent's *attention* FLOPs (``get_mlp_flops(total) - get_attn_flops(parent)``)."""
        mamba = self.num_ssm_layers * self.mamba1_flops(total - parent)
        attn = self.num_attn_layers * (self.attn_flops(total) - self.attn_flops(parent))
        mlp = self.num_mlp_layers * (self.mlp_flops(total) - self.attn_flops(parent))
        return mamba + attn + mlp

    def request_flops_saved(self, hit: int) -> int:
        """``RadixCache.get_cache_stats`` per request (its SSM term is linear, so per-request sums
        equal its ``L_ssm * mamba1(sum of hits)`` exactly)."""
        return (
            self.num_ssm_layers * self.mamba1_flops(hit)
            + self.num_attn_layers * self.attn_flops(hit)
            + self.num_mlp_layers * self.mlp_flops(hit)
        )


@dataclass(frozen=True)
class CostModelAccounting:
    """:class:`PublishedModel` from this project's :class:`ModelCostModel` (e.g. Qwen3-Next): bytes
    from ``state_bytes`` / ``kv_bytes_per_token``; FLOPs from ``prefill_flops``. The eviction
    numerator is the exact prefill FLOPs of the node's tokens after its parent's (the reference's
    MLP-term typo, see :meth:`MarconiModel.node_flops_saved`, exists only for its own formulas)."""

    cost: ModelCostModel

    def states_bytes(self, count: float) -> float:
        return count * self.cost.state_bytes

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.cost.kv_bytes_per_token

    def node_flops_saved(self, total: int, parent: int) -> float:
        return self.cost.prefill_flops(total - parent, past_tokens=parent)

    def request_flops_saved(self, hit: int) -> float:
        return self.cost.prefill_flops(hit)


def as_published_model(cost: ModelCostModel | PublishedModel) -> PublishedModel:
    """``cost`` as a :class:`PublishedModel` (a :class:`ModelCostModel` is wrapped)."""
    return CostModelAccounting(cost) if isinstance(cost, ModelCostModel) else cost


@dataclass(frozen=True, slots=True)
class Served:
    """One request's outcome: ``hit`` reused input tokens (the reference's ``num_tokens_skipped``),
    ``prefix_len`` the reference's "actual prefix length" (KV match; tokens), ``created`` states
    written by the insertion, ``bytes_used`` tree bytes after it."""

    hit: int
    prefix_len: int
    created: int
    bytes_used: float


# ------------------------------------------------------------------------------- hybrid (SGLang+, Marconi)


class _Node:
    """A radix node: edge tokens ``key`` (int32 array), one state at its end (depth ``end``)."""

    __slots__ = ("key", "children", "parent", "ts", "end")

    def __init__(self, key: np.ndarray, parent: _Node | None, ts: int, end: int) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.ts = ts
        self.end = end

    def __lt__(self, other: _Node) -> bool:  # heapq order of the reference's TreeNode
        return self.ts < other.ts


_EMPTY = np.zeros(0, dtype=np.int32)


def _evict_lru_leaves(cache: PublishedCache, bytes_to_remove: float) -> None:
    """SGLang+'s ``evict_v1`` and vLLM+'s ``evict`` (same code in the reference): heapify the leaves
    (childless nodes, depth-first pre-order, the root if it is one) by ``ts``, then pop the oldest and
    delete it (``cache._delete_leaf``; a parent left childless joins the heap) until the freed bytes
    (one state + the node's KV each) reach ``bytes_to_remove`` or the root comes up."""
    leaves, stack = [], [cache.root]
    while stack:
        x = stack.pop()
        if not x.children:
            leaves.append(x)
        else:
            stack.extend(reversed(x.children.values()))
    heapq.heapify(leaves)
    state1 = cache.model.states_bytes(1)
    evicted = 0
    while evicted < bytes_to_remove and leaves:
        x = heapq.heappop(leaves)
        if x is cache.root:
            break
        evicted += state1 + cache.model.kv_bytes(len(x.key))
        cache._delete_leaf(x)
        if not x.parent.children:
            heapq.heappush(leaves, x.parent)


class PublishedHybridCache:
    """``radix_cache_hybrid.py: RadixCache`` with ``evict_policy_version`` 1 (SGLang+), 2 (Marconi) or
    3 (Marconi with a fixed alpha: the tuner's replays and the static-alpha oracle).

    Admission (``insert`` / ``_insert_helper`` / ``_split_node``): the whole ``input + output`` is
    inserted; a node split creates the branch state **at the exact divergence depth** (no chunk grid),
    wherever it falls, including inside an earlier request's output when an input repeats an earlier
    input (or a prefix of an earlier sequence) exactly; the new leaf holds the last-token state.

    Match (``match_prefix`` / ``_match_prefix_helper``): the hit is the total length of the nodes the
    walk covers completely. Quirk kept: after a partial edge match the walk continues from that child
    with the remaining tokens, so a later node whose key happens to match is counted too.

    Recency: version 1 stamps every node the match walk visits (including the partially matched one)
    and every node the insertion walk passes (``_insert_helper``); versions 2/3 stamp only the deepest
    completely matched node, at each ``match_prefix`` call -- the request's and the one ``insert``
    makes on ``input + output`` -- and nodes created by an insertion get its time.

    Eviction before an insertion of ``bytes_needed = (2 if a split else 1) states + KV(len - prefix)``
    (``prefix`` the match length above, including the quirk) when ``size + bytes_needed > capacity``:

    * version 1 (``evict_v1``): LRU heap over the leaves only; a parent left childless joins the heap.
    * versions 2/3 (``evict_v2``): repeatedly, among all non-root nodes with <= 1 child, evict the
      minimum of ``alpha * norm(flops_eff) + norm(1 / (now - ts))`` (min-max normalised; ties to the
      first in depth-first order). ``flops_eff = node_flops_saved(end, start) / (state + KV(end))``
      (the KV of the whole path). A leaf is deleted; a single-child node loses its state and merges
      into its child (recency = max of both). Quirk kept: a deleted leaf is credited with the KV of
      the *last candidate's* edge (the loop variable of the scoring loop), not its own.

    Alpha (version 2, ``config_tuner.py``): 0 until the first eviction, which fixes the bootstrap
    window at ``bootstrap_multiplier`` (5) x the requests seen so far; when the request count reaches
    it, every alpha of :data:`MARCONI_ALPHA_GRID` replays all requests so far from an **empty** tree
    (version 3), the one saving most FLOPs over the last :data:`MARCONI_TUNING_LAST_N` of them wins
    (ties: the earlier grid entry; the reference takes process completion order), once."""

    def __init__(
        self,
        version: int,
        capacity_bytes: float,
        model: ModelCostModel | PublishedModel,
        *,
        alpha: float = 0.0,
        bootstrap_multiplier: int = MARCONI_BOOTSTRAP_MULTIPLIER,
        alpha_grid: Sequence[float] = MARCONI_ALPHA_GRID,
        tuning_last_n: int = MARCONI_TUNING_LAST_N,
        tuner_workers: int = 2,
    ) -> None:
        if version not in (1, 2, 3):
            raise ValueError(f"version must be 1 (SGLang+), 2 (Marconi) or 3 (fixed alpha), got {version}")
        if capacity_bytes <= 0 or alpha < 0 or bootstrap_multiplier < 1 or tuning_last_n < 1:
            raise ValueError("capacity_bytes > 0, alpha >= 0, bootstrap_multiplier >= 1, tuning_last_n >= 1")
        self.version = version
        self.capacity_bytes = capacity_bytes
        self.model = as_published_model(model)
        self.alpha = float(alpha)
        self.bootstrap_multiplier = int(bootstrap_multiplier)
        self.alpha_grid = tuple(float(a) for a in alpha_grid)
        self.tuning_last_n = int(tuning_last_n)
        self.tuner_workers = int(tuner_workers)
        self.root = _Node(_EMPTY, None, 0, 0)
        self.clock = 0
        self.num_nodes = 0  # = states held
        self.kv_tokens = 0
        #: per request: tokens reused (the reference's ``request_history`` third field)
        self.hits: list[int] = []
        self.window: list[list[np.ndarray | None]] = []  # version 2: [input, input + output] so far
        self.num_reqs_before_eviction: int | None = None
        self.bootstrap_window_size: int | None = None
        #: (request count when tuned, alpha chosen)
        self.tunings: list[tuple[int, float]] = []
        self._eff_cache: dict[tuple[int, int], float] = {}

    # ------------------------------------------------------------------ accounting

    @property
    def bytes_used(self) -> float:
        """``get_tree_size``: one state per node + the KV of every cached token (bytes)."""
        return self.model.states_bytes(self.num_nodes) + self.model.kv_bytes(self.kv_tokens)

    def serve(self, input_ids: np.ndarray, full_ids: np.ndarray) -> Served:
        """One request as ``run_trace_with_config`` drives it: match the input, insert input + output."""
        hit, _, _, prefix_len = self.match_prefix(input_ids)
        created = self.insert(full_ids)
        return Served(hit, prefix_len, created, self.bytes_used)

    # ------------------------------------------------------------------ match

    def match_prefix(
        self, tokens: np.ndarray, actually_inserting: bool = True
    ) -> tuple[int, _Node, bool, int]:
        """``RadixCache.match_prefix``: ``(reused tokens, deepest covered node, branch needed,
        prefix_len)``; records the request when ``actually_inserting``."""
        self.clock += 1
        now = self.clock
        node, pos, prefix_len, hit, deepest = self.root, 0, 0, 0, self.root
        n = len(tokens)
        stamp_path = self.version == 1
        while True:
            if stamp_path:
                node.ts = now
            if pos >= n:
                break
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            m = lcp(child.key, tokens, pos)
            if m == len(child.key):
                hit += m
                deepest = child
            prefix_len += m
            pos += m
            node = child
        if actually_inserting:
            self.hits.append(hit)
            if self.version == 2:
                self.window.append([tokens, None])
        if self.version in (2, 3) and deepest is not self.root:
            deepest.ts = now
        return hit, deepest, prefix_len > hit, prefix_len

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: np.ndarray) -> int:
        """``RadixCache.insert``: tune (version 2, once), evict by the estimate, insert. Returns the
        number of states created (0-2)."""
        self.clock += 1
        if self.version == 2:
            self.window[-1][1] = tokens
            if self.bootstrap_window_size is not None and len(self.hits) == self.bootstrap_window_size:
                self._tune()
        _, _, branch, prefix_len = self.match_prefix(tokens, actually_inserting=False)
        extra_tokens = len(tokens) - prefix_len
        extra_states = 2 if branch else 1
        bytes_needed = self.model.states_bytes(extra_states) + self.model.kv_bytes(extra_tokens)
        size = self.bytes_used
        if size + bytes_needed > self.capacity_bytes:
            self.evict(size + bytes_needed - self.capacity_bytes)
        return self._insert_walk(tokens)

    def _insert_walk(self, tokens: np.ndarray) -> int:
        """``_insert_helper`` + ``_split_node`` (iterative)."""
        now = self.clock
        node, pos, n, created = self.root, 0, len(tokens), 0
        stamp_path = self.version == 1
        while True:
            if stamp_path:
                node.ts = now
            if pos >= n:
                return created
            first = int(tokens[pos])
            child = node.children.get(first)
            if child is None:
                leaf = _Node(tokens[pos:], node, now, n)
                node.children[first] = leaf
                self.num_nodes += 1
                self.kv_tokens += n - pos
                return created + 1
            m = lcp(child.key, tokens, pos)
            if m == len(child.key):
                if pos + m == n:  # already cached; the child is not stamped
                    return created
            else:  # split: the branch state at the exact divergence depth
                mid = _Node(child.key[:m], node, now, child.end - len(child.key) + m)
                child.key = child.key[m:]
                child.parent = mid
                mid.children[int(child.key[0])] = child
                node.children[first] = mid  # same dict key: keeps the child's place in the order
                self.num_nodes += 1
                created += 1
                child = mid
            pos += m
            node = child

    # ------------------------------------------------------------------ evict

    def evict(self, bytes_to_remove: float) -> None:
        """``RadixCache.evict``: fixes the bootstrap window on the first call, then ``evict_v1`` /
        ``evict_v2``."""
        self.clock += 1
        if self.num_reqs_before_eviction is None:
            self.num_reqs_before_eviction = len(self.hits)
            self.bootstrap_window_size = self.bootstrap_multiplier * self.num_reqs_before_eviction
        if self.version == 1:
            _evict_lru_leaves(self, bytes_to_remove)
        else:
            self._evict_v2(bytes_to_remove)

    def _candidates(self) -> list[_Node]:
        """``_collect_leaf_and_single_child_nodes``: non-root nodes with <= 1 child, pre-order."""
        out, stack = [], list(reversed(self.root.children.values()))
        while stack:
            x = stack.pop()
            if len(x.children) <= 1:
                out.append(x)
            if x.children:
                stack.extend(reversed(x.children.values()))
        return out

    def _delete_leaf(self, x: _Node) -> None:
        del x.parent.children[int(x.key[0])]
        self.num_nodes -= 1
        self.kv_tokens -= len(x.key)

    def _efficiency(self, x: _Node) -> float:
        start = x.end - len(x.key)
        k = (start, x.end)
        e = self._eff_cache.get(k)
        if e is None:
            mem = self.model.states_bytes(1) + self.model.kv_bytes(x.end)
            e = self._eff_cache[k] = self.model.node_flops_saved(x.end, start) / mem
        return e

    def _evict_v2(self, bytes_to_remove: float) -> None:
        state1 = self.model.states_bytes(1)
        evicted = 0
        while evicted < bytes_to_remove and self.num_nodes > 0:
            cands = self._candidates()
            now = self.clock
            rec = _normalize([1 / (now - x.ts) for x in cands])
            if self.alpha != 0:  # alpha * eff + rec == rec exactly when alpha == 0
                eff = _normalize([self._efficiency(x) for x in cands])
                util = [self.alpha * e + r for e, r in zip(eff, rec, strict=True)]
            else:
                util = rec
            x = cands[util.index(min(util))]
            if not x.children:
                # reference: the KV of ``node`` -- the scoring loop's last candidate, not ``x``
                evicted += state1 + self.model.kv_bytes(len(cands[-1].key))
                self._delete_leaf(x)
            else:
                evicted += state1
                self._merge_into_child(x)

    def _merge_into_child(self, x: _Node) -> None:
        """``_evict_intermediate_node``: drop ``x``'s state; its only child absorbs its tokens and
        takes its place (same dict key, same position) with the later recency of the two."""
        (child,) = x.children.values()
        child.key = np.concatenate([x.key, child.key])
        child.ts = max(x.ts, child.ts)
        child.parent = x.parent
        x.parent.children[int(x.key[0])] = child
        self.num_nodes -= 1

    # ------------------------------------------------------------------ alpha tuning

    def _tune(self) -> None:
        """``ConfigTuner.tune_config`` from the empty-tree snapshot over all requests so far."""
        window = tuple((inp, full) for inp, full in self.window)
        evaluate = functools.partial(
            _replay_flops_saved,
            requests=window,
            capacity_bytes=self.capacity_bytes,
            model=self.model,
            last_n=self.tuning_last_n,
        )
        tuner = AlphaTuner(self.alpha_grid, window=max(1, len(window)), workers=self.tuner_workers)
        self.alpha = tuner.tune(evaluate, at_request=len(self.hits))
        self.tunings.append((len(self.hits), self.alpha))
        self.window = []

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Assert structure and counters (parents, first-token keys, depths, node/token counts)."""
        nodes, tokens, stack = 0, 0, [self.root]
        while stack:
            x = stack.pop()
            for k, c in x.children.items():
                assert c.parent is x and len(c.key) > 0 and int(c.key[0]) == k
                assert c.end == x.end + len(c.key)
                nodes += 1
                tokens += len(c.key)
                stack.append(c)
        assert (nodes, tokens) == (self.num_nodes, self.kv_tokens), ((nodes, tokens), self.num_nodes)


def _normalize(values: list[float]) -> list[float]:
    """``utils._normalize``: min-max scaling; all ones for <= 1 value or all equal."""
    if len(values) > 1:
        lo, hi = min(values), max(values)
        if lo != hi:
            return [(v - lo) / (hi - lo) for v in values]
    return [1] * len(values)


def _replay_flops_saved(
    alpha: float,
    *,
    requests: Sequence[tuple[np.ndarray, np.ndarray]],
    capacity_bytes: float,
    model: PublishedModel,
    last_n: int,
) -> float:
    """``config_tuner.replay_trace`` + the tuner's score: FLOPs saved over the last ``last_n`` of
    ``requests`` replayed from an empty version-3 tree with ``alpha``."""
    cache = PublishedHybridCache(3, capacity_bytes, model, alpha=alpha)
    for inp, full in requests:
        cache.serve(inp, full)
    return sum(model.request_flops_saved(h) for h in cache.hits[-last_n:])


# ------------------------------------------------------------------------------------------- vLLM+


class _Block:
    """A token block of <= ``block`` tokens with one state at its end (``radix_cache_vllm.TreeNode``)."""

    __slots__ = ("key", "children", "parent", "ts", "uid")

    def __init__(self, key: np.ndarray, parent: _Block | None, ts: int, uid: int) -> None:
        self.key = key
        self.children: dict[int, _Block] = {}  # uid -> block, in the reference's dict order
        self.parent = parent
        self.ts = ts
        self.uid = uid

    def __lt__(self, other: _Block) -> bool:
        return self.ts < other.ts


class PublishedBlockCache:
    """``radix_cache_vllm.py: RadixCache`` (vLLM+, ``block_size = 32``): a state every block.

    * Insert (``insert`` / ``_insert_helper``): the whole ``input + output`` in blocks of ``block``
      tokens; a trailing partial block is **reused**: a later sequence that covers it completely
      fills it up in place (its state moves to the new end; the shorter prefix is no longer
      matchable) and it moves to the end of its parent's child order. Every node visited is stamped.
    * Match (``_match_prefix_helper``): full blocks while exactly one child matches ``block`` tokens,
      then at most one partial block that matches completely (the first in child order); every full
      block passed is stamped, the final partial one is not.
    * Evict (``evict``): LRU heap over the leaves (ties: heap order of the depth-first leaf list);
      a parent left childless joins the heap. Sized by the reference's estimate
      ``(len - block * (matched blocks + 1)) / block`` states + KV of as many tokens, before an
      insertion that then always happens (**soft cap**: the tree can exceed the capacity).
    """

    def __init__(
        self, capacity_bytes: float, model: ModelCostModel | PublishedModel, *, block: int = 32
    ) -> None:
        if capacity_bytes <= 0 or block < 1:
            raise ValueError("capacity_bytes > 0 and block >= 1")
        self.capacity_bytes = capacity_bytes
        self.model = as_published_model(model)
        self.block = int(block)
        self.root = _Block(_EMPTY, None, 0, 0)
        self._uids = 0
        self.clock = 0
        self.num_nodes = 0
        self.kv_tokens = 0
        self.hits: list[int] = []

    @property
    def bytes_used(self) -> float:
        """One state per block + the KV of every cached token (bytes)."""
        return self.model.states_bytes(self.num_nodes) + self.model.kv_bytes(self.kv_tokens)

    def serve(self, input_ids: np.ndarray, full_ids: np.ndarray) -> Served:
        """Match the input, insert input + output (``run_trace_with_config``)."""
        hit, _ = self.match_prefix(input_ids)
        created = self.insert(full_ids)
        return Served(hit, hit, created, self.bytes_used)

    def match_prefix(self, tokens: np.ndarray, actually_inserting: bool = True) -> tuple[int, int]:
        """``(reused tokens, nodes accessed incl. the root)``; records the request when asked."""
        self.clock += 1
        now, node, pos, hit, accessed = self.clock, self.root, 0, 0, 1
        while True:
            node.ts = now
            if not node.children:
                break
            kids = list(node.children.values())
            stats = [lcp(c.key, tokens, pos) for c in kids]
            mx = max(stats)
            if mx == self.block:
                child = kids[stats.index(mx)]
                hit += len(child.key)
                accessed += 1
                pos += mx
                node = child
                continue
            if mx != 0:
                for p, c in zip(stats, kids, strict=True):
                    if p == len(c.key) != 0:
                        hit += p
                        accessed += 1
                        break
            break
        if actually_inserting:
            self.hits.append(hit)
        return hit, accessed

    def insert(self, tokens: np.ndarray) -> int:
        """Evict by the estimate, then insert; returns the blocks created or filled."""
        self.clock += 1
        _, accessed = self.match_prefix(tokens, actually_inserting=False)
        extra_tokens = len(tokens) - self.block * accessed
        extra_states = extra_tokens / self.block
        bytes_needed = self.model.states_bytes(extra_states) + self.model.kv_bytes(extra_tokens)
        size = self.bytes_used
        if size + bytes_needed > self.capacity_bytes:
            self.evict(size + bytes_needed - self.capacity_bytes)
        return self._insert_walk(tokens)

    def _insert_walk(self, tokens: np.ndarray) -> int:
        now, node, pos, n, created, b = self.clock, self.root, 0, len(tokens), 0, self.block
        while True:
            node.ts = now
            if node.children:
                kids = list(node.children.values())
                stats = [lcp(c.key, tokens, pos) for c in kids]
                mx = max(0, *stats)
                nxt = next((c for p, c in zip(stats, kids, strict=True) if p == len(c.key) == mx), None)
                if nxt is not None:
                    pos += mx
                    node = nxt
                    continue
            if pos >= n:
                return created
            if node is self.root or len(node.key) == b:
                self._uids += 1
                new = _Block(tokens[pos : pos + b], node, now, self._uids)
                node.children[new.uid] = new
                self.num_nodes += 1
                self.kv_tokens += len(new.key)
                pos += len(new.key)
                node = new
            else:  # a trailing partial block (no children): fill it, move it last
                assert not node.children
                add = tokens[pos : pos + b - len(node.key)]
                node.key = np.concatenate([node.key, add])
                self.kv_tokens += len(add)
                siblings = node.parent.children
                del siblings[node.uid]
                siblings[node.uid] = node
                pos += len(add)
            created += 1

    def evict(self, bytes_to_remove: float) -> None:
        """LRU over leaves (``RadixCache.evict``: :func:`_evict_lru_leaves`)."""
        self.clock += 1
        _evict_lru_leaves(self, bytes_to_remove)

    def _delete_leaf(self, x: _Block) -> None:
        del x.parent.children[x.uid]
        self.num_nodes -= 1
        self.kv_tokens -= len(x.key)

    def check(self) -> None:
        """Assert structure and counters (block sizes, partial blocks are leaves, counts)."""
        nodes, tokens, stack = 0, 0, [self.root]
        while stack:
            x = stack.pop()
            for uid, c in x.children.items():
                assert c.parent is x and c.uid == uid and 0 < len(c.key) <= self.block
                assert len(c.key) == self.block or not c.children
                nodes += 1
                tokens += len(c.key)
                stack.append(c)
        assert (nodes, tokens) == (self.num_nodes, self.kv_tokens)


PublishedCache = PublishedHybridCache | PublishedBlockCache
#: :class:`PublishedHybridCache` options about alpha tuning (meaningless for the block cache)
TUNING_KWARGS = frozenset({"bootstrap_multiplier", "alpha_grid", "tuning_last_n", "tuner_workers"})


def make_published_cache(
    name: str,
    capacity_bytes: float,
    model: ModelCostModel | PublishedModel,
    *,
    alpha: float | None = None,
    **kwargs: object,
) -> PublishedCache:
    """The cache of the published policy ``name`` (see
    :data:`~sglang_sparse.policy.registry.PUBLISHED_POLICIES`);
    ``alpha`` fixes Marconi's weight (version 3, no tuning). ``kwargs`` go to the cache's constructor;
    the alpha-tuning ones (:data:`TUNING_KWARGS`) are ignored by the block cache."""
    spec = get_published(name)
    if spec.kind == "block":
        if alpha not in (None, 0.0):
            raise ValueError(f"policy {name!r} is not FLOP-aware; alpha must be None or 0")
        kw = {k: v for k, v in kwargs.items() if k not in TUNING_KWARGS}
        return PublishedBlockCache(capacity_bytes, model, block=spec.block, **kw)  # type: ignore[arg-type]
    version = spec.version
    if alpha is not None:
        if version == 1 and alpha != 0:
            raise ValueError(f"policy {name!r} is not FLOP-aware; alpha must be None or 0")
        if version == 2:
            version = 3
    return PublishedHybridCache(version, capacity_bytes, model, alpha=alpha or 0.0, **kwargs)  # type: ignore[arg-type]

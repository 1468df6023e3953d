"""Radix tree over token ids with sparse recurrent-state checkpoints (handles are opaque).

Modules: :mod:`.core` (nodes, checkpoint maps, :class:`CheckpointTree`: the structure), :mod:`.radix`
(:class:`RadixTree`, the token tree), :mod:`.mirror` (SGLang's tree without tokens), :mod:`.lcp`
(prefix-comparison kernels), :mod:`.lru` (the LRU heap of evictable leaves), :mod:`.snapshot` (flat
copies). Mechanism only: per-node policy state (histograms, plans) lives in the policy's plan
table, which listens to the structural events (:class:`TreeListener`).
"""

from .core import (
    CheckpointMap,
    CheckpointTree,
    Freed,
    InsertResult,
    KVOps,
    MatchResult,
    Node,
    TreeListener,
    sequence_leaf,
)
from .lcp import as_tokens
from .mirror import MirrorError, MirrorTree, Span
from .radix import RadixTree
from .snapshot import SnapshotError, TreeSnapshot, TreeSnapshotBuilder

__all__ = [
    "CheckpointMap",
    "CheckpointTree",
    "Freed",
    "InsertResult",
    "KVOps",
    "MatchResult",
    "MirrorError",
    "MirrorTree",
    "Node",
    "RadixTree",
    "SnapshotError",
    "Span",
    "TreeListener",
    "TreeSnapshot",
    "TreeSnapshotBuilder",
    "as_tokens",
    "sequence_leaf",
]

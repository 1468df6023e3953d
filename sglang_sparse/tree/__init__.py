"""Radix tree over token ids with sparse recurrent-state checkpoints (handles are opaque).

Modules: :mod:`.lcp` (prefix-comparison kernels), :mod:`.lru` (the LRU heap of evictable leaves),
:mod:`.node` (nodes and checkpoint maps), :mod:`.radix` (:class:`CheckpointTree`, the structure,
and :class:`RadixTree`, the token tree), :mod:`.mirror` (SGLang's tree without tokens),
:mod:`.snapshot` (flat copies).
"""

from .lcp import as_tokens
from .mirror import MirrorError, MirrorTree, Span
from .node import CheckpointMap, Node, sequence_leaf
from .radix import CheckpointTree, Freed, InsertResult, KVOps, MatchResult, RadixTree
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
    "TreeSnapshot",
    "TreeSnapshotBuilder",
    "as_tokens",
    "sequence_leaf",
]

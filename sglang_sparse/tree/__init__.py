"""Radix tree over token ids with sparse recurrent-state checkpoints (handles are opaque)."""

from .mirror import MirrorError, MirrorTree, Span
from .node import CheckpointMap, Node, sequence_leaf
from .radix import Freed, InsertResult, KVOps, MatchResult, RadixTree, as_tokens
from .snapshot import SnapshotError, TreeSnapshot, TreeSnapshotBuilder

__all__ = [
    "CheckpointMap",
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

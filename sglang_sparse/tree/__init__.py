"""Radix tree over token ids with sparse recurrent-state checkpoints (handles are opaque)."""

from .node import CheckpointMap, Node
from .radix import Freed, InsertResult, KVOps, MatchResult, RadixTree, as_tokens

__all__ = ["CheckpointMap", "Freed", "InsertResult", "KVOps", "MatchResult", "Node", "RadixTree", "as_tokens"]

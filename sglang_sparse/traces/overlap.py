"""Exact prefix-overlap depths against an unbounded cache.

``overlap_depths(requests)[i]`` is the longest common prefix, in tokens, of ``requests[i].input_tokens``
with ``requests[j].input_tokens + requests[j].output_tokens`` over all ``j < i`` (list order), i.e.
the tokens an infinite prefix cache holding every earlier request's full sequence could reuse.

Algorithm (exact, not approximate): a trie whose edges are whole ``block``-token chunks (default 64)
stored as fixed-width big-endian bytes. A query descends by whole blocks to depth ``D``; every
earlier sequence with LCP >= D passes through that node and continues with one of the node's
"next pieces" (a full child block or a shorter sequence tail), kept sorted. Byte-lexicographic
order of fixed-width encodings is token-lexicographic order, so the best continuation is a sorted
neighbour of the query's next piece (classic LCP property), found by bisection. Cost per request is
``O(len/block)`` dict look-ups plus one bisection; memory is one node per distinct block.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

_MAX_TOKEN = 2**32 - 1


class _HasTokens(Protocol):
    @property
    def input_tokens(self) -> Sequence[int]: ...

    @property
    def output_tokens(self) -> Sequence[int]: ...


def _to_bytes(tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN}]")
    return arr.astype(">u4").tobytes()


def _lcp_bytes(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "pieces")

    def __init__(self) -> None:
        self.children: dict[bytes, _Node] = {}
        self.pieces: list[bytes] = []  # sorted, distinct: full child blocks and sequence tails


class PrefixIndex:
    """Set of token sequences answering "longest common prefix with any stored sequence" exactly. Token
    ids must be integers in ``[0, 2**32)``. ``block`` (tokens) only trades speed for memory."""

    def __init__(self, block: int = 64) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block
        self._bb = 4 * block
        self._root = _Node()

    @staticmethod
    def _add_piece(node: _Node, piece: bytes) -> None:
        i = bisect.bisect_left(node.pieces, piece)
        if i == len(node.pieces) or node.pieces[i] != piece:
            node.pieces.insert(i, piece)

    def insert(self, tokens: Sequence[int]) -> None:
        """Store one sequence."""
        self._insert_bytes(_to_bytes(tokens))

    def _insert_bytes(self, b: bytes) -> None:
        node, bb = self._root, self._bb
        full = len(b) // bb * bb
        for off in range(0, full, bb):
            key = b[off : off + bb]
            child = node.children.get(key)
            if child is None:
                child = _Node()
                node.children[key] = child
                self._add_piece(node, key)
            node = child
        if full < len(b):
            self._add_piece(node, b[full:])

    def query(self, tokens: Sequence[int]) -> int:
        """Longest common prefix (tokens) of ``tokens`` with any stored sequence; 0 if empty."""
        return self._query_bytes(_to_bytes(tokens))

    def _query_bytes(self, b: bytes) -> int:
        node, bb = self._root, self._bb
        off = 0
        while off + bb <= len(b):
            child = node.children.get(b[off : off + bb])
            if child is None:
                break
            node = child
            off += bb
        rest = b[off : off + bb]
        best = 0
        if rest and node.pieces:
            i = bisect.bisect_left(node.pieces, rest)
            for j in (i - 1, i):
                if 0 <= j < len(node.pieces):
                    best = max(best, _lcp_bytes(rest, node.pieces[j]))
        return (off + best) // 4


def overlap_depths(requests: Iterable[_HasTokens], block: int = 64) -> np.ndarray:
    """Exact per-request overlap depth (tokens, int64) against all earlier requests' input+output. The
    first request always has depth 0; ``depth[i] <= len(requests[i].input_tokens)``."""
    index = PrefixIndex(block)
    out: list[int] = []
    for r in requests:
        inp = _to_bytes(r.input_tokens)
        out.append(index._query_bytes(inp))
        index._insert_bytes(inp + _to_bytes(r.output_tokens))
    return np.asarray(out, dtype=np.int64)

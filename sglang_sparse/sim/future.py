"""Future knowledge for offline policies: which later requests pass through a cached prefix.

:class:`FutureIndex` is a radix trie over every request *input* of a trace (built once, never
modified) whose nodes carry the set of requests whose input runs through them, as a bit mask
(bit ``j`` = request ``j``; Python ints, so set operations are word-parallel and exact).

Facts the offline policy relies on (tokens; ``P`` any token sequence, ``p <= len(P)``):

* Every input ends at a trie node boundary (the trie splits an edge where an input ends), so the
  requests whose input starts with ``P[:p]`` are exactly the mask of the trie node whose edge
  ``(start, end]`` contains ``p`` on ``P``'s path (:meth:`FutureIndex.prefix_mask`), or none when
  ``P[:p]`` leaves the trie.
* For a request ``i`` whose sequence (input + output) is ``F``, every later request ``j`` either
  shares nothing with ``F`` or leaves ``F``'s path at one depth ``d_ij = lcp(input_j, F)``: at the
  end of a trie edge on ``F``'s path (it branches off or its input ends there) or at the depth
  where ``F`` itself leaves the trie / ends. :meth:`FutureIndex.demands` lists those depths with the
  prefix masks of their positions: a state at ``d_ij`` is where ``j`` would resume on ``F``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_sparse.tree import RadixTree, as_tokens

from .trace import SimRequest


def after(i: int) -> int:
    """Bit mask of every request index ``> i`` (an infinite mask: use it with ``&``)."""
    return ~((1 << (i + 1)) - 1)


def first_bit(mask: int) -> int | None:
    """Lowest set bit of a non-negative mask (the earliest request in it), ``None`` when empty."""
    if mask <= 0:
        return None
    return (mask & -mask).bit_length() - 1


@dataclass(frozen=True, slots=True)
class Demand:
    """A depth (tokens) of a sequence where later requests leave it or stop (they resume there).
    ``depth``: absolute position on the sequence; ``mask``: every request (past or future) whose input
    starts with the sequence's first ``depth`` tokens (the requests a state at ``depth`` could serve);
    ``leaving``: the subset that leaves the sequence (or ends) exactly at ``depth``."""

    depth: int
    mask: int
    leaving: int


class FutureIndex:
    """Trie of all inputs of a trace with per-node request masks (module docstring). O(total input
    tokens) memory for the trie, O(requests x path nodes) bits for the masks."""

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        self.n = len(requests)
        trie = RadixTree(0, 1)
        inputs = [as_tokens(r.input_tokens) for r in requests]
        for inp in inputs:
            if len(inp):
                trie.insert(inp)
        mask: dict[int, int] = {}
        for j, inp in enumerate(inputs):
            if not len(inp):
                continue
            bit = 1 << j
            for node in trie.match(inp).path:
                mask[node.uid] = mask.get(node.uid, 0) | bit
        self.trie = trie
        self._mask = mask

    def _walk(self, seq: np.ndarray) -> tuple[int, list[int], list[int], list[int]]:
        """``(depth reached, [edge start], [edge end], [edge mask])`` along ``seq``'s trie path."""
        m = self.trie.match(seq)
        starts = [n.start for n in m.path]
        ends = [n.end for n in m.path]
        masks = [self._mask.get(n.uid, 0) for n in m.path]
        return int(m.kv_depth), starts, ends, masks

    def prefix_mask(self, seq: Sequence[int] | np.ndarray, depth: int) -> int:
        """Requests whose input starts with ``seq[:depth]`` (0 when none does; ``depth >= 1``)."""
        if depth <= 0:
            raise ValueError(f"depth must be >= 1 token, got {depth}")
        reached, starts, ends, masks = self._walk(as_tokens(seq)[:depth])
        if reached < depth:
            return 0
        for s, e, mk in zip(starts, ends, masks, strict=True):
            if s < depth <= e:
                return mk
        return 0

    def demands(self, seq: Sequence[int] | np.ndarray, since: int = -1) -> list[Demand]:
        """Depths of ``seq`` where some request after ``since`` leaves it or ends (ascending; see
        the module docstring). ``mask`` / ``leaving`` keep past requests too; filter with
        :func:`after`."""
        t = as_tokens(seq)
        reached, starts, ends, masks = self._walk(t)
        fut = after(since)
        out: list[Demand] = []
        for k, mk in enumerate(masks):
            if k + 1 < len(masks):
                leaving, depth = mk & ~masks[k + 1], ends[k]
            else:  # the last edge: everyone on it passes ``reached`` (the sequence stops there)
                leaving, depth = mk, reached
            if leaving & fut:
                out.append(Demand(depth, mk, leaving))
        return out

    def mask_at(self, seq: np.ndarray, depth: int, demands: Sequence[Demand]) -> int:
        """:meth:`prefix_mask` of ``seq[:depth]`` reusing ``demands`` of the same sequence when one
        sits exactly at ``depth``."""
        for d in demands:
            if d.depth == depth:
                return d.mask
        return self.prefix_mask(seq, depth)

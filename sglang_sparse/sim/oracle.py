"""Oracle law: the DP fed each edge's *true whole-trace* overlap-depth law.

Construction (two passes over the trace, infinite cache):

1. Insert every request's ``input + output`` into an unbounded :class:`RadixTree`, in trace order;
   before inserting request ``i``, its true overlap depth ``d_i`` is the KV match of its input
   (the depth it would hit with an infinite cache).
2. With the final tree, record each ``d_i > 0`` as a *stop* on the infinite-tree edge containing it,
   and count stops per subtree.

For a live edge ``(a, b]`` (path tokens ``P[:b]``) the law is the multiset, over *all* requests of
the trace (past and future, undecayed), of ``min(LCP(input_i[:d_i], P), b)`` restricted to values
in ``(a, b]``: stops lying on the path segment count at their depth; stops in subtrees branching off
the path at depth ``p`` count at ``p``; stops below depth ``b`` count at ``b`` (pass-through mass,
the same rule the online histograms use). It is what the online EW histogram estimates, with
perfect knowledge of the future.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_sparse.tree import Node, RadixTree, as_tokens

from .common import prepare_requests
from .trace import SimRequest


class OracleLaw:
    """Callable law provider ``(node, live_tree) -> (depths, weights)`` for :class:`RadixTree`."""

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        inf = RadixTree(0, 1)
        depths = []
        for inp, full in prepare_requests(requests):
            depths.append(inf.match(inp).kv_depth)
            inf.insert(full)
        self.depths = np.asarray(depths, dtype=np.int64)
        self._stops: dict[int, list[int]] = {}
        for r, d in zip(requests, depths, strict=True):
            if d > 0:
                m = inf.match(as_tokens(r.input_tokens)[:d])
                self._stops.setdefault(m.node.uid, []).append(int(d))
        self._subtotal: dict[int, int] = {}
        for n in reversed(list(inf.nodes())):
            self._subtotal[n.uid] = len(self._stops.get(n.uid, ())) + sum(
                self._subtotal[c.uid] for c in n.children.values()
            )
        self.inf = inf
        self._memo: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, node: Node, tree: RadixTree) -> tuple[np.ndarray, np.ndarray]:
        key = (node.uid, node.start, node.end)
        got = self._memo.get(key)
        if got is None:
            got = self._law(tree.path_tokens(node), node.start, node.end)
            self._memo[key] = got
        return got

    def _law(self, path: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        mass: dict[int, float] = {}

        def add(depth: int, w: float) -> None:
            if a < depth <= b and w > 0:
                mass[depth] = mass.get(depth, 0.0) + w

        node, d = self.inf.root, 0
        while d < b:
            child = node.children.get(int(path[d]))
            if child is None:  # live path not in the infinite tree (foreign tokens): no law
                break
            e_end = child.end
            for s in self._stops.get(child.uid, ()):
                add(min(s, b), 1.0)
            if e_end > b:
                for gc in child.children.values():
                    add(b, self._subtotal[gc.uid])
                break
            if e_end < b:
                nxt = int(path[e_end])
                for tok, gc in child.children.items():
                    if tok != nxt:
                        add(e_end, self._subtotal[gc.uid])
            else:
                for gc in child.children.values():
                    add(b, self._subtotal[gc.uid])
            node, d = child, e_end
        if not mass:
            return np.empty(0, dtype=np.int64), np.empty(0)
        ks = np.array(sorted(mass), dtype=np.int64)
        return ks, np.array([mass[k] for k in ks.tolist()])

"""Longest-common-prefix kernels of the radix tree over int32 token ids: ``lcp`` (one edge),
``walk`` (the pure match descent), their C versions (``_lcp_native``, built at install time when a
compiler is present) and numpy twins with identical results. Every token is compared exactly (no
hashing). Units: token counts and indices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .core import Node

Tokens = Sequence[int] | np.ndarray
_INT32 = np.dtype(np.int32)  # the canonical int32 descriptor (an identity check is ~4x cheaper than ==)


def as_tokens(tokens: Tokens) -> np.ndarray:
    """Token ids as a 1-D int32 array (no copy when already one).

    Python lists/tuples whose first element is an ``int`` are converted with ``np.fromiter`` (faster
    than ``np.asarray(...).astype(np.int32)``; ids outside int32 raise ``ValueError``). Buffers
    (``array('q')``, int ndarrays) are cast without a Python loop."""
    if (
        type(tokens) is np.ndarray
        and (tokens.dtype is _INT32 or tokens.dtype == np.int32)
        and tokens.ndim == 1
    ):
        return tokens
    if isinstance(tokens, list | tuple) and tokens and type(tokens[0]) is int:
        try:
            return np.fromiter(tokens, dtype=np.int32, count=len(tokens))
        except OverflowError as e:
            raise ValueError(f"token ids must fit in int32: {e}") from None
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.dtype != np.int32:
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
    return arr


_LCP_HEAD = 16  # numpy fallback: first window when a divergence right at the start is likely
_LCP_CHUNK = 16_384  # numpy fallback: window size otherwise (bounds the bool temporary to 16 KiB)


def lcp_numpy(
    key: np.ndarray, tokens: np.ndarray, offset: int, start: int = 0, first: int = _LCP_CHUNK
) -> int:
    """Length of the common prefix of ``key[start:]`` and ``tokens[offset:]`` (int32 arrays; tokens).

    Pure-numpy fallback of the C routine ``_lcp_native.lcp`` (identical results): compares a first
    window of ``first`` tokens, then windows of ``_LCP_CHUNK`` tokens (``!=`` + short-circuiting bool
    ``argmax``, ~0.25 ns/token hot + ~1 us per window), stopping at the first window with a
    difference. A full match costs one pass over ``len(key)`` tokens and allocates at most 16 KiB."""
    m = min(len(key) - start, len(tokens) - offset)
    i, step = 0, first
    while i < m:
        j = i + step
        if j > m:
            j = m
        neq = key[start + i : start + j] != tokens[offset + i : offset + j]
        k = int(neq.argmax())
        if neq[k]:
            return i + k
        i, step = j, _LCP_CHUNK
    return max(m, 0)


try:  # built by ``pip install`` (setup.py); optional
    from ._lcp_native import lcp as _lcp_c
    from ._lcp_native import walk as _walk_c
except ImportError:  # no C compiler at install time: the numpy fallbacks give the same results
    _lcp_c = _walk_c = None

HAVE_NATIVE_LCP = _lcp_c is not None
"""True when the C routines of ``_lcp_native`` (LCP and the match descent) were built at install time."""

# ``lcp(key, tokens, offset, start=0)``: length of the common prefix of ``key[start:]`` and
# ``tokens[offset:]`` (1-D int32 arrays, ``offset, start >= 0``; 0 when either side is empty or out of
# range). The C routine when built (~0.1 us per call + ~0.1 ns/token hot; memory-bound when cold),
# else :func:`lcp_numpy`. ``lcp_near`` is the same, tuned for a divergence within the first tokens
# (hint resumption); the C routine always scans its first 16 tokens element-wise.
if _lcp_c is not None:
    lcp = lcp_near = _lcp_c
else:

    def lcp(key: np.ndarray, tokens: np.ndarray, offset: int, start: int = 0) -> int:
        return lcp_numpy(key, tokens, offset, start)

    def lcp_near(key: np.ndarray, tokens: np.ndarray, offset: int, start: int = 0) -> int:
        return lcp_numpy(key, tokens, offset, start, _LCP_HEAD)


def walk_py(
    children: dict[int, Node], t: np.ndarray, d: int
) -> tuple[int, tuple[Node, ...], tuple[int, ...]]:
    """The pure descent of :meth:`RadixTree.match` from ``children`` at token index ``d`` (numpy).

    Follows the child keyed by ``t[d]`` and adds the common-prefix length of its key and ``t[d:]`` to
    ``d`` while edges match fully. Returns ``(d, path, versions)``: the matched depth (tokens), the
    visited nodes in order (the last one may be matched partially) and their ``version``. Python twin
    of ``_lcp_native.walk`` (identical results), used when the extension was not built."""
    path: list[Node] = []
    n = len(t)
    while d < n:
        child = children.get(t.item(d))
        if child is None:
            break
        key = child.key
        m = len(key)
        if m <= _LCP_CHUNK and m <= n - d:  # one window: lcp_numpy inlined (~0.5 us less per edge)
            neq = key != t[d : d + m]
            k = int(neq.argmax())
            if not neq[k]:
                k = m
        else:
            k = lcp_numpy(key, t, d)
        path.append(child)
        d += k
        if k < m:
            break
        children = child.children
    return d, tuple(path), tuple([p.version for p in path])


walk: Callable[[dict[int, Node], np.ndarray, int], tuple[int, tuple[Node, ...], tuple[int, ...]]] = (
    _walk_c if _walk_c is not None else walk_py
)


def same_prefix(a: np.ndarray, b: np.ndarray, n: int) -> bool:
    """``a[:n] == b[:n]`` elementwise (both int32, at least ``n`` long)."""
    return a is b or lcp(a[:n], b, 0) == n

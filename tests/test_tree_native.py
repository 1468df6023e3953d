"""The radix tree's C fast path (``sglang_sparse.tree._lcp_native``) against its pure-Python twins.

* ``lcp`` vs ``lcp_numpy`` vs a naive loop on random inputs and the edge cases (empty sides, full
  match, a difference at the first / last token, unequal lengths, offsets past the end, strided
  views, block boundaries of the C routine) and its argument validation.
* ``walk`` vs ``walk_py`` on random trees.
* A whole randomised match/insert/evict workload run with the C routines and with the fallbacks
  (monkeypatched in) gives identical results and trees.

The C tests are skipped when the extension was not built (no compiler at install time).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from sglang_sparse.tree import RadixTree, radix
from sglang_sparse.tree import lcp as lcp_module
from sglang_sparse.tree.lcp import _LCP_HEAD, HAVE_NATIVE_LCP, lcp_numpy, walk_py

native = pytest.mark.skipif(not HAVE_NATIVE_LCP, reason="C extension _lcp_native not built")


def naive_lcp(key: np.ndarray, tokens: np.ndarray, offset: int, start: int = 0) -> int:
    a, b = key[start:].tolist(), tokens[offset:].tolist()
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _cases(rng: np.random.Generator):
    """(key, tokens, offset, start) tuples: edge cases first, then random ones."""
    base = rng.integers(-(2**31), 2**31 - 1, size=5000, dtype=np.int32)
    empty = np.empty(0, dtype=np.int32)
    yield empty, empty, 0, 0
    yield empty, base, 0, 0
    yield base, empty, 0, 0
    yield base, base, 0, 0  # same object, full match
    yield base, base.copy(), 0, 0
    yield base[:10], base, 0, 0  # key shorter
    yield base, base[:10], 0, 0  # tokens shorter
    yield base, base, len(base), 0  # offset at the end
    yield base, base, len(base) + 5, 0  # offset past the end
    yield base, base, 0, len(base) + 5  # start past the end
    yield base[::2].copy(), base[::2], 0, 0  # strided tokens
    yield base[::3], base[::3].copy(), 3, 3  # strided key
    yield base[::-1], base[::-1].copy(), 0, 0  # negative stride
    for where in (0, 1, 15, 16, 17, 63, 64, 65, 1023, 1024, 1025, 1039, 1040, 2047, 2048, 4095, 4999):
        t = base.copy()
        t[where] ^= 1 << 30
        yield base, t, 0, 0
        yield base, np.concatenate([base[:7], t]), 7, 0  # offset shifts the alignment
        yield base, t[3:], 0, 3
        u = base.copy()
        u[where] = np.int32(-(2**31)) if base[where] != -(2**31) else 0  # sign bit / extremes
        yield base, u, 0, 0
    for _ in range(300):
        n = int(rng.integers(0, 3000))
        key = rng.integers(0, 3, size=n, dtype=np.int32)  # small alphabet: long random common prefixes
        tokens = np.concatenate(
            [key[: int(rng.integers(0, n + 1))], rng.integers(0, 3, size=50, dtype=np.int32)]
        )
        yield key, tokens, int(rng.integers(0, 5)), int(rng.integers(0, 5))
        same = key.copy()
        yield key, same, 0, 0


@native
def test_native_lcp_agrees_with_numpy_and_naive():
    from sglang_sparse.tree._lcp_native import lcp

    rng = np.random.default_rng(7)
    for key, tokens, offset, start in _cases(rng):
        expect = naive_lcp(key, tokens, offset, start)
        assert lcp(key, tokens, offset, start) == expect, (len(key), len(tokens), offset, start)
        if start == 0:
            assert lcp(key, tokens, offset) == expect
        assert lcp_numpy(key, tokens, offset, start) == expect
        assert lcp_numpy(key, tokens, offset, start, _LCP_HEAD) == expect


@native
def test_native_lcp_validates_arguments():
    from sglang_sparse.tree._lcp_native import lcp

    a = np.arange(10, dtype=np.int32)
    with pytest.raises(TypeError):
        lcp(a.astype(np.int64), a, 0)
    with pytest.raises(TypeError):
        lcp(a, a.astype(np.uint8), 0)
    with pytest.raises(TypeError):
        lcp(a, a.reshape(2, 5), 0)
    with pytest.raises(TypeError):
        lcp(a, [1, 2, 3], 0)  # no buffer protocol
    with pytest.raises(TypeError):
        lcp(a, a)
    with pytest.raises(ValueError):
        lcp(a, a, -1)
    with pytest.raises(ValueError):
        lcp(a, a, 0, -1)
    assert lcp(a, memoryview(a), 2, 2) == 8  # any 1-D int32 buffer


def _random_tree(rng: np.random.Generator, n_seqs: int, alphabet: int) -> tuple[RadixTree, list[np.ndarray]]:
    tree = RadixTree(kv_bytes_per_token=2, state_bytes=10)
    seqs = []
    for _ in range(n_seqs):
        s = rng.integers(0, alphabet, size=int(rng.integers(1, 200)), dtype=np.int32)
        tree.insert(s, None, {len(s): 0})
        seqs.append(s)
    return tree, seqs


@native
def test_native_walk_agrees_with_python_walk():
    from sglang_sparse.tree._lcp_native import walk

    rng = np.random.default_rng(3)
    for alphabet in (2, 4, 50):
        tree, seqs = _random_tree(rng, 60, alphabet)
        queries = [
            rng.integers(0, alphabet, size=int(rng.integers(0, 250)), dtype=np.int32) for _ in range(100)
        ]
        queries += [
            np.concatenate([s[: int(rng.integers(0, len(s) + 1))], q[:20]])
            for s, q in zip(seqs, queries[: len(seqs)], strict=True)
        ]
        queries += [s[::2] for s in seqs[:10]]  # strided queries
        for q in queries:
            for d0 in (0, 1):
                children = tree.root.children
                if d0:
                    if not len(q) or int(q[0]) not in children:
                        continue
                    first = children[int(q[0])]
                    if len(first.key) != 1:
                        continue
                    children = first.children  # resume below a one-token edge
                got, want = walk(children, q, d0), walk_py(children, q, d0)
                assert got[0] == want[0] and got[2] == want[2]
                assert len(got[1]) == len(want[1]) and all(
                    a is b for a, b in zip(got[1], want[1], strict=True)
                )
                assert type(got[1]) is tuple and type(got[2]) is tuple
    with pytest.raises(ValueError):
        walk({}, np.arange(3, dtype=np.int32), -1)
    with pytest.raises(TypeError):
        walk({}, np.arange(3, dtype=np.int64), 0)
    assert walk({}, np.empty(0, dtype=np.int32), 0) == (0, (), ())


def _workload(seed: int) -> list:
    """A randomised match / insert (with and without hint) / evict run; returns everything observed."""
    rng = np.random.default_rng(seed)
    tree = RadixTree(kv_bytes_per_token=2, state_bytes=10)
    out = []
    for step in range(600):
        n = int(rng.integers(1, 80))
        seq = rng.integers(0, 3, size=n, dtype=np.int32)
        if step % 3 == 0:
            seq = np.concatenate([seq, seq])[::2]  # a strided view
        m = tree.match(seq)
        out.append((m.kv_depth, m.resume_depth, m.node.uid, m.ckpt_node and m.ckpt_node.uid, m.versions))
        out.append(tuple(p.uid for p in m.path))
        ck = {int(p): ("s", step, int(p)) for p in rng.integers(1, n + 1, size=2)}
        r = tree.insert(seq, np.arange(n), ck, hint=m if step % 2 else None)
        out.append((r.prefix_len, r.node.uid, [u.tolist() for u in r.unused_kv], r.unused_states))
        if step % 5 == 0:
            leaf = tree.lru_leaf()
            if leaf is not None:
                tree.drop_leaf(leaf)
        if step % 50 == 0:
            tree.check()
    tree.check()
    out.append([(n.uid, n.start, n.key.tolist(), n.checkpoints.items(), n.last_access) for n in tree.nodes()])
    return out


@native
def test_tree_with_fallbacks_equals_tree_with_c(monkeypatch: pytest.MonkeyPatch):
    with_c = _workload(11)
    calls = {"lcp": 0, "walk": 0}

    def lcp(k: np.ndarray, t: np.ndarray, o: int, s: int = 0) -> int:
        calls["lcp"] += 1
        return lcp_numpy(k, t, o, s)

    def walk(children: dict, t: np.ndarray, d: int) -> tuple:
        calls["walk"] += 1
        return walk_py(children, t, d)

    monkeypatch.setattr(lcp_module, "lcp", lcp)  # same_prefix (insert hints)
    monkeypatch.setattr(radix, "lcp_near", lambda k, t, o, s=0: lcp_numpy(k, t, o, s, _LCP_HEAD))
    monkeypatch.setattr(radix, "walk", walk)
    assert _workload(11) == with_c
    assert calls["walk"] > 600  # the fallbacks really ran


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_native_extensions_are_built_when_a_compiler_exists() -> None:
    """The install builds both C fast paths (setup.py); a silent fallback would cost 1.3-50x."""
    from sglang_sparse.placement import dp

    assert HAVE_NATIVE_LCP, "sglang_sparse.tree._lcp_native missing: reinstall with a C compiler"
    assert dp.HAVE_NATIVE, "sglang_sparse.placement._cht_native missing"

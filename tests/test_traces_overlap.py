"""overlap_depths is exact: checked against a brute-force implementation (no real data needed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_sparse.traces.overlap import PrefixIndex, overlap_depths
from sglang_sparse.traces.schema import Request


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def brute_force(reqs: Sequence[Request]) -> list[int]:
    out = []
    for i, r in enumerate(reqs):
        seqs = [reqs[j].input_tokens + reqs[j].output_tokens for j in range(i)]
        out.append(max((_lcp(r.input_tokens, s) for s in seqs), default=0))
    return out


# Small alphabets and shared stems make long common prefixes likely; big ids test the encoding.
_token = st.sampled_from([0, 1, 2, 255, 256, 65536, 248045, 2**32 - 1])
_seq = st.lists(_token, max_size=12)


@st.composite
def _requests(draw: st.DrawFn) -> list[Request]:
    stems = draw(st.lists(_seq, min_size=1, max_size=3))
    n = draw(st.integers(0, 10))
    reqs = []
    for i in range(n):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        inp = stem[:cut] + draw(_seq)
        reqs.append(Request.make(f"s{i}", 0, float(i), inp, draw(st.lists(_token, max_size=6))))
    return reqs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=_requests(), block=st.sampled_from([1, 2, 3, 5, 64]))
def test_matches_brute_force(reqs: list[Request], block: int) -> None:
    got = overlap_depths(reqs, block=block)
    assert got.dtype == np.int64
    assert got.tolist() == brute_force(reqs)


def test_known_example() -> None:
    a = Request.make("a", 0, 0.0, list(range(100)), [500, 501])
    b = Request.make("b", 0, 1.0, list(range(100)) + [500, 7], [])  # extends a's input+output by 1
    c = Request.make("c", 0, 2.0, list(range(70)) + [9], [])
    d = Request.make("d", 0, 3.0, [5], [])
    assert overlap_depths([a, b, c, d]).tolist() == [0, 101, 70, 0]
    assert overlap_depths([]).shape == (0,)


def test_prefix_index_rejects_bad_ids() -> None:
    idx = PrefixIndex(block=4)
    with pytest.raises(ValueError):
        idx.insert([1, -1])
    with pytest.raises(ValueError):
        PrefixIndex(block=0)


def test_prefix_index_query() -> None:
    idx = PrefixIndex(block=2)
    idx.insert([1, 2, 3, 4, 5])
    idx.insert([1, 2, 3, 9])
    assert idx.query([1, 2, 3, 4, 6]) == 4
    assert idx.query([1, 2, 3, 9, 9, 9]) == 4
    assert idx.query([1, 2]) == 2
    assert idx.query([2]) == 0
    assert idx.query([]) == 0

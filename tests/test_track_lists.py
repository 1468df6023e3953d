"""Index arithmetic of captures as SGLang track-list entries (``sglang_adapter/track_lists.py``).

Every entry is checked against what its source *means* in the kernel's layout, independently of
the code under test: an ``h`` row names (batch row, tokens of its extend) by the layout's own
definition (SGLang's Triton ``chunk_gated_delta_rule_fwd_h``, FlashInfer's ``state_checkpoints``
with ``checkpoint_cu_starts``, Mamba2's flattened chunk grid), a tail adds its tokens to that, a
conv entry names the last ``W - 1`` tokens before the position. No SGLang, no torch.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_sparse.sglang_adapter.track_lists import (
    Layout,
    checkpoint_cu_starts,
    interior_capturable,
    track_additions,
)


def _starts(lens: list[int]) -> list[int]:
    out, at = [], 0
    for n in lens:
        out.append(at)
        at += n
    return out


def _row_meaning(layout: Layout, grid: int, lens: list[int], row: int) -> tuple[int, int]:
    """(batch row, tokens of its extend) of ``h`` row ``row``, from the layout's definition."""
    at = 0
    for n, length in enumerate(lens):
        if layout is Layout.CHUNKS:
            k = -(-length // grid)  # rows: states before chunks 0 .. k-1
            if row < at + k:
                return n, (row - at) * grid
        elif layout is Layout.CHECKPOINTS:
            k = length // grid  # rows: states after (j + 1) * grid tokens
            if row < at + k:
                return n, (row - at + 1) * grid
        at += k
    raise AssertionError(f"h row {row} outside the layout")


def _flat_meaning(grid: int, lens: list[int], row: int) -> tuple[int, int]:
    """Mamba2: row i is the state at flattened token i * grid, inside the row that holds it."""
    tok = row * grid
    starts = _starts(lens)
    for n in range(len(lens)):
        if starts[n] < tok < starts[n] + lens[n]:
            return n, tok - starts[n]
    raise AssertionError(f"flat h row {row} is not strictly inside a row")


def _check(layout: Layout, grid: int, lens: list[int], caps: list[tuple[int, int]], conv_len: int) -> None:
    starts = _starts(lens)
    rows = [n for n, _ in caps]
    offs = [r for _, r in caps]
    slots = [1000 + j for j in range(len(caps))]
    a = track_additions(rows, offs, slots, starts, lens, conv_len=conv_len, layout=layout, grid=grid)
    want = {1000 + j: (n, r) for j, (n, r) in enumerate(caps)}
    got: dict[int, tuple[int, int]] = {}
    for src, d in zip(a.h_src, a.h_dst, strict=True):
        got[d] = (
            _flat_meaning(grid, lens, src) if layout is Layout.FLAT else _row_meaning(layout, grid, lens, src)
        )
    for n, d in zip(a.final_rows, a.final_dst, strict=True):
        got[d] = (n, lens[n])
    for n, end, d in zip(a.recompute_rows, a.recompute_end_locs, a.recompute_dst, strict=True):
        assert starts[n] < end < starts[n] + lens[n]
        got[d] = (n, end - starts[n])
    pre = dict(zip(a.pre_dst, a.pre_rows, strict=True))
    for j, d in enumerate(a.tail_dst):
        toks = a.tail_tokens[a.tail_cu[j] : a.tail_cu[j + 1]]
        if a.tail_src[j] < 0:
            n, base = pre[d], 0  # the initial state, copied into the slot before the kernel
        else:
            n, base = _row_meaning(layout, grid, lens, a.tail_src[j])
        assert toks == list(range(starts[n] + base, starts[n] + base + len(toks))), (toks, n, base)
        assert 0 < len(toks) < grid
        got[d] = (n, base + len(toks))
    assert got == want  # every capture exactly once, each naming its own state
    if conv_len:
        assert a.conv_dst == slots
        for d, idx in zip(a.conv_dst, a.conv_idx, strict=True):
            n, r = want[d]
            assert idx == [max(i, 0) for i in range(starts[n] + r - conv_len, starts[n] + r)]
        # windows reaching before the extend start, and only those, get a fix from the initial window
        fixes = {
            d: (n, r) for n, r, d in zip(a.conv_fix_rows, a.conv_fix_offsets, a.conv_fix_dst, strict=True)
        }
        assert fixes == {d: nr for d, nr in want.items() if nr[1] < conv_len}
    else:
        assert a.conv_dst == [] and a.conv_idx == [] and a.conv_fix_dst == []
    assert a.n_ssm == len(caps)
    if layout is Layout.CHECKPOINTS:
        reads = any(s >= 0 for s in (*a.h_src, *a.tail_src))
        assert (a.checkpoint_counts is not None) == reads
        if reads:
            assert a.checkpoint_counts == [n // grid for n in lens]
    else:
        assert a.checkpoint_counts is None and a.pre_dst == []


@st.composite
def _batches(draw, layouts=(Layout.CHUNKS, Layout.CHECKPOINTS, Layout.FLAT)):
    layout = draw(st.sampled_from(layouts))
    grid = draw(st.sampled_from([64, 128] if layout is not Layout.CHUNKS else [64]))
    conv_len = draw(st.sampled_from([0, 3]))
    lens = draw(st.lists(st.integers(1, 4 * grid + 7), min_size=1, max_size=5))
    caps: list[tuple[int, int]] = []
    for n, length in enumerate(lens):
        offs = draw(st.sets(st.integers(1, length), max_size=4))
        caps += [(n, r) for r in sorted(offs)]
    return layout, grid, lens, caps, conv_len


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_every_capture_names_its_own_state(batch) -> None:
    _check(*batch)


def test_chunks_layout_worked_example() -> None:
    """Triton/CPU: rows 70 and 130 tokens (h rows 0-1 and 2-4); captures on the grid, off it
    (tails from h rows, row 0 being the initial state) and at the extend end (final)."""
    a = track_additions(
        [0, 0, 1, 1, 1], [64, 70, 10, 128, 130], [7, 8, 9, 10, 11], [0, 70], [70, 130],
        conv_len=3, layout=Layout.CHUNKS, grid=64,
    )  # fmt: skip
    assert (a.h_src, a.h_dst) == ([1, 4], [7, 10])
    assert (a.final_rows, a.final_dst) == ([0, 1], [8, 11])
    assert (a.tail_src, a.tail_dst) == ([2], [9])  # row 1's initial state: h row 2
    assert a.tail_tokens == list(range(70, 80)) and a.tail_cu == [0, 10]
    assert a.conv_idx[2] == [77, 78, 79]
    assert a.checkpoint_counts is None


def test_flashinfer_checkpoint_arithmetic() -> None:
    """FlashInfer: checkpoint j of row n is the state after (j + 1) * N tokens at
    ``cu[n] + j``, cu over ``len // N`` of every row; below the first checkpoint the tail starts
    from the initial state (``pre``), which the kernel does not return."""
    lens = [200, 64, 300]  # 3, 1, 4 checkpoints of N = 64: cu = [0, 3, 4, 8]
    a = track_additions(
        [0, 0, 1, 2, 2], [128, 150, 30, 64, 299], [1, 2, 3, 4, 5], _starts(lens), lens,
        conv_len=0, layout=Layout.CHECKPOINTS, grid=64,
    )  # fmt: skip
    assert checkpoint_cu_starts(a.checkpoint_counts) == [0, 3, 4, 8]
    assert (a.h_src, a.h_dst) == ([1, 4], [1, 4])  # after 128 of row 0, after 64 of row 2
    assert a.tail_src == [1, -1, 7] and a.tail_dst == [2, 3, 5]
    assert (a.pre_rows, a.pre_dst) == ([1], [3])
    assert a.tail_cu == [0, 22, 52, 95]
    # page 128: N = 128, offsets on the page grid but off N become tails of < N tokens
    b = track_additions([0], [384], [9], [0], [512], conv_len=0, layout=Layout.CHECKPOINTS, grid=128)
    assert b.h_src == [2] and b.checkpoint_counts == [4]
    c = track_additions([0], [512], [9], [0], [512], conv_len=0, layout=Layout.CHECKPOINTS, grid=128)
    assert c.final_dst == [9] and c.checkpoint_counts is None  # the final state needs none


def test_flat_layout_uses_sglang_rule() -> None:
    """Mamba2: an ``h`` row exactly when the flattened position is on the chunk grid (what SGLang's
    ``build_prefill_track_plan`` does), else the scan's exact recompute."""
    lens = [100, 300]
    a = track_additions(
        [1, 1, 1], [156, 100, 300], [5, 6, 7], _starts(lens), lens, conv_len=3, layout=Layout.FLAT, grid=128
    )
    assert (a.h_src, a.h_dst) == ([2], [5])  # 100 + 156 = 256 = 2 * 128
    assert (a.recompute_rows, a.recompute_end_locs, a.recompute_dst) == ([1], [200], [6])
    assert a.final_dst == [7] and a.tail_dst == []


def test_invalid_captures_are_refused() -> None:
    kw = dict(conv_len=3, layout=Layout.CHUNKS, grid=64)
    with pytest.raises(ValueError, match="outside"):
        track_additions([0], [0], [1], [0], [10], **kw)
    with pytest.raises(ValueError, match="outside"):
        track_additions([0], [11], [1], [0], [10], **kw)
    short = track_additions([0], [2], [1], [0], [10], **kw)  # a window reaching before the extend
    assert short.conv_idx == [[0, 0, 1]] and (short.conv_fix_rows, short.conv_fix_offsets) == ([0], [2])
    with pytest.raises(ValueError, match="row 3 outside"):
        track_additions([3], [5], [1], [0], [10], **kw)
    with pytest.raises(ValueError, match="no h"):
        track_additions([0], [5], [1], [0], [10], conv_len=0, layout=Layout.NONE, grid=64)
    assert track_additions([0], [10], [1], [0], [10], conv_len=0, layout=Layout.NONE, grid=64).final_dst == [
        1
    ]
    assert not interior_capturable(Layout.NONE) and interior_capturable(Layout.CHECKPOINTS)

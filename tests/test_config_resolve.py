"""``config.resolve_defaults``: every auto option of a server settled from the resolved capture
mode, the page size, SGLang's state grid and the state strategy (no SGLang needed)."""

from __future__ import annotations

import pytest

from sglang_sparse.sglang_adapter.config import (
    CUT_MIN_GAIN,
    SparseConfig,
    SparseConfigError,
    resolve_defaults,
)


def settle(capture: str, page: int, state_grid: int, extra_buffer: bool = True, **opts) -> SparseConfig:
    return resolve_defaults(
        SparseConfig(**opts), capture=capture, page=page, state_grid=state_grid, extra_buffer=extra_buffer
    )


def test_gdn_forward_capture_keeps_the_64_grid_and_page_exact_tails() -> None:
    c = settle("forward", page=16, state_grid=64)
    assert (c.capture, c.grid, c.branch_grid, c.tail_grid, c.min_cut_gain) == ("forward", 64, 64, 16, 0)


def test_mamba2_forward_capture_plans_below_its_128_token_state_grid() -> None:
    """The SSM chunk (128) is SGLang's state grid, but the capture recomputes exact states inside a
    chunk, so plans keep lcm(64, page)."""
    assert settle("forward", page=16, state_grid=128).grid == 64
    assert settle("forward", page=128, state_grid=128).grid == 128  # the page still rules
    assert settle("forward", page=16, state_grid=256, grid=192).grid == 192  # explicit, off its grid


def test_cut_on_extra_buffer_stays_on_the_state_grid() -> None:
    c = settle("cut", page=16, state_grid=128)
    assert (c.grid, c.branch_grid, c.tail_grid, c.min_cut_gain) == (128, 128, 128, CUT_MIN_GAIN)
    with pytest.raises(
        SparseConfigError, match="SGLANG_SPARSE_GRID=64 must be a multiple of the state grid 128"
    ):
        settle("cut", page=16, state_grid=128, grid=64)
    with pytest.raises(SparseConfigError, match="SGLANG_SPARSE_TAIL_GRID=16"):
        settle("cut", page=16, state_grid=128, tail_grid=16)


def test_no_buffer_cuts_are_exact_anywhere() -> None:
    c = settle("cut", page=1, state_grid=128, extra_buffer=False, tail_grid=8)
    assert (c.grid, c.tail_grid) == (64, 8)


def test_explicit_values_win() -> None:
    c = settle("forward", page=16, state_grid=64, grid=128, branch_grid=16, tail_grid=32, min_cut_gain=5)
    assert (c.grid, c.branch_grid, c.tail_grid, c.min_cut_gain) == (128, 16, 32, 5)

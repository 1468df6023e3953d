"""Decode-track masks of the sparse backend on extra_buffer (``sglang_adapter/capture.py``):
which rows copy their state in a decode step, on fake batches (no server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from sglang_sparse.sglang_adapter import capture  # noqa: E402
from sglang_sparse.sglang_adapter.cache import final_track_depth  # noqa: E402
from sglang_sparse.sglang_adapter.capture import (  # noqa: E402
    prefix_cache_update_hook,
    refine_decode_tracks,
)

GRID = 64


def req(rid: str, prompt: int, max_new: int | None) -> SimpleNamespace:
    return SimpleNamespace(
        rid=rid, origin_input_ids=[0] * prompt, sampling_params=SimpleNamespace(max_new_tokens=max_new)
    )


def batch(reqs, seq_lens, wanting, *, page: int = 1, overlap: bool = True, exact=None) -> SimpleNamespace:
    """A decode batch as ``prepare_for_decode`` leaves it: SGLang's grid masks from ``seq_lens``;
    ``wanting``: the rids whose plan wants a decode state, ``exact`` (default: the same) those whose
    plan wants an exact finish state."""
    mask = [s % GRID == 0 for s in seq_lens]
    nxt = [s % GRID == GRID - 1 for s in seq_lens] if overlap else None
    exact = wanting if exact is None else exact
    depths = {
        r.rid: final_track_depth(len(r.origin_input_ids), r.sampling_params.max_new_tokens, page)
        for r in reqs
    }
    # what SparseRadixCache.plan_request records: the tracked depth of each exact-finish request
    finals = {rid: d for rid, d in depths.items() if rid in exact and d is not None}
    cache = SimpleNamespace(wants_decode_state=lambda rid: rid in wanting, finish_tracks=finals)
    return SimpleNamespace(
        reqs=reqs,
        seq_lens_cpu=torch.tensor(seq_lens),
        mamba_track_mask_cpu=mask,
        mamba_track_mask_next_cpu=nxt,
        mamba_track_mask=torch.tensor(mask),
        tree_cache=cache,
        device="cpu",
    )


def test_final_track_depth_is_the_finish_key_page_aligned() -> None:
    assert final_track_depth(250, 16, 1) == 265  # 250 + 16 - 1: the last token is not fed
    assert final_track_depth(250, 16, 16) == 256
    assert final_track_depth(296, 16, 16) == 304
    assert final_track_depth(10, None, 1) is None and final_track_depth(10, 0, 1) is None


def test_exact_finish_track_added_only_for_requests_that_want_a_final_state() -> None:
    a, b, c = req("a", 100, 20), req("b", 100, 20), req("c", 300, 40)  # finals 119, 119, 339
    # a and b at their final step; c one step before its final; grid rows 128 and 191 for d and e
    d, e = req("d", 100, 200), req("e", 100, 200)
    bt = batch([a, b, c, d, e], [119, 119, 338, 128, 191], wanting={"a", "c", "d"})
    changed = refine_decode_tracks(bt)
    assert bt.mamba_track_mask_cpu == [True, False, False, True, False]
    # next-mask: c's final is the next step; e does not want its grid point 192; d keeps SGLang's
    assert bt.mamba_track_mask_next_cpu == [False, False, True, False, False]
    assert changed == 1  # a's mask set (d was already set, e had none in this step)
    assert bt.mamba_track_mask.tolist() == bt.mamba_track_mask_cpu


def test_no_exact_finish_track_when_the_final_state_is_only_on_probation() -> None:
    """A request whose only state past the prompt is the unplanned last token (on probation) keeps
    its grid points but gets no exact finish copy: it would displace first-sight states."""
    a = req("a", 100, 20)
    bt = batch([a, req("b", 100, 200)], [119, 128], wanting={"a", "b"}, exact=set())
    assert refine_decode_tracks(bt) == 0
    assert bt.mamba_track_mask_cpu == [False, True]


def test_a_request_without_a_length_limit_gets_no_finish_track() -> None:
    a = req("a", 100, None)
    bt = batch([a], [119], wanting={"a"})
    assert bt.tree_cache.finish_tracks == {}
    assert refine_decode_tracks(bt) == 0 and bt.mamba_track_mask_cpu == [False]


def test_grid_rows_of_requests_without_a_final_state_are_cleared() -> None:
    a = req("a", 100, 200)
    bt = batch([a], [128], wanting=set())
    assert refine_decode_tracks(bt) == 1
    assert bt.mamba_track_mask_cpu == [False] and bt.mamba_track_mask.tolist() == [False]


def test_without_overlap_only_this_steps_mask_changes() -> None:
    a = req("a", 100, 20)
    bt = batch([a], [118], wanting={"a"}, overlap=False)
    assert refine_decode_tracks(bt) == 0 and bt.mamba_track_mask_cpu == [False]
    bt = batch([a], [119], wanting={"a"}, overlap=False)
    assert refine_decode_tracks(bt) == 1 and bt.mamba_track_mask_cpu == [True]


def test_page_size_moves_the_final_track_to_the_page_grid() -> None:
    a = req("a", 296, 16)  # key 311 -> 304 on 16-token pages
    bt = batch([a], [304], wanting={"a"}, page=16)
    assert refine_decode_tracks(bt) == 1 and bt.mamba_track_mask_cpu == [True]
    bt = batch([a], [311], wanting={"a"}, page=16)
    assert refine_decode_tracks(bt) == 0 and bt.mamba_track_mask_cpu == [False]


class _Pool:
    @staticmethod
    def get_mamba_ping_pong_other_idx(i: int) -> int:
        return 1 - i


def _processor(page: int = 1, tracking: bool = True) -> SimpleNamespace:
    return SimpleNamespace(tree_cache=SimpleNamespace(page_size=page, decode_tracking=tracking))


def _track_req(committed: int) -> SimpleNamespace:
    kv = SimpleNamespace(
        mamba_ping_pong_track_buffer=[3, 4], kv_committed_len=committed, mamba_next_track_idx=0
    )
    return SimpleNamespace(kv=kv, rid="a")


def test_off_grid_known_boundary_flips_the_slot_without_sglangs_grid_assertion() -> None:
    calls: list[int] = []
    capture.set_decode_grid(GRID)
    try:
        _check_flips(calls)
    finally:
        capture.set_decode_grid(None)
    # no sparse scheduler in this process (no grid set): always SGLang's own code
    r = _track_req(265)
    prefix_cache_update_hook(
        lambda *a, **k: calls.append(-1), _processor(), r, SimpleNamespace(), None, 0, True
    )
    assert calls[-1] == -1 and r.kv.mamba_next_track_idx == 0


def _check_flips(calls: list[int]) -> None:

    def original(self, r, b, result, i, known_boundary=False):
        calls.append(r.kv.kv_committed_len)

    bt = SimpleNamespace(req_to_token_pool=_Pool())
    r = _track_req(265)
    prefix_cache_update_hook(original, _processor(), r, bt, None, 0, known_boundary=True)
    assert r.kv.mamba_next_track_idx == 1 and calls == []
    # on the grid, not known, or another backend: SGLang's own code
    for proc, committed, known in (
        (_processor(), 256, True),
        (_processor(), 265, False),
        (_processor(tracking=False), 265, True),
    ):
        r = _track_req(committed)
        prefix_cache_update_hook(original, proc, r, bt, None, 0, known_boundary=known)
        assert r.kv.mamba_next_track_idx == 0
    assert calls == [256, 265, 265]

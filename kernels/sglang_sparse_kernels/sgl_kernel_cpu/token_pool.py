"""Request -> token-slot table writes (``req_to_token``) done by the scheduler on every batch."""

from __future__ import annotations

import torch


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int | None = None,
) -> None:
    """``req_to_token[req_pool_indices[b], start[b]:end[b]] = out_cache_loc[o_b : o_b + end[b] - start[b]]``
    where ``o_b`` is the running sum of the earlier requests' lengths (in place).

    Args:
        req_pool_indices, start_offset, end_offset: ``[B]`` integer tensors.
        req_to_token: ``[R, pool_len]`` table; out_cache_loc: ``[sum(end - start)]`` token slots.
        pool_len: row length of ``req_to_token`` (checked when given).
    """
    if pool_len is not None and req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token row length {req_to_token.shape[1]}")
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    off = 0
    for row, lo, hi in zip(rows, starts, ends, strict=True):
        n = int(hi) - int(lo)
        if n > 0:
            req_to_token[int(row), int(lo) : int(hi)] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += max(n, 0)

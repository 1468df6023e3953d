"""Row moves inside every layer's KV buffer, addressed by raw data pointers.

SGLang's KV pools keep one buffer per layer (``[rows, ...]``) and pass their base addresses and
row strides (in bytes) as two tensors; moving a token's KV means copying row ``src_loc[j]`` to row
``tgt_loc[j]`` in every buffer.
"""

from __future__ import annotations

import ctypes

import torch


def _byte_view(ptr: int, nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor aliasing ``nbytes`` of host memory at ``ptr`` (no copy)."""
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


def copy_all_layer_kv_cache(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For each buffer ``i`` (base ``data_ptrs[i]``, row stride ``strides[i]`` bytes) copy row
    ``src_loc[j]`` to row ``tgt_loc[j]`` for all ``j`` (all sources are read before any write).

    Args:
        data_ptrs: ``[L]`` uint64/int64 base addresses of CPU buffers.
        strides: ``[L]`` row strides in bytes.
        tgt_loc, src_loc: ``[M]`` row indices.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.long).cpu()
    src = src_loc.to(torch.long).cpu()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        stride = int(stride)
        view = _byte_view(int(ptr), rows * stride).view(rows, stride)
        view[tgt] = view[src].clone()

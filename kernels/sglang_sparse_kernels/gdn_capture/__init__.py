"""Gated-delta-rule (GatedDeltaNet) forward that captures recurrent states at chunk boundaries.

Layout follows FLA's ``ops/<op>/`` convention: :mod:`.naive` is the token-by-token reference,
:mod:`.chunk_torch` the chunked pure-PyTorch forward and :mod:`.chunk_triton` the forward composed from
FLA's Triton building blocks (imported lazily: it needs ``triton`` and ``flash-linear-attention``).
:mod:`.list_capture_triton` is the Triton list-capture variant (captured states written straight into
a slot-indexed state pool, the server's interface; also lazy).  :mod:`._interpret` holds the
monkey-patches that let the Triton path run under ``TRITON_INTERPRET=1``.

State convention everywhere: ``[N, HV, K, V]`` float32 (key-first, FLA's default ``state_v_first=False``).
"""

from .chunk_torch import CaptureSpec, chunk_gdn_fwd_capture
from .naive import naive_recurrent_gdn

__all__ = [
    "CaptureSpec",
    "chunk_gdn_fwd_capture",
    "chunk_gdn_fwd_capture_triton",
    "chunk_gdn_fwd_h_list_capture",
    "chunk_gdn_fwd_list_capture_triton",
    "naive_recurrent_gdn",
]

_LAZY = {
    "chunk_gdn_fwd_capture_triton": "chunk_triton",
    "chunk_gdn_fwd_h_list_capture": "list_capture_triton",
    "chunk_gdn_fwd_list_capture_triton": "list_capture_triton",
}


def __getattr__(name: str):  # lazy: keep torch-only users free of triton/fla imports
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)

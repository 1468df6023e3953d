"""Model helpers (tiny random-weight checkpoints for CPU serving tests and benchmarks)."""

from sglang_sparse.models.tiny import ARCHS, SIZES, TinySpec, make_tiny_model

__all__ = ["ARCHS", "SIZES", "TinySpec", "make_tiny_model"]

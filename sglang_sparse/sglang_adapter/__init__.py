"""SGLang 0.5.23 adapter: `--radix-cache-backend sparse` (the only sglang_sparse package importing SGLang).

* :mod:`.plugin` -- entry point ``register()`` and the backend factory (no top-level SGLang import).
* :mod:`.config` -- ``SGLANG_SPARSE_*`` / ``SGLANG_SPARSE_CONFIG`` options, validated (no SGLang).
* :mod:`.tree_policy` -- the policy on a token-free mirror of SGLang's tree: capture plan, admission,
  eviction order, alpha tuning, stats (no SGLang).
* :mod:`.cache` -- ``SparseRadixCache`` / ``SparseMambaComponent`` / prefill adder (imports SGLang).

See ``docs/sparse_backend.md``.
"""

from .config import SparseConfig, SparseConfigError

__all__ = ["SparseConfig", "SparseConfigError"]

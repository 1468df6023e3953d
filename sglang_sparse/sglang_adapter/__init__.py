"""SGLang 0.5.23 adapter: `--radix-cache-backend sparse` (the only sglang_sparse package importing SGLang).

SGLang is imported at top level only by :mod:`.cache` and :mod:`.capture` (loaded by the backend
factory, in the scheduler); :mod:`.plugin` (entry point ``register()``, factory, hooks),
:mod:`.config` (options), :mod:`.tree_policy` (the policy on a token-free mirror of SGLang's tree),
:mod:`.track_capture` (the forward side of the in-forward capture; SGLang imported lazily),
:mod:`.track_lists` (its index arithmetic, pure), :mod:`.model_cost` and :mod:`.metrics` do not.
See ``docs/sparse_backend.md``.
"""

from .config import SparseConfig, SparseConfigError

__all__ = ["SparseConfig", "SparseConfigError"]

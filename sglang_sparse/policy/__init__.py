"""Cache policies: FLOP/byte cost model, admission, eviction scoring, alpha tuning, named policies."""

from sglang_sparse.policy.cost_model import (
    AttentionSpec,
    GatedDeltaNetSpec,
    Mamba2Spec,
    MLPSpec,
    ModelCostModel,
    dtype_bytes,
)

from .admission import ADMISSIONS, capture_positions, marconi_branch_point
from .cache import CacheSnapshot, HybridCache
from .eviction import EvictionConfig, Evictor
from .registry import POLICIES, POLICY_NAMES, PolicySpec, get_policy
from .tuner import DEFAULT_ALPHA_GRID, AlphaTuner

__all__ = [
    "ADMISSIONS",
    "DEFAULT_ALPHA_GRID",
    "POLICIES",
    "POLICY_NAMES",
    "AlphaTuner",
    "AttentionSpec",
    "EvictionConfig",
    "Evictor",
    "GatedDeltaNetSpec",
    "CacheSnapshot",
    "HybridCache",
    "Mamba2Spec",
    "MLPSpec",
    "ModelCostModel",
    "PolicySpec",
    "capture_positions",
    "dtype_bytes",
    "get_policy",
    "marconi_branch_point",
]

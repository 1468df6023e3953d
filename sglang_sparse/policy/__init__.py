"""Cache policies: FLOP/byte cost model, admission, eviction scoring, alpha tuning, named policies."""

from sglang_sparse.policy.cost_model import (
    AttentionSpec,
    GatedDeltaNetSpec,
    Mamba2Spec,
    MLPSpec,
    ModelCostModel,
)

from .cache import CacheSnapshot, HybridCache
from .choose import ADMISSIONS, capture_positions, marconi_branch_point
from .evict import EvictionConfig, Evictor
from .registry import (
    POLICIES,
    POLICY_NAMES,
    PUBLISHED_NAMES,
    PUBLISHED_POLICIES,
    SIM_POLICY_NAMES,
    PolicySpec,
    PublishedSpec,
    get_policy,
    get_published,
)
from .tuner import DEFAULT_ALPHA_GRID, AlphaTuner

__all__ = [
    "ADMISSIONS",
    "DEFAULT_ALPHA_GRID",
    "POLICIES",
    "POLICY_NAMES",
    "PUBLISHED_NAMES",
    "PUBLISHED_POLICIES",
    "SIM_POLICY_NAMES",
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
    "PublishedSpec",
    "capture_positions",
    "get_policy",
    "get_published",
    "marconi_branch_point",
]

"""Trace replay of the cache policies (same code path as the SGLang adapter)."""

from .bound import HeadroomBound, ReuseProfile, headroom_bound, reuse_depths, reuse_profile
from .future import FutureIndex
from .models import MODELS, QWEN3_NEXT_80B_A3B, cost_model
from .offline import OfflineCache, simulate_offline
from .oracle import OracleLaw
from .published import simulate_published
from .simulator import OFFLINE_POLICIES, RequestRecord, SimResult, simulate, warm_replay_score
from .synthetic import SHAPES, synthetic_trace
from .trace import SimRequest, load_trace

__all__ = [
    "OFFLINE_POLICIES",
    "FutureIndex",
    "HeadroomBound",
    "ReuseProfile",
    "MODELS",
    "QWEN3_NEXT_80B_A3B",
    "SHAPES",
    "OfflineCache",
    "OracleLaw",
    "RequestRecord",
    "SimRequest",
    "SimResult",
    "cost_model",
    "headroom_bound",
    "load_trace",
    "reuse_depths",
    "reuse_profile",
    "simulate",
    "simulate_offline",
    "simulate_published",
    "synthetic_trace",
    "warm_replay_score",
]

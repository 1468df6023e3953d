"""Trace replay of the cache policies (same code path as the SGLang adapter)."""

from .bound import HeadroomBound, ReuseProfile, headroom_bound, reuse_depths, reuse_profile
from .models import MODEL_CONFIGS, QWEN3_NEXT_80B_A3B, cost_model
from .oracle import OracleLaw
from .published import simulate_published
from .simulator import RequestRecord, SimResult, simulate, warm_replay_score
from .synthetic import SHAPES, synthetic_trace
from .trace import SimRequest, load_trace

__all__ = [
    "HeadroomBound",
    "ReuseProfile",
    "MODEL_CONFIGS",
    "QWEN3_NEXT_80B_A3B",
    "SHAPES",
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
    "simulate_published",
    "synthetic_trace",
    "warm_replay_score",
]

"""What every trace-replay loop shares: the per-request record, the result, the observer type and
the request arrays.

The loops are :func:`.simulator.simulate`, :func:`.offline.simulate_offline` and
:func:`.published.simulate_published` (plus :mod:`.gap`); the field definitions (``kv_depth``,
``resume_depth``, recomputed tokens, FLOPs saved) are in :mod:`.simulator`'s docstring. Units:
tokens for lengths and depths, FLOPs, bytes. This module sits below all of them (it imports only
:mod:`sglang_sparse.tree` and :mod:`.trace`), so they import it and never each other's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from sglang_sparse.tree import Freed, InsertResult, MatchResult, as_tokens

from .trace import SimRequest

#: ``(request index, match, {position: state handle} captured, insert result, freed by eviction)``
Observer = Callable[[int, MatchResult, dict[int, int], InsertResult, Freed], None]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Per-request outcome (tokens, FLOPs, bytes after eviction)."""

    index: int
    input_len: int
    kv_depth: int
    resume_depth: int
    recomputed: int
    captured: int
    flops_saved: float
    flops_total: float
    bytes_used: int


class HitRates:
    """The two headline rates of a replay or a bound, from its ``hit_tokens`` / ``input_tokens``
    (tokens) and ``flops_saved`` / ``flops_total`` (FLOPs); 0 when the denominator is 0."""

    hit_tokens: int
    input_tokens: int
    flops_saved: float
    flops_total: float

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def flops_saved_frac(self) -> float:
        return self.flops_saved / self.flops_total if self.flops_total else 0.0


@dataclass
class SimResult(HitRates):
    """Aggregates of one replay; ``records`` holds the per-request details."""

    policy: str
    cache_bytes: int
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    kv_hit_tokens: int = 0
    recomputed_tokens: int = 0
    flops_saved: float = 0.0
    flops_total: float = 0.0
    max_bytes_used: int = 0
    alphas: list[tuple[int, float]] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    #: host tier (:mod:`.host_tier`; all 0 without one): its size (bytes), the tokens resumed by
    #: requests that loaded from it, the bytes they loaded, the loads in prefill FLOPs (device time)
    host_bytes: int = 0
    host_hit_tokens: int = 0
    load_bytes: int = 0
    load_flops: float = 0.0

    def add(self, rec: RequestRecord, keep: bool = True) -> None:
        """Count one request's outcome; ``keep``: also append ``rec`` to :attr:`records`. Call in trace
        order: the FLOP sums are float additions, so their order fixes the result's last bits."""
        self.requests += 1
        self.input_tokens += rec.input_len
        self.hit_tokens += rec.resume_depth
        self.kv_hit_tokens += rec.kv_depth
        self.recomputed_tokens += rec.recomputed
        self.flops_saved += rec.flops_saved
        self.flops_total += rec.flops_total
        self.max_bytes_used = max(self.max_bytes_used, rec.bytes_used)
        if keep:
            self.records.append(rec)

    @property
    def net_flops_saved_frac(self) -> float:
        """FLOPs saved minus the host loads' device time (in FLOPs), over the prefill FLOPs."""
        return (self.flops_saved - self.load_flops) / self.flops_total if self.flops_total else 0.0

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "records"}
        d["token_hit_rate"] = self.token_hit_rate
        d["flops_saved_frac"] = self.flops_saved_frac
        if self.host_bytes:
            d["net_flops_saved_frac"] = self.net_flops_saved_frac
        else:  # one-tier rows keep their committed shape
            for k in ("host_bytes", "host_hit_tokens", "load_bytes", "load_flops"):
                del d[k]
        return d


def progress_range(n: int, show: bool, name: str, cache_bytes: float) -> Iterable[int]:
    """``range(n)``; with ``show``, wrapped in a transient tqdm bar labelled ``name@<size in GiB>``."""
    if not show:
        return range(n)
    from tqdm import tqdm

    from sglang_sparse.progress import bar_options

    return tqdm(range(n), desc=f"{name}@{cache_bytes / 2**30:.1f}GiB", leave=False, **bar_options())


def prepare_requests(requests: Sequence[SimRequest]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(input, input + output)`` token arrays (1-D int32) of each request, in trace order: what a
    replay matches and what it inserts (the cached sequence is the input followed by the output)."""
    out = []
    for r in requests:
        inp = as_tokens(r.input_tokens)
        out.append((inp, np.concatenate([inp, as_tokens(r.output_tokens)])))
    return out

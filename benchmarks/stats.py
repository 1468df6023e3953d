"""Statistics of the benchmarks, from libraries: spreads (numpy), the sign test (scipy's binomial
test), percentile bootstrap intervals (scipy), available memory (psutil), and their text format.

Repeated serving measurements are summarised as a :class:`Spread` (median and min-max or IQR over
repetitions); a comparison between two configurations is the spread of the *per-repetition*
ratios (:func:`ratio_spread`), and it is claimed (``higher`` / ``lower``) only when that spread
excludes 1 (:func:`claim`). With ``n`` repetitions all on one side, :func:`sign_test_p` is the
two-sided sign-test p-value that goes with such a claim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
from scipy import stats as _scipy_stats


@dataclass(frozen=True)
class Spread:
    """Median and spread of repeated measurements (units of the measurement)."""

    median: float
    lo: float
    hi: float
    n: int
    kind: str = "minmax"

    def excludes(self, x: float) -> bool:
        """True when ``x`` lies outside ``[lo, hi]``."""
        return self.lo > x or self.hi < x

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "n": self.n, "kind": self.kind}


def finite(values: Sequence[float | int | None]) -> list[float]:
    """``values`` as floats, without None, NaN and infinities."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def spread(values: Sequence[float | int | None], kind: str = "minmax") -> Spread | None:
    """Median and spread of ``values`` (None/NaN/inf dropped; None when nothing is left).

    ``kind``: ``minmax`` (lo = min, hi = max) or ``iqr`` (25th/75th percentiles, linearly
    interpolated; for n <= 2 the same as min-max).
    """
    if kind not in ("minmax", "iqr"):
        raise ValueError(f"unknown spread kind {kind!r}; expected minmax or iqr")
    vals = np.asarray(finite(values))
    if not vals.size:
        return None
    if kind == "minmax" or vals.size < 3:
        lo, hi = vals.min(), vals.max()
    else:
        lo, hi = np.percentile(vals, [25, 75])
    return Spread(float(np.median(vals)), float(lo), float(hi), int(vals.size), kind)


def latency_us(xs: Sequence[float]) -> dict[str, float]:
    """Median / p90 / p99 / mean of ``xs`` (seconds) in microseconds, and ``n`` (all 0 when empty)."""
    if not len(xs):
        return {"median_us": 0.0, "p90_us": 0.0, "p99_us": 0.0, "mean_us": 0.0, "n": 0}
    a = np.asarray(xs) * 1e6
    return {
        "median_us": float(np.median(a)),
        "p90_us": float(np.percentile(a, 90)),
        "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
        "n": len(xs),
    }


def paired_ratios(num: Sequence[float | None], den: Sequence[float | None]) -> list[float]:
    """Per-repetition ratios ``num[i] / den[i]`` where both are finite and ``den[i] > 0``."""
    if len(num) != len(den):
        raise ValueError(f"paired values need equal lengths, got {len(num)} and {len(den)}")
    out = []
    for a, b in zip(num, den, strict=True):
        if a is None or b is None:
            continue
        fa, fb = float(a), float(b)
        if math.isfinite(fa) and math.isfinite(fb) and fb > 0:
            out.append(fa / fb)
    return out


def ratio_spread(
    num: Sequence[float | None], den: Sequence[float | None], kind: str = "minmax"
) -> Spread | None:
    """:func:`spread` of the per-repetition ratios (see :func:`paired_ratios`)."""
    return spread(paired_ratios(num, den), kind)


def pooled_gap(
    ta: Sequence[float | None],
    tb: Sequence[float | None],
    pa: Sequence[float | None],
    pb: Sequence[float | None],
) -> float | None:
    """``(sum ta / sum tb) / (sum pa / sum pb) - 1`` over the repetitions where all four exist."""
    rows = [r for r in zip(ta, tb, pa, pb, strict=False) if all(x is not None for x in r)]
    sums = [sum(float(r[i]) for r in rows) for i in range(4)]  # type: ignore[arg-type]
    if not rows or not all(sums):
        return None
    return (sums[0] / sums[1]) / (sums[2] / sums[3]) - 1


def claim(s: Spread | None) -> str:
    """``"higher"`` / ``"lower"`` when the ratio spread lies entirely above / below 1, else
    ``"n.s."`` (also for a single repetition or no data: one value is no spread)."""
    if s is None or s.n < 2 or not s.excludes(1.0):
        return "n.s."
    return "higher" if s.lo > 1.0 else "lower"


def sign_test_p(n: int) -> float:
    """Two-sided sign-test p-value of ``n`` paired ratios that all fall on one side of 1, when
    neither side is favoured (scipy's exact binomial test; ``2 ** (1 - n)``, 1.0 for n <= 1)."""
    if n <= 0:
        return 1.0
    return float(_scipy_stats.binomtest(n, n, 0.5).pvalue)


def bootstrap_ci(
    values: Sequence[Any],
    stat: Callable[[Sequence[Any]], float],
    n: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval (``level``, two-sided) of ``stat`` over ``n`` seeded
    resamples of ``values`` (any objects: requests, pairs of rows; resampled by index)."""
    items = list(values)
    if not items:
        raise ValueError("bootstrap_ci needs at least one value")
    res = _scipy_stats.bootstrap(
        (np.arange(len(items)),),
        lambda idx: stat([items[int(i)] for i in idx]),
        n_resamples=n,
        vectorized=False,
        method="percentile",
        confidence_level=level,
        random_state=np.random.default_rng(seed),
    )
    ci = res.confidence_interval
    return float(ci.low), float(ci.high)


def busy_cpu_seconds() -> float:
    """CPU seconds all processes of the machine spent busy so far (user + system + nice + irq +
    softirq + steal, summed over the CPUs: psutil's ``cpu_times``)."""
    t = psutil.cpu_times()
    return float(sum(getattr(t, f, 0.0) for f in ("user", "system", "nice", "irq", "softirq", "steal")))


def own_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process alone so far: not its children, so a server it
    launched is counted once, by whoever measures that server's tree."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def mem_available_gb() -> float:
    """Memory available to new processes (GB, psutil's ``available``)."""
    return psutil.virtual_memory().available / 1e9


def fmt_num(x: float) -> str:
    """A compact number: no decimals from 100, one from 10, else 3 significant digits."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def fmt_spread(s: Spread | None) -> str:
    """``median [lo-hi]`` (see :func:`fmt_num`), ``-`` for no data."""
    if s is None:
        return "-"
    return f"{fmt_num(s.median)} [{fmt_num(s.lo)}-{fmt_num(s.hi)}]"


def fmt_ratio(s: Spread | None) -> str:
    """``0.62x [0.55-0.70]``, suffixed ``n.s.`` when the spread does not exclude 1 (three decimals
    when two would print a claimed spread as touching 1.00)."""
    if s is None:
        return "-"
    d = 2
    if claim(s) != "n.s." and "1.00" in (f"{s.lo:.2f}", f"{s.hi:.2f}"):
        d = 3
    text = f"{s.median:.{d}f}x [{s.lo:.{d}f}-{s.hi:.{d}f}]"
    return text if claim(s) != "n.s." else text + " n.s."

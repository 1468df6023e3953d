"""Summary statistics of a trace and an overlap-depth histogram (lengths in tokens)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .overlap import overlap_depths
from .schema import Request

PERCENTILES: tuple[int, ...] = (50, 90, 99)


def _pcts(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {**{f"p{p}": 0.0 for p in PERCENTILES}, "mean": 0.0, "max": 0.0}
    vals = np.percentile(x, PERCENTILES)
    out = {f"p{p}": float(v) for p, v in zip(PERCENTILES, vals, strict=True)}
    out["mean"] = float(x.mean())
    out["max"] = float(x.max())
    return out


def summarize(requests: Sequence[Request], depths: np.ndarray | None = None) -> dict[str, Any]:
    """Stats: counts, input/output length percentiles, totals, overlap depth (exact, unbounded cache).

    ``reuse_fraction`` = sum(overlap depth) / sum(input tokens): the share of prompt tokens an
    infinite prefix cache could skip. ``duration_s`` is the logical span of ``ts``."""
    inp = np.asarray([r.num_input_tokens for r in requests], dtype=np.int64)
    out = np.asarray([r.num_output_tokens for r in requests], dtype=np.int64)
    d = overlap_depths(requests) if depths is None else np.asarray(depths, dtype=np.int64)
    ts = [r.ts for r in requests]
    total_in = int(inp.sum())
    return {
        "requests": len(requests),
        "sessions": len({r.session_id for r in requests}),
        "duration_s": float(max(ts) - min(ts)) if ts else 0.0,
        "input_tokens": _pcts(inp),
        "output_tokens": _pcts(out),
        "total_input_tokens": total_in,
        "total_output_tokens": int(out.sum()),
        "overlap_depth": _pcts(d),
        "requests_with_overlap": int((d > 0).sum()),
        "reuse_fraction": float(d.sum() / total_in) if total_in else 0.0,
    }


def format_summary(label: str, s: dict[str, Any]) -> str:
    """Multi-line human-readable rendering of :func:`summarize`'s result."""

    def row(name: str, p: dict[str, float]) -> str:
        cols = "  ".join(f"{k}={v:,.0f}" for k, v in p.items())
        return f"  {name:<14}{cols}"

    return "\n".join(
        [
            f"{label}",
            f"  requests={s['requests']:,}  sessions={s['sessions']:,}  duration={s['duration_s']:,.1f}s",
            f"  total tokens: input={s['total_input_tokens']:,}  output={s['total_output_tokens']:,}",
            row("input len", s["input_tokens"]),
            row("output len", s["output_tokens"]),
            row("overlap depth", s["overlap_depth"]),
            f"  requests with overlap={s['requests_with_overlap']:,}"
            f"  reuse fraction={s['reuse_fraction']:.3f}",
        ]
    )


def plot_overlap_histograms(
    series: Sequence[tuple[str, np.ndarray]], out_path: str | os.PathLike[str], bins: int = 50
) -> None:
    """Write a PNG with one histogram of overlap depth (tokens) per ``(label, depths)`` (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(series))
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.6 * n), squeeze=False)
    for ax, (label, d) in zip(axes[:, 0], series, strict=False):
        ax.hist(np.asarray(d), bins=bins, color="tab:blue")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("overlap depth (tokens)")
        ax.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)

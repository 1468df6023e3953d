"""Progress-bar settings that behave in a terminal and in a log (used by the simulator, the trace
builder and the benchmarks; imports nothing of the project, tqdm only when a bar is made)."""

from __future__ import annotations

import sys
from typing import Any

#: seconds between bar updates when the stream is not a terminal (a log file, a pipe): in a terminal
#: tqdm redraws up to 10 times a second, which a log would keep as thousands of lines
LOG_BAR_INTERVAL_S = 30.0


def bar_options(stream: Any = None) -> dict[str, Any]:
    """tqdm keyword arguments for ``stream`` (default stderr): a live bar in a terminal; elsewhere one
    plain ASCII line at most every :data:`LOG_BAR_INTERVAL_S` seconds, plus the final count."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return {"file": stream, "dynamic_ncols": True}
    return {
        "file": stream,
        "mininterval": LOG_BAR_INTERVAL_S,
        "maxinterval": LOG_BAR_INTERVAL_S,
        "ascii": True,
        "ncols": 100,
    }

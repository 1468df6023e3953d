"""Small helpers shared by the benchmark scripts: results folder, JSON output, progress bars, the
table printer (statistics: :mod:`benchmarks.stats`)."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from sglang_sparse.progress import bar_options

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
#: the committed results (written by a script run on its own, or by the main job's --commit-results)
RESULTS = REPO / "benchmarks" / "results"
#: the main job's default results folder (git-ignored), so a run leaves the checkout clean
LOCAL_RESULTS = RESULTS / "local"

_root: Path | None = None


def use_results_root(root: Path | None) -> None:
    """Make :func:`results_dir` answer ``root`` (full runs) and ``root/quick`` (smoke runs) in this
    process; ``None``: back to :data:`RESULTS`."""
    global _root
    _root = root


def results_root() -> Path:
    """The folder full runs write to (:data:`RESULTS` unless :func:`use_results_root` chose one)."""
    return RESULTS if _root is None else _root


def results_dir(quick: bool) -> Path:
    """The results root for full runs (default ``benchmarks/results``) and its ``quick`` subfolder
    for smoke runs (``benchmarks/results/quick``, git-ignored, so they never overwrite the committed
    full results), created if missing."""
    d = results_root() / "quick" if quick else results_root()
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(name: str | Path, payload: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    """Write ``payload`` (after machine info) to ``<out_dir>/<name>.json`` (default
    ``benchmarks/results``), or to ``name`` itself when it is a :class:`~pathlib.Path`."""
    path = name if isinstance(name, Path) else out_dir / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def progress(it: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """tqdm when installed (to stderr, :func:`bar_options`), else the bare iterable."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        yield from it
        return
    yield from tqdm(it, total=total, desc=desc, leave=False, **bar_options())


def bar(total: int, desc: str) -> Any:
    """A tqdm progress bar of ``total`` steps on stderr (:func:`bar_options`)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, **bar_options())


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or ``None`` (after saying so) when
    matplotlib is missing: a benchmark writes its JSON either way, the plot is optional."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no plots")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A plain fixed-width text table (tabulate's ``simple`` format, every column right-aligned;
    floats to 3 significant digits, strings printed as given: a pre-formatted cell is never
    re-parsed as a number)."""
    from tabulate import tabulate

    cells = [[f"{c:.3g}" if isinstance(c, float) else c for c in r] for r in rows]
    return tabulate(
        cells, header, tablefmt="simple", disable_numparse=True, colalign=("right",) * len(header)
    )

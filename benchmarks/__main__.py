"""The project's main job: build the bundled traces, then run the benchmarks on them.

``python -m benchmarks`` runs every stage with its default (small) size; ``--only`` picks
stages, ``--quick`` shrinks each one. Each stage prints its table and writes JSON/PNG under
``benchmarks/results/local/`` (git-ignored: a run leaves the checkout clean; ``--quick``:
``benchmarks/results/local/quick/``); ``--commit-results`` writes to ``benchmarks/results/``,
the committed figures, instead. It ends with one screen naming every file it wrote. Stages:

* ``traces``    - build the four traces from ``../shared/data`` into ``traces/build/``
* ``placement`` - checkpoint placement Pareto fronts + DP solve time (benchmarks/placement.py)
* ``sim``       - cache policies on the traces at several cache sizes (benchmarks/sim_compare.py)
* ``serving``   - the real SGLang server on the CPU with ``--radix-cache-backend sparse`` vs the
  native cache: TTFT and token equality on trace slices (benchmarks/serving.py; always its small
  ``--quick`` size here, run ``python -m benchmarks.serving`` for the full one)
* ``serving_load`` - the same servers under load from SGLang's own benchmark client (Poisson
  arrivals), all configurations up at once and interleaved over 3 repetitions: throughput,
  TTFT/ITL percentiles and ratios vs native with their spread (benchmarks/serving_load.py; always
  its ``--quick`` size here, about 6 min; ``python -m benchmarks.serving_load`` is the ~60 min run)
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
from pathlib import Path

from ._common import LOCAL_RESULTS, REPO, RESULTS, use_results_root

STAGES = ("traces", "placement", "sim", "serving", "serving_load")


def run_stage(name: str, quick: bool) -> None:
    if name == "traces":
        cmd = [
            sys.executable,
            "-m",
            "sglang_sparse.traces",
            "build",
            "all",
            "--out",
            str(REPO / "traces" / "build"),
        ]
        rc = subprocess.run(cmd, check=False, cwd=REPO).returncode
        if rc:  # the builder printed why (e.g. where the data should be)
            raise SystemExit(f"[benchmarks] stage 'traces' failed (exit {rc}); see the error above")
        return
    module = {
        "placement": "benchmarks.placement",
        "sim": "benchmarks.sim_compare",
        "serving": "benchmarks.serving",
        "serving_load": "benchmarks.serving_load",
    }[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            print(f"[benchmarks] stage {name!r} is not available yet ({module} missing); skipped")
            return
        raise
    rc = mod.main(["--quick"] if quick or name in ("serving", "serving_load") else [])
    if rc:
        raise SystemExit(rc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=STAGES, default=list(STAGES), help="stages to run, in order")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument(
        "--commit-results",
        action="store_true",
        help=f"write to {_shown(RESULTS)}/ (the committed figures) instead of {_shown(LOCAL_RESULTS)}/ "
        "(git-ignored)",
    )
    args = ap.parse_args(argv)
    root = RESULTS if args.commit_results else LOCAL_RESULTS
    use_results_root(root)
    started = time.time()
    walls: dict[str, float] = {}
    try:
        for name in args.only:
            t0 = time.perf_counter()
            print(f"\n[benchmarks] === {name} ===", flush=True)
            run_stage(name, args.quick)
            walls[name] = time.perf_counter() - t0
            print(f"[benchmarks] {name} done in {walls[name]:.0f} s", flush=True)
    finally:
        use_results_root(None)
    print(summary(walls, written_since(root, started)), flush=True)
    return 0


def written_since(root: Path, t0: float) -> list[Path]:
    """The JSON and PNG files under ``root`` modified at or after ``t0`` (epoch seconds), sorted."""
    if not root.exists():
        return []
    return sorted(p for p in root.rglob("*") if p.suffix in (".json", ".png") and p.stat().st_mtime >= t0)


def summary(walls: dict[str, float], files: list[Path]) -> str:
    """The closing screen: each stage's wall time, then the plots and the JSON the run wrote."""
    lines = ["", "[benchmarks] summary"]
    lines += [f"  {name:<13} {wall:7.0f} s" for name, wall in walls.items()]
    for kind, suffix in (("plots", ".png"), ("results", ".json")):
        picked = [p for p in files if p.suffix == suffix]
        lines.append(f"  {kind} ({len(picked)}):")
        lines += [f"    {_shown(p)}" for p in picked] or ["    (none)"]
    return "\n".join(lines)


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())

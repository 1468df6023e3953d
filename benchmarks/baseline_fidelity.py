"""Fidelity of the published baselines: our ``*_published`` policies vs the Marconi paper's own simulator.

The reference (github.com/ruipeterpan/marconi, CC BY-NC 4.0, pure Python) is never committed here:
``--marconi-repo`` points at a checkout or a bare git directory of it, and its four simulator files
(``radix_cache_hybrid.py``, ``radix_cache_vllm.py``, ``config_tuner.py``, ``utils.py``) are copied
into a temporary directory and imported from there at run time. Its unused top-level imports
(``scipy.stats.rankdata``, ``transformers``) get empty stand-ins when not installed.

Both sides replay the same trace files with the reference's model config (NVIDIA Attention-Mamba2
hybrid 7B: 24 SSM / 4 attention / 28 MLP layers, d=4096, n=128, fp16: 26.8 MB per state,
64 KiB of KV per token; :class:`~sglang_sparse.sim.published_caches.MarconiModel`) and the same cache
sizes in bytes (fractions of the trace's infinite-cache KV footprint, ``unique tokens x 64 KiB``).
The reference is driven exactly as its ``policy_exploration.py: run_trace_with_config``
(``match_prefix(input)``, ``insert(input + output)``, ``eff_weight=0``, ``bootstrap_multiplier=5``,
vLLM+ ``block_size=32``). One change makes it deterministic: its alpha tuner collects the replays
of the alpha grid in submission order instead of completion order (``as_completed`` patched), so
ties go to the earlier alpha, as ours.

Reported per trace, size and policy: token hit rate (reused input tokens / input tokens), request hit
rate, FLOPs saved (the reference's formulas), the alpha Marconi chose, and whether the per-request
hits are identical. Writes ``benchmarks/results/baseline_fidelity.json``.

    python benchmarks/baseline_fidelity.py --marconi-repo /path/to/marconi [--trace FILE ...]
        [--fracs 0.05 0.2 0.5] [--policies ...] [--max-requests N] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import REPO, RESULTS, write_json  # noqa: E402
from sglang_sparse.sim import OracleLaw, load_trace, simulate  # noqa: E402
from sglang_sparse.sim.published_caches import REFERENCE_COMMIT, MarconiModel  # noqa: E402

REFERENCE_FILES = ("radix_cache_hybrid.py", "radix_cache_vllm.py", "config_tuner.py", "utils.py")
DEFAULT_TRACES = ("rag", "system_prompts", "doc_qa", "agent")
DEFAULT_FRACS = (0.05, 0.2, 0.5)
#: our policy -> (reference module, evict_policy_version)
REFERENCE_OF: dict[str, tuple[str, int]] = {
    "vllm_plus_published": ("radix_cache_vllm", 1),
    "sglang_plus_published": ("radix_cache_hybrid", 1),
    "marconi_published": ("radix_cache_hybrid", 2),
}
TARGET_PP = 1.0  # |token hit rate difference| target, percentage points


def vendor_reference(repo: Path, dest: Path, rev: str = "HEAD") -> str:
    """Copy the reference simulator files from ``repo`` (a checkout, or a bare git dir read at
    ``rev``) into ``dest``; returns a description of the source (commit when known)."""
    dest.mkdir(parents=True, exist_ok=True)
    if all((repo / f).is_file() for f in REFERENCE_FILES):
        for f in REFERENCE_FILES:
            (dest / f).write_bytes((repo / f).read_bytes())
        try:
            commit = subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown (not a git checkout)"
        return commit
    try:
        for f in REFERENCE_FILES:
            blob = subprocess.run(
                ["git", "--git-dir", str(repo), "show", f"{rev}:{f}"], capture_output=True, check=True
            ).stdout
            (dest / f).write_bytes(blob)
        return subprocess.run(
            ["git", "--git-dir", str(repo), "rev-parse", rev], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"error: {repo} is neither a marconi checkout nor its git directory ({e})") from None


def load_reference(dest: Path) -> dict[str, types.ModuleType]:
    """Import the vendored files from ``dest``. Their unused top-level imports (``scipy.stats``,
    ``transformers``) see empty stand-ins during the import only (no heavy import, no scipy needed)."""
    stubs = {
        "scipy": types.ModuleType("scipy"),
        "scipy.stats": types.ModuleType("scipy.stats"),
        "transformers": types.ModuleType("transformers"),
    }
    stubs["scipy.stats"].rankdata = None  # type: ignore[attr-defined]
    stubs["scipy"].stats = stubs["scipy.stats"]  # type: ignore[attr-defined]
    stubs["transformers"].AutoTokenizer = None  # type: ignore[attr-defined]
    stubs["transformers"].AutoModelForCausalLM = None  # type: ignore[attr-defined]
    names = ("utils", "config_tuner", "radix_cache_hybrid", "radix_cache_vllm")
    saved = {k: sys.modules.get(k) for k in (*stubs, *names)}
    for k in names:
        sys.modules.pop(k, None)
    sys.modules.update(stubs)
    sys.path.insert(0, str(dest))
    try:
        mods = {m: importlib.import_module(m) for m in names}
    finally:
        sys.path.remove(str(dest))
        for k in stubs:
            if saved[k] is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = saved[k]  # type: ignore[assignment]
    # deterministic tuner: results in grid (submission) order, not process completion order
    mods["config_tuner"].as_completed = lambda futures: list(futures)  # type: ignore[attr-defined]
    # trees as deep as a 33k-token trace / 32-token blocks are walked recursively
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20_000))
    return mods


def run_reference(
    mods: dict[str, types.ModuleType],
    policy: str,
    rows: Sequence[dict[str, Any]],
    capacity: int,
    model: MarconiModel,
    bootstrap_multiplier: int = 5,
) -> dict[str, Any]:
    """``policy_exploration.run_trace_with_config`` on ``rows`` (the reference's prints silenced)."""
    module, version = REFERENCE_OF[policy]
    cls = mods[module].RadixCache
    t0 = time.perf_counter()
    tree = cls(
        capacity_bytes=capacity,
        evict_policy_version=version,
        eff_weight=0.0,
        use_logical_ts=True,
        num_ssm_layers=model.num_ssm_layers,
        num_attn_layers=model.num_attn_layers,
        num_mlp_layers=model.num_mlp_layers,
        d=model.d,
        n=model.n,
        block_size=32 if module == "radix_cache_vllm" else None,
        bootstrap_multiplier=bootstrap_multiplier,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        for r in rows:
            inp = r["input_tokens"]
            tree.match_prefix(inp)
            tree.insert(
                token_ids=inp + r["output_tokens"],
                state_at_leaf=r["session_id"],
                state_at_branchoff=r["session_id"],
            )
        req_hit, tok_hit, f_mamba, f_attn, f_mlp = tree.get_cache_stats(verbose=False)
    return {
        "token_hit_rate": tok_hit,
        "request_hit_rate": req_hit,
        "flops_saved": float(f_mamba + f_attn + f_mlp),
        "alpha": float(getattr(tree, "eff_weight", 0.0)) if version == 2 else None,
        "hits": [int(x[2]) for x in tree.request_history],
        "bytes_at_end": float(tree.get_tree_size()),
        "seconds": time.perf_counter() - t0,
    }


def run_ours(policy: str, requests: Sequence[Any], capacity: int, model: MarconiModel) -> dict[str, Any]:
    """Our published variant through :func:`sglang_sparse.sim.simulate` with the reference's model."""
    t0 = time.perf_counter()
    r = simulate(requests, policy, capacity, model, keep_records=True)
    hits = [x.resume_depth for x in r.records]
    return {
        "token_hit_rate": r.token_hit_rate,
        "request_hit_rate": sum(h > 0 for h in hits) / max(len(hits), 1),
        "flops_saved": r.flops_saved,
        "alpha": r.alphas[-1][1] if r.alphas else (0.0 if policy == "marconi_published" else None),
        "tuned_at": r.alphas[0][0] if r.alphas else None,
        "hits": hits,
        "max_bytes_used": r.max_bytes_used,
        "seconds": time.perf_counter() - t0,
    }


def compare_one(
    mods: dict[str, types.ModuleType],
    policy: str,
    trace: str,
    rows: Sequence[dict[str, Any]],
    requests: Sequence[Any],
    frac: float,
    capacity: int,
    model: MarconiModel,
) -> dict[str, Any]:
    """One (trace, size, policy) cell: the reference vs ours, per-request hits compared."""
    ref = run_reference(mods, policy, rows, capacity, model)
    ours = run_ours(policy, requests, capacity, model)
    diff = [i for i, (a, b) in enumerate(zip(ref.pop("hits"), ours.pop("hits"), strict=True)) if a != b]
    row: dict[str, Any] = {
        "trace": trace,
        "requests": len(rows),
        "frac": frac,
        "cache_bytes": capacity,
        "policy": policy,
        "reference": ref,
        "ours": ours,
        "token_hit_rate_diff_pp": 100 * (ours["token_hit_rate"] - ref["token_hit_rate"]),
        "flops_saved_rel_diff": ours["flops_saved"] / ref["flops_saved"] - 1 if ref["flops_saved"] else 0.0,
        "requests_with_different_hits": len(diff),
        "first_different_request": diff[0] if diff else None,
    }
    row["within_target"] = abs(row["token_hit_rate_diff_pp"]) <= TARGET_PP
    return row


def _trace_rows(path: Path, limit: int | None) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--marconi-repo", required=True, type=Path, help="marconi checkout or bare git dir")
    ap.add_argument("--rev", default="HEAD", help="revision to read from a bare git dir")
    ap.add_argument("--trace", action="append", type=Path, default=None, help="trace file (repeatable)")
    ap.add_argument("--fracs", nargs="+", type=float, default=list(DEFAULT_FRACS))
    ap.add_argument("--policies", nargs="+", default=list(REFERENCE_OF), choices=list(REFERENCE_OF))
    ap.add_argument("--max-requests", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = ap.parse_args(argv)
    traces = args.trace or [REPO / "traces" / "build" / f"{t}.jsonl" for t in DEFAULT_TRACES]
    for p in traces:
        if not p.exists():
            raise SystemExit(f"error: {p} not found (python -m sglang_sparse.traces build all)")
    model = MarconiModel()
    with tempfile.TemporaryDirectory(prefix="marconi_ref_") as tmp:
        commit = vendor_reference(args.marconi_repo, Path(tmp), args.rev)
        mods = load_reference(Path(tmp))
        out_rows: list[dict[str, Any]] = []
        for path in traces:
            rows = _trace_rows(path, args.max_requests)
            reqs = load_trace(path)[: len(rows)]
            footprint = OracleLaw(reqs).inf.kv_tokens * model.kv_bytes_per_token
            for frac in args.fracs:
                cap = int(footprint * frac)
                for pol in args.policies:
                    row = compare_one(mods, pol, path.stem, rows, reqs, frac, cap, model)
                    row["footprint_bytes"] = footprint
                    out_rows.append(row)
                    ref, ours = row["reference"], row["ours"]
                    print(
                        f"{path.stem:15} {frac:5} {pol:22} ref {ref['token_hit_rate']:.4f} "
                        f"ours {ours['token_hit_rate']:.4f} ({row['token_hit_rate_diff_pp']:+.2f} pp) "
                        f"alpha {ref['alpha']}/{ours['alpha']} "
                        f"differing requests {row['requests_with_different_hits']} "
                        f"[{ref['seconds']:.0f}s / {ours['seconds']:.1f}s]",
                        flush=True,
                    )
    payload = {
        "reference": {
            "repo": "github.com/ruipeterpan/marconi",
            "commit": commit,
            "expected_commit": REFERENCE_COMMIT,
            "files": list(REFERENCE_FILES),
            "patch": "config_tuner.as_completed -> submission order (deterministic alpha ties)",
        },
        "model": {
            "name": "NVIDIA Attention-Mamba2 hybrid 7B (Marconi defaults)",
            "num_ssm_layers": model.num_ssm_layers,
            "num_attn_layers": model.num_attn_layers,
            "num_mlp_layers": model.num_mlp_layers,
            "d": model.d,
            "n": model.n,
            "state_bytes": model.state_bytes,
            "kv_bytes_per_token": model.kv_bytes_per_token,
        },
        "target_pp": TARGET_PP,
        "max_abs_diff_pp": max((abs(r["token_hit_rate_diff_pp"]) for r in out_rows), default=0.0),
        "all_within_target": all(r["within_target"] for r in out_rows),
        "rows": out_rows,
    }
    path = write_json("baseline_fidelity", payload, args.out)
    print(f"max |token hit rate diff| {payload['max_abs_diff_pp']:.3f} pp -> {path}")
    return 0 if payload["all_within_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

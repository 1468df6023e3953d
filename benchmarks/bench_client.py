"""Run SGLang's own serving benchmark client (``sglang.benchmark.serving``) against a local server.

A thin subprocess wrapper: Poisson arrivals (``--request-rate``), ``--max-concurrency``, TTFT/ITL
percentiles and throughputs all come from the client; this module only builds its command line and
reads the JSONL line it appends to ``--output-file``. The ``datasets`` (HF) package is only needed by
the client's MMMU loader; when it is not installed a stub module is put in its place so the client
imports (``custom`` and ``agentic-trace`` datasets do not use it).

Datasets come from ``python -m sglang_sparse.traces export`` (``sglang_sparse.traces.export``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_BOOT = (
    "import sys, types\n"
    "try:\n"
    "    import datasets  # noqa: F401\n"
    "except ImportError:\n"
    "    m = types.ModuleType('datasets'); m.load_dataset = None; sys.modules['datasets'] = m\n"
    "from sglang.benchmark.serving import cli_main\n"
    "sys.argv = ['sglang.benchmark.serving'] + sys.argv[1:]\n"
    "cli_main()\n"
)

METRIC_KEYS: tuple[str, ...] = (
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p95_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p95_itl_ms",
    "p99_itl_ms",
    "completed",
    "duration",
)
"""Client result fields kept in our tables (missing ones are reported as None)."""


def client_command(
    *,
    base_url: str,
    dataset_name: str,
    dataset_path: str | Path,
    tokenizer: str | Path,
    num_prompts: int,
    request_rate: float,
    max_concurrency: int | None,
    output_file: str | Path,
    output_len: int | None = None,
    seed: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``python -c <boot> ARGS`` command running the client once (greedy, loopback only)."""
    if not base_url.startswith(("http://127.0.0.1", "http://localhost")):
        raise ValueError(f"refusing a non-local server: {base_url}")
    backend = "sglang-oai-chat" if dataset_name == "agentic-trace" else "sglang"
    cmd = [
        sys.executable, "-c", _BOOT,
        "--backend", backend,
        "--base-url", base_url,
        "--dataset-name", dataset_name,
        "--dataset-path", str(dataset_path),
        "--tokenizer", str(tokenizer),
        "--model", str(tokenizer),
        "--num-prompts", str(num_prompts),
        "--request-rate", str(request_rate),
        "--output-file", str(output_file),
        "--seed", str(seed),
        "--temperature", "0",
        "--disable-tqdm",
    ]  # fmt: skip
    if max_concurrency:
        cmd += ["--max-concurrency", str(max_concurrency)]
    if output_len:
        cmd += ["--sharegpt-output-len", str(output_len)]
    return cmd + list(extra)


def run_client(output_file: str | Path, timeout: float = 1800.0, **kwargs: Any) -> dict[str, Any]:
    """Run the client (see :func:`client_command`) and return its result row (last JSONL line)."""
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    cmd = client_command(output_file=out, **kwargs)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
        raise RuntimeError(f"bench client failed (rc={proc.returncode}):\n{tail}")
    row = json.loads(out.read_text().strip().splitlines()[-1])
    return row


def summarize_row(row: dict[str, Any]) -> dict[str, Any]:
    """The :data:`METRIC_KEYS` subset of a client row."""
    return {k: row.get(k) for k in METRIC_KEYS}

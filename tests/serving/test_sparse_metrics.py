"""``--enable-metrics``: the ``sparse`` cache statistics appear on ``/metrics`` of a CPU server."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.serving

if any(importlib.util.find_spec(m) is None for m in ("torch", "sglang", "transformers", "sgl_kernel")):
    pytest.skip("serving stack not installed; run tools/setup_env.sh", allow_module_level=True)

import requests  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.process_group import live_group  # noqa: E402
from sglang_sparse.testing.server import SGLangServer, _mapped_shm  # noqa: E402

VOCAB = 4096
PREFIX = [(i * 53 + 29) % (VOCAB - 4) + 4 for i in range(160)]


def _value(text: str, name: str) -> float:
    """Value of the first sample of ``sglang:sparse_<name>`` in a Prometheus text page."""
    m = re.search(rf"^sglang:sparse_{name}\{{[^}}]*policy=\"sparse\"[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"sglang:sparse_{name} missing from /metrics"
    return float(m.group(1))


def test_sparse_stats_on_metrics(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", arch="qwen3_next", seed=0)
    args = ["--radix-cache-backend", "sparse", "--enable-metrics", "--context-length", "512"]
    with SGLangServer(model, extra_args=args, env={"SGLANG_SPARSE_POLICY": "sparse"}) as srv:
        for tail in ([17, 18, 19], [2000, 2001, 2002, 2003], [300, 301]):
            srv.generate(PREFIX + tail, max_new_tokens=4)
            time.sleep(0.6)  # metrics are rate limited to one update per 0.5 s
        srv.generate(PREFIX + [7, 8], max_new_tokens=4)  # the update runs as the scheduler plans a prefill
        text = requests.get(f"{srv.url}/metrics", timeout=30).text
        pgid = srv.proc.pid
        group = live_group(pgid)
        shm = _mapped_shm(list(group))
    # the stop (SIGKILL) leaves no process of the server and none of the /dev/shm files it mapped
    assert len(group) >= 3 and shm, (group, shm)  # launcher, scheduler, detokenizer; SGLang's segment
    assert live_group(pgid) == {} and not any(Path(f).exists() for f in shm), (live_group(pgid), shm)
    assert _value(text, "requests") >= 3
    assert _value(text, "hit_requests") >= 1
    assert _value(text, "kv_hit_tokens") >= len(PREFIX) // 2
    for name in ("resume_tokens", "states_held", "bytes_held", "states_evicted", "ckpt_admitted", "alpha"):
        _value(text, name)

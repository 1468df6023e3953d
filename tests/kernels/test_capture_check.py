"""``benchmarks/gpu/capture_check.py --quick``: SGLang's own Triton GDN kernels under
``TRITON_INTERPRET=1`` (fp16, tiny shapes) with the capture as the server runs it (track lists,
the adapter's extend hook, SGLang's track copies, tails through SGLang's Triton recurrent kernel).

Run in a subprocess (the interpreter must be on before triton is imported, and the script loads
SGLang's FLA fork from the installed wheel's sources through its stub package tree, the path a GPU
machine without SGLang takes). Captured SSM states within 1e-3 relative of the fp64 recurrence
(fp16 inputs; SGLang's ``h`` holds the activation dtype), conv windows bit-exact, every kind of
capture present (h row, tail from an h row and from the initial state, final state).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")
sglang = pytest.importorskip("sglang", reason="SGLang is not installed")

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[2]


def test_capture_check_quick_on_sglangs_kernels(tmp_path: Path) -> None:
    out = tmp_path / "capture_check.json"
    site = Path(sglang.__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/capture_check.py"), "--quick", "--sglang-src", str(site),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    d = json.loads(out.read_text())
    assert d["quick"] and d["dtype"] == "float16"
    kinds = set()
    for b in d["batches"]:
        assert b["conv_exact"], b
        assert b["tails"] > 0 and b["overhead_pct"] is None  # not timed under the interpreter
        for c in b["captures"]:
            kinds.add(c["kind"])
            assert c["rel_err_vs_fp64"] < 1e-3, c
            if c["rel_err_vs_cut"] is not None:
                assert c["rel_err_vs_cut"] < 1e-3, c
    assert kinds == {"h", "tail", "final"}
    assert any(c["rel_err_vs_cut"] is not None for b in d["batches"] for c in b["captures"])

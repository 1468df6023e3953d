"""Count what reaches the CPU GDN prefill op in every process of a server (sequences, tokens,
64-token chunks, padding). Opt-in, for measurement only::

    GDN_COUNT_OUT=/tmp/c/gdn PYTHONPATH=tools/gdn_count python -m benchmarks.serving_load ...

Each process writes ``/tmp/c/gdn.<pid>.json`` every 10 s and at exit (docs/sparse_backend.md, the
storm profile). Without ``GDN_COUNT_OUT`` it does nothing."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

OUT = os.environ.get("GDN_COUNT_OUT")


def _install(out: str) -> None:
    from sglang_sparse_kernels.sgl_kernel_cpu import delta_rule

    orig = delta_rule.chunk_gated_delta_rule
    stats = {"calls": 0, "seqs": 0, "tokens": 0, "chunks": 0, "pad": 0}

    def counted(q, k, v, g, beta, initial_state, output_final_state=True, cu_seqlens=None, head_first=False,
                use_qk_l2norm_in_kernel=False, initial_state_indices=None, scale=None,
                chunk_size=delta_rule.DEFAULT_CHUNK) -> Any:  # fmt: skip
        if cu_seqlens is not None:
            b = [int(x) for x in cu_seqlens.tolist()]
            lens = [b[i + 1] - b[i] for i in range(len(b) - 1)]
        else:
            lens = [q.shape[1]] * q.shape[0]
        idx = None if initial_state_indices is None else [int(x) for x in initial_state_indices.tolist()]
        for i, n_tok in enumerate(lens):
            if idx is not None and idx[i] < 0:
                continue  # a padding sequence: the op skips it
            n = -(-n_tok // chunk_size)
            stats["seqs"] += 1
            stats["tokens"] += n_tok
            stats["chunks"] += n
            stats["pad"] += n * chunk_size - n_tok
        stats["calls"] += 1
        return orig(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                    use_qk_l2norm_in_kernel, initial_state_indices, scale, chunk_size)  # fmt: skip

    delta_rule.chunk_gated_delta_rule = counted

    def dump() -> None:
        with open(f"{out}.{os.getpid()}.json", "w") as f:
            json.dump(stats, f)

    def periodic() -> None:
        while True:
            time.sleep(10)
            dump()

    atexit.register(dump)
    threading.Thread(target=periodic, daemon=True).start()


if OUT:
    try:
        _install(OUT)
    except ImportError:  # a process without the kernels (the client): nothing to count
        pass

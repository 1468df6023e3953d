"""``--radix-cache-backend sparse`` at ``--tp 2`` on the real CPU server, on both recurrent families.

SGLang runs one scheduler, hence one cache, per tensor-parallel rank; every cache decision must be
the same function of the request stream on each. Per family (tiny Qwen3-Next: GatedDeltaNet; tiny
Nemotron-H: Mamba2, SSM chunk 128), one TP=2 server on extra_buffer (page 16, overlap on, the
policy's mirror checked after every change) serves every sequential pattern of
``test_sparse_backend.py`` and then a storm with client aborts against a small state pool. Asserted:
greedy tokens identical to the family's no-cache server (the session's, shared with the other
modules); both ranks' statistics in ``/server_info`` (``sparse_cache_ranks``) and equal on every
decision (``sparse_cache_ranks_agree``, :data:`RANK_AGREEMENT_KEYS`); on each rank captures
published in the forward, none incomplete, no cut, no invariant violation, nothing leaked at idle.
The ranks run on separate cores (``SGLANG_CPU_OMP_THREADS_BIND=0|1``). About 4 minutes on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(cpu_platform=True)

from sparse_testing.reference import NoCacheReference  # noqa: E402
from sparse_testing.storm import new_tokens, run_storm, storm_prompts  # noqa: E402
from test_mamba2_backend import CHECK_ENV, patterns  # noqa: E402
from test_sparse_backend import toks  # noqa: E402

from sglang_sparse.testing.server import SGLangServer, strategy_setup  # noqa: E402

TP = 2
PAGE = 16
STORM = 60
#: per family: the session fixture of its no-cache server
REFERENCES = {"qwen3_next": "nocache", "nemotron_h": "nemotron_reference"}


def _tp_server(model_dir: Any, log_dir: Any) -> SGLangServer:
    base, env = strategy_setup("extra_buffer")
    return SGLangServer(
        model_dir,
        base_args=base,
        extra_args=[
            "--tp",
            str(TP),
            "--page-size",
            str(PAGE),
            "--chunked-prefill-size",
            "256",
            "--radix-cache-backend",
            "sparse",
        ],
        env={**env, **CHECK_ENV, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        context_length=4096,
        max_total_tokens=6000,
        max_mamba_cache_size=24,
        log_path=log_dir / "tp2.log",
    ).start(timeout=400)


@pytest.mark.parametrize("arch", list(REFERENCES))
def test_tp2_ranks_agree_and_tokens_identical(
    arch: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref: NoCacheReference = request.getfixturevalue(REFERENCES[arch])
    prompts = storm_prompts(STORM, toks)
    with _tp_server(ref.model_dir, tmp_path_factory.mktemp(f"tp2_{arch}")) as srv:
        got = patterns(srv)
        done = run_storm(srv, prompts, workers=16)
        assert srv.alive(), srv.log_tail()
        srv.wait_sparse_idle()
        # raises unless /server_info holds every rank and they agree on RANK_AGREEMENT_KEYS
        ranks = srv.sparse_rank_stats()
        log = srv.log_tail(5_000_000)
    assert len(ranks) == TP, ranks
    for r in ranks:
        print(arch, {k: r[k] for k in ("states_held", "captures_published", "cuts_applied", "alpha")})
        assert r["capture_mode"] == "forward" and r["captures_published"] > 0, r
        assert r["captures_incomplete"] == 0 and r["captures_pending"] == 0 and r["cuts_applied"] == 0, r
        assert r["invariant_violations"] == 0 and r["mirror_errors"] == 0, r
        assert r["kv_protected"] == 0 and r["mamba_protected"] == 0, r
        assert r["mamba_available"] + r["states_held"] == r["mamba_pool_size"], r
    assert "leaked_mamba_pages={" not in log and "Traceback" not in log
    assert got["outputs"] == patterns(ref)["outputs"]
    assert sum(got["cached"]) > 0, got["cached"]
    assert len(done) >= STORM // 2, len(done)
    assert done == {k: ref.generate(prompts[k], new_tokens(k)).output_ids for k in sorted(done)}

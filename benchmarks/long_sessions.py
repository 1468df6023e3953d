"""Soak: very long and interleaved multi-turn sessions on the real CPU server (``sparse`` backend).

Default options (``--radix-cache-backend sparse`` only, alpha ``auto``), plus the in-server check
that the policy's mirror equals SGLang's tree after every checkpoint and eviction
(``SGLANG_SPARSE_CHECK_INVARIANTS=1``). Two phases on one server:

1. one session of ``--turns`` turns (2,000; ~10 new tokens a turn: 8 user + 2 generated), i.e. a
   radix chain 2,000 nodes deep;
2. ``--sessions`` sessions (20) of ``--session-turns`` turns (300), interleaved round by round with
   the turns of a round sent concurrently, in a KV pool that holds a fraction of their footprint.

Then: pools at idle (nothing protected, every KV/state slot free or held by the tree), alpha
tunes, invariant violations, and greedy tokens on sampled turns compared with a
``--disable-radix-cache`` server (a full no-cache replay of 2,000 growing prompts would take hours
here). Writes ``benchmarks/results/long_sessions.json``.

    python -m benchmarks.long_sessions [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sglang_sparse.models.tiny import make_tiny_model
from sglang_sparse.testing.server import SGLangServer
from sglang_sparse.testing.sessions import mismatches, run_sessions, sample_turns

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import bar, results_dir, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=2000, help="turns of the single long session")
    ap.add_argument("--sessions", type=int, default=20, help="interleaved sessions")
    ap.add_argument("--session-turns", type=int, default=300, help="turns of each interleaved session")
    ap.add_argument("--kv-tokens", type=int, default=64_000, help="KV pool (tokens)")
    ap.add_argument("--state-slots", type=int, default=64, help="Mamba state pool (slots)")
    ap.add_argument("--quick", action="store_true", help="300 turns; 4 x 60 interleaved")
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.sessions, args.session_turns, args.kv_tokens = 300, 4, 60, 8000
    context = 1 << max(12, (args.turns * 10 + 256).bit_length())
    model = make_tiny_model(
        Path(tempfile.gettempdir()) / f"sglang_sparse_soak_{context}",
        arch="qwen3_next",
        seed=0,
        max_position_embeddings=context,
    )
    common = dict(
        context_length=context, max_total_tokens=args.kv_tokens, max_mamba_cache_size=args.state_slots
    )
    env = {"SGLANG_SPARSE_CHECK_INVARIANTS": "1"}
    out: dict[str, Any] = {"args": vars(args), "context_length": context}
    srv = SGLangServer(model, ["--radix-cache-backend", "sparse"], env, **common).start(timeout=600)
    try:
        with bar(args.turns, "long session (turns)") as pb:
            chain = run_sessions(
                lambda p, n: srv.generate(p, n, timeout=600),
                sessions=1,
                turns=args.turns,
                seed=1,
                progress=lambda k: pb.update(1),
            )
        alive_after_chain = srv.alive()
        with bar(args.session_turns, f"{args.sessions} interleaved sessions (rounds)") as pb:
            inter = run_sessions(
                lambda p, n: srv.generate(p, n, timeout=600),
                sessions=args.sessions,
                turns=args.session_turns,
                seed=2,
                progress=lambda k: pb.update(1),
            )
        s = srv.wait_sparse_idle(timeout=120)
    finally:
        log_tail = srv.log_tail(3000)
        srv.stop()
    footprint = sum(len(p[-1]) + 2 for p in inter.prompts)
    out.update(
        long_session={
            "turns": args.turns,
            "seconds": chain.seconds,
            "last_prompt_tokens": len(chain.prompts[0][-1]),
            "cached_share": sum(chain.cached[0][1:]) / max(1, sum(len(p) for p in chain.prompts[0][1:])),
            "server_alive": alive_after_chain,
        },
        interleaved={
            "sessions": args.sessions,
            "turns": args.session_turns,
            "seconds": inter.seconds,
            "footprint_tokens": footprint,
            "kv_pool_share_of_footprint": args.kv_tokens / footprint,
            "cached_share": sum(map(sum, inter.cached))
            / max(1, sum(len(p) for ps in inter.prompts for p in ps)),
        },
        stats=s,
        pools_clean=(
            s["kv_protected"] == 0
            and s["mamba_protected"] == 0
            and s["kv_available"] + s["kv_evictable"] == s["kv_pool_size"]
            and s["mamba_available"] + s["states_held"] == s["mamba_pool_size"]
        ),
    )
    ref = SGLangServer(model, ["--disable-radix-cache"], None, **common).start(timeout=600)
    try:
        gen = lambda p, n: ref.generate(p, n, timeout=1800)  # noqa: E731
        chain_turns = sample_turns(args.turns, head=8, every=max(1, args.turns // 8))
        inter_turns = sample_turns(args.session_turns, head=2, every=max(1, args.session_turns // 3))
        inter_sessions = sorted({0, args.sessions // 2, args.sessions - 1})
        t0 = time.perf_counter()
        bad_chain = mismatches(chain, gen, chain_turns, [0])
        bad_inter = mismatches(inter, gen, inter_turns, inter_sessions)
        out["token_check"] = {
            "long_session_turns_checked": chain_turns,
            "interleaved_checked": {"sessions": inter_sessions, "turns": inter_turns},
            "mismatches": bad_chain + bad_inter,
            "seconds": time.perf_counter() - t0,
        }
    finally:
        ref.stop()
    ok = (
        alive_after_chain
        and out["pools_clean"]
        and not out["token_check"]["mismatches"]
        and s["invariant_violations"] == 0
        and s["mirror_errors"] == 0
        and s["tune_failures"] == 0
    )
    out["ok"] = bool(ok)
    print(
        f"long session: {args.turns} turns in {chain.seconds:.0f} s (last prompt "
        f"{out['long_session']['last_prompt_tokens']} tokens, cached share "
        f"{out['long_session']['cached_share']:.3f})\n"
        f"interleaved: {args.sessions} x {args.session_turns} turns in {inter.seconds:.0f} s, KV pool = "
        f"{out['interleaved']['kv_pool_share_of_footprint']:.2f} of the footprint, cached share "
        f"{out['interleaved']['cached_share']:.3f}\n"
        f"alpha tunes: {len(s['alpha_tunes'])} (failures {s['tune_failures']}), states evicted "
        f"{s['states_evicted']}, KV leaves evicted {s['kv_leaves_evicted']}, invariant violations "
        f"{s['invariant_violations']}, mirror errors {s['mirror_errors']}, pools clean {out['pools_clean']}\n"
        f"tokens vs no cache on {len(chain_turns) + len(inter_turns) * len(inter_sessions)} sampled turns: "
        f"{len(out['token_check']['mismatches'])} mismatches"
    )
    if not ok:
        print("FAILED; server log tail:\n" + log_tail)
    path = write_json("long_sessions", out, results_dir(args.quick))
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

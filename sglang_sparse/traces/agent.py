"""``agent`` trace: real SWE-agent trajectories replayed as multi-turn sessions.

For every assistant message ``messages[j]`` (j >= 1) one turn is emitted: the input is
``messages[0..j-1]`` rendered + the assistant header, the output is that assistant message
(content + tool calls + ``<|im_end|>\\n``). For the usual system/user/assistant/tool layout, turn i
(0-based) sends ``messages[0 .. 2i+1]``. Invariant: ``input(turn i) + output(turn i)`` is an exact
token prefix of ``input(turn i+1)``.

A session stops after ``max_turns`` turns or before the first turn whose input+output exceeds
``max_context_tokens``; the final ``exit`` pseudo-message is never sent. Sessions start as a Poisson
process (mean gap ``session_interarrival_s``); within a session the next turn arrives
``num_output_tokens / decode_tokens_per_s + Exp(mean_tool_time_s)`` seconds after the previous one.
"""

from __future__ import annotations

import os

import numpy as np

from .common import BuiltTrace, check_positive, poisson_arrivals, round_ts, sort_requests
from .data import load_trajectories
from .schema import Request
from .tokenizer import assistant_output, header, render_message

DESCRIPTION = "real SWE-agent trajectories as multi-turn sessions (turn i extends turn i-1 + output)"

_SENT_ROLES = ("system", "user", "assistant", "tool")


def build(
    seed: int,
    data_dir: str | os.PathLike[str] | None,
    *,
    num_sessions: int = 16,
    max_turns: int = 24,
    max_context_tokens: int = 32768,
    session_interarrival_s: float = 20.0,
    mean_tool_time_s: float = 4.0,
    decode_tokens_per_s: float = 50.0,
) -> BuiltTrace:
    """Build the trace; times are logical seconds, lengths tokens."""
    check_positive(
        num_sessions=num_sessions,
        max_turns=max_turns,
        max_context_tokens=max_context_tokens,
        decode_tokens_per_s=decode_tokens_per_s,
    )
    rng = np.random.default_rng(seed)
    trajs = load_trajectories(data_dir)
    if num_sessions > len(trajs):
        raise ValueError(f"num_sessions={num_sessions} but only {len(trajs)} usable trajectories exist")
    picked = [trajs[int(i)] for i in rng.permutation(len(trajs))[:num_sessions]]
    starts = poisson_arrivals(rng, num_sessions, session_interarrival_s)
    asst_h = header("assistant")
    requests: list[Request] = []
    sessions_info = []
    for traj, start in zip(picked, starts, strict=True):
        sid = f"swe-{traj.instance_id}"
        ctx: list[int] = []
        ts = float(start)
        turn = 0
        stop = "end of trajectory"
        for j, msg in enumerate(traj.messages):
            role = msg["role"]
            if role not in _SENT_ROLES:
                break  # the trailing "exit" record is not a chat message
            if role == "assistant" and j >= 1:
                if turn >= max_turns:
                    stop = "max_turns"
                    break
                out = assistant_output(msg)
                inp = ctx + asst_h
                if len(inp) + len(out) > max_context_tokens:
                    stop = "max_context_tokens"
                    break
                requests.append(Request.make(sid, turn, round_ts(ts), inp, out))
                turn += 1
                gap = len(out) / decode_tokens_per_s
                gap += float(rng.exponential(mean_tool_time_s)) if mean_tool_time_s > 0 else 0.0
                ts += gap
            ctx += render_message(msg)
        sessions_info.append({"session_id": sid, "turns": turn, "stop": stop})
    return BuiltTrace(sort_requests(requests), {"sessions": sessions_info})

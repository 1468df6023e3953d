"""``system_prompts`` trace: popular real system prompts + a short synthetic user turn.

Each request is a single-turn session::

    <|im_start|>system\\n{prompt}<|im_end|>\\n<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n

The prompt is drawn with Zipf-like popularity over a seeded random permutation of the corpus, so
many requests share each prompt exactly (prefix reuse = the system block). Prompts are truncated
(in tokens) so that every input is at most ``max_request_tokens``. Arrivals are Poisson.
"""

from __future__ import annotations

import os

import numpy as np

from .common import (
    BuiltTrace,
    check_positive,
    check_range,
    poisson_arrivals,
    single_turn,
    sort_requests,
    system_prompt_tokens,
    zipf_probabilities,
)
from .schema import Request
from .textgen import user_turn_tokens
from .tokenizer import footer, header

DESCRIPTION = "real system prompts with Zipf popularity + short synthetic user turns (single-turn)"


def build(
    seed: int,
    data_dir: str | os.PathLike[str] | None,
    *,
    num_requests: int = 1000,
    zipf_exponent: float = 1.0,
    arrival_rate: float = 4.0,
    max_request_tokens: int = 32768,
    user_min_tokens: int = 10,
    user_max_tokens: int = 60,
    output_min_tokens: int = 16,
    output_max_tokens: int = 128,
) -> BuiltTrace:
    """Build the trace. ``arrival_rate`` is requests per logical second; lengths are tokens."""
    check_positive(num_requests=num_requests, arrival_rate=arrival_rate)
    check_range("user tokens", user_min_tokens, user_max_tokens, minimum=1)
    check_range("output tokens", output_min_tokens, output_max_tokens, minimum=2)
    rng = np.random.default_rng(seed)
    prompts = system_prompt_tokens(data_dir)
    sys_h, user_h, asst_h, foot = header("system"), header("user"), header("assistant"), footer()
    overhead = len(sys_h) + len(foot) + len(user_h) + len(foot) + len(asst_h)
    budget = max_request_tokens - overhead - user_max_tokens
    if budget < 1:
        raise ValueError(f"max_request_tokens={max_request_tokens} leaves no room for the system prompt")
    probs = zipf_probabilities(len(prompts), zipf_exponent, rng)
    choice = rng.choice(len(prompts), size=num_requests, p=probs)
    times = poisson_arrivals(rng, num_requests, 1.0 / arrival_rate)
    blocks: dict[int, list[int]] = {}
    requests: list[Request] = []
    for i in range(num_requests):
        k = int(choice[i])
        if k not in blocks:
            blocks[k] = sys_h + list(prompts[k][1][:budget]) + foot
        inp = blocks[k] + user_h + user_turn_tokens(rng, user_min_tokens, user_max_tokens) + foot + asst_h
        requests.append(single_turn(rng, f"sp-{i:06d}", times[i], inp, output_min_tokens, output_max_tokens))
    used = sorted(blocks)
    info = {
        "num_prompts_in_corpus": len(prompts),
        "num_distinct_prompts_used": len(used),
        "truncated_prompts_used": sum(1 for k in used if len(prompts[k][1]) > budget),
    }
    return BuiltTrace(sort_requests(requests), info)

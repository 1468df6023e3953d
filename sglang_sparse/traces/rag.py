"""``rag`` trace: shared instructions + k retrieved chunks + a question (single-turn sessions).

Chunks are consecutive passages of ``[min_chunk_tokens, max_chunk_tokens]`` tokens cut from the
system-prompt corpus (prompts in seeded random order; a chunk never spans two prompts). Each
request retrieves ``k`` distinct chunks with Zipf-like popularity (exponent ``zipf_exponent`` over a
random permutation of the chunks) in random order::

    <|im_start|>system\\n{instructions}<|im_end|>\\n<|im_start|>user\\nContext passages:\\n\\n
    {chunk_1}\\n\\n---\\n\\n{chunk_2} ... {chunk_k}\\n\\nQuestion: {q}<|im_end|>\\n<|im_start|>assistant\\n

Chunk and separator tokens are concatenated, so two requests whose first m chunks agree share
exactly ``prefix + m chunks (+ separators)`` tokens: partial overlaps at chunk boundaries.
Arrivals are Poisson with ``arrival_rate`` requests per logical second.
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
from .textgen import rag_question
from .tokenizer import footer, get_tokenizer, header, render_text_message

DESCRIPTION = "shared instructions + k Zipf-popular retrieved chunks in random order + a question"

INSTRUCTIONS = (
    "You are a retrieval-augmented assistant. The user message starts with passages retrieved from a "
    "knowledge base of assistant system prompts, separated by lines of three dashes, followed by a "
    "question. Answer only from the passages. If they do not contain the answer, say that you do not "
    "know. Keep answers short, cite passages by their order (first, second, ...), and never invent "
    "policies, tools or product names that are not mentioned in the passages."
)
SEPARATOR = "\n\n---\n\n"


def cut_chunks(
    rng: np.random.Generator, docs: list[tuple[int, ...]], num_chunks: int, min_tokens: int, max_tokens: int
) -> list[tuple[int, ...]]:
    """Up to ``num_chunks`` passages with lengths uniform in ``[min_tokens, max_tokens]``.

    Documents are visited in a random order and cut left to right; tails shorter than
    ``min_tokens`` are dropped, so every chunk length lies in the range."""
    chunks: list[tuple[int, ...]] = []
    for d in rng.permutation(len(docs)):
        ids = docs[int(d)]
        pos = 0
        while len(chunks) < num_chunks:
            n = int(rng.integers(min_tokens, max_tokens + 1))
            if pos + n > len(ids):
                break
            chunks.append(ids[pos : pos + n])
            pos += n
        if len(chunks) >= num_chunks:
            break
    return chunks


def build(
    seed: int,
    data_dir: str | os.PathLike[str] | None,
    *,
    num_requests: int = 1000,
    k: int = 4,
    num_chunks: int = 1000,
    min_chunk_tokens: int = 256,
    max_chunk_tokens: int = 512,
    zipf_exponent: float = 1.0,
    arrival_rate: float = 4.0,
    output_min_tokens: int = 16,
    output_max_tokens: int = 128,
) -> BuiltTrace:
    """Build the trace; ``arrival_rate`` in requests per logical second, lengths in tokens."""
    check_positive(num_requests=num_requests, k=k, num_chunks=num_chunks, arrival_rate=arrival_rate)
    check_range("chunk tokens", min_chunk_tokens, max_chunk_tokens, minimum=1)
    check_range("output tokens", output_min_tokens, output_max_tokens, minimum=2)
    rng = np.random.default_rng(seed)
    tok = get_tokenizer()
    corpus = [ids for _, ids in system_prompt_tokens(data_dir)]
    chunks = cut_chunks(rng, corpus, num_chunks, min_chunk_tokens, max_chunk_tokens)
    if len(chunks) < k:
        raise ValueError(f"corpus yields only {len(chunks)} chunks, fewer than k={k}")
    probs = zipf_probabilities(len(chunks), zipf_exponent, rng)
    times = poisson_arrivals(rng, num_requests, 1.0 / arrival_rate)
    head = render_text_message("system", INSTRUCTIONS) + header("user") + tok.encode("Context passages:\n\n")
    sep = tok.encode(SEPARATOR)
    tail = footer() + header("assistant")
    requests: list[Request] = []
    for i in range(num_requests):
        picked = rng.choice(len(chunks), size=k, replace=False, p=probs)
        picked = picked[rng.permutation(k)]
        inp = list(head)
        for m, c in enumerate(picked):
            if m:
                inp += sep
            inp += chunks[int(c)]
        about = chunks[int(picked[int(rng.integers(k))])]
        inp += tok.encode("\n\nQuestion: " + rag_question(rng, list(about))) + tail
        requests.append(single_turn(rng, f"rag-{i:06d}", times[i], inp, output_min_tokens, output_max_tokens))
    info = {
        "num_chunks": len(chunks),
        "prefix_tokens": len(head),
        "separator_tokens": len(sep),
    }
    return BuiltTrace(sort_requests(requests), info)
